"""The ``compile_cuda_graphs`` pass run again on a compiled model's graph: what the tests of its switches and
refusals share (test_piecewise.py, test_mixed_graphs.py)."""

import copy


def apply_cuda_graph_pass(model, config: dict, artifact: str, properties=("state_is_kv_only",)):
    """The pass with ``config`` on a copy of ``model``'s graph (the torch attention backend named, as the CPU
    stand-ins need); returns the runner it left in ``artifact`` (or None) and its pass-table detail."""
    from autodeploy.passes.compile_cuda_graphs import CompileCudaGraphs, CudaGraphConfig
    from autodeploy.pipeline.base import CompileContext

    ctx = CompileContext(gm=copy.deepcopy(model.gm), hf_config=model.hf_config, config=model.config, device=model.device,
                         dtype=model.report.dtype, properties=set(properties),
                         artifacts={"kv_pool": model.pool, "kv_capacity": model.capacity, "attention_backend": "torch"})
    result = CompileCudaGraphs(CudaGraphConfig(**config)).apply(ctx)
    return ctx.artifacts.get(artifact), result.detail
