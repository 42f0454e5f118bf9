"""End-to-end tests of the compiler on tiny random checkpoints of real HF architectures."""
