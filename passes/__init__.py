"""Pipeline passes, registered lazily by name (imported only when a pipeline uses them)."""

from autodeploy.pipeline.base import PASSES

_BUILTIN = {
    "canonicalize_attention": "autodeploy.passes.canonicalize:CanonicalizeAttention",
    "canonicalize_rope": "autodeploy.passes.canonicalize:CanonicalizeRoPE",
    "canonicalize_norms": "autodeploy.passes.canonicalize:CanonicalizeNorms",
    "canonicalize_mlp": "autodeploy.passes.canonicalize:CanonicalizeMLP",
    "canonicalize_moe": "autodeploy.passes.canonicalize:CanonicalizeMoE",
    "canonicalize_state": "autodeploy.passes.canonicalize_state:CanonicalizeState",
    "check_uncached_state": "autodeploy.passes.check_uncached_state:CheckUncachedState",
    "gather_logits": "autodeploy.passes.gather_logits:GatherLogits",
    "quantize": "autodeploy.passes.quantize:Quantize",
    "shard": "autodeploy.passes.shard:Shard",
    "fuse_qkv": "autodeploy.passes.fuse:FuseQKV",
    "fuse_gate_up": "autodeploy.passes.fuse:FuseGateUp",
    "fuse_add_rms_norm": "autodeploy.passes.fuse:FuseAddRMSNorm",
    "fuse_rope_qk": "autodeploy.passes.fuse:FuseRoPEQK",
    "fuse_norm_linear": "autodeploy.passes.fuse:FuseNormLinear",
    "decode_linear": "autodeploy.passes.fuse:DecodeLinear",
    "load_weights": "autodeploy.passes.load_weights:LoadWeights",
    "insert_kv_cache": "autodeploy.passes.insert_kv_cache:InsertKVCache",
    "insert_state_cache": "autodeploy.passes.insert_state_cache:InsertStateCache",
    "fuse_rope_attention": "autodeploy.passes.fuse_rope_attention:FuseRoPEAttention",
    "tabulate_positions": "autodeploy.passes.tabulate_positions:TabulatePositions",
    "allocate_kv_cache": "autodeploy.passes.allocate_kv_cache:AllocateKVCache",
    "warm_up": "autodeploy.passes.warm_up:WarmUp",
    "compile_cuda_graphs": "autodeploy.passes.compile_cuda_graphs:CompileCudaGraphs",
}
for _name, _target in _BUILTIN.items():
    PASSES.register_lazy(_name, _target)
