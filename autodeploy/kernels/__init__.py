"""Triton kernels: pure functions called only from canonical-op backends (see ``autodeploy.ops``)."""
