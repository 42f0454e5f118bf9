"""The model zoo: HF architectures the compiler must handle with zero per-model code.

Each entry is a real transformers architecture built tiny (``autodeploy.tiny.TINY_OVERRIDES``) with
random weights, exported with HF's eager attention code unless ``attn_implementation`` says
otherwise. ``windows`` is the sliding window each attention layer must end up with (None: full
causal attention), ``chunks`` its chunk size (Llama-4's chunked attention), ``alibi`` whether the
layers carry ALiBi slopes, ``sinks`` whether they have learned attention sinks; ``xfail`` holds the
real reason when an architecture cannot pass yet (the README lists the same reasons); ``refused`` the
error a model we must not run (state the KV cache does not hold) has to stop with; ``mla`` models cache
a latent per token (``paged_mla``); ``engine`` models also run through the engine with too few blocks
(preemption) and an abort. ``state_layers`` counts the layers with recurrent state (``state_op``:
Mamba-2's SSM scan or Gated DeltaNet's delta rule, each with its causal convolution), ``lightning_layers``
those with lightning attention (MiniMax's decayed linear attention), both kept in the state pool beside the
KV cache; ``attention_layers`` the paged-attention layers when not every layer has one.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = (None, None)  # two layers of full causal attention


@dataclass(frozen=True)
class ZooModel:
    model_type: str
    exercises: str
    windows: tuple[int | None, ...] = FULL
    chunks: tuple[int | None, ...] = FULL
    alibi: bool = False  # every attention layer has ALiBi slopes
    sinks: bool = False  # every attention layer has learned attention sinks
    moe_layers: int = 0
    state_layers: int = 0  # <state_op>_cached (and as many causal_conv1d_cached) in the compiled graph
    state_op: str = "ssm_scan"  # the recurrent state op of those layers
    lightning_layers: int = 0  # lightning_attention_cached in the compiled graph
    attention_layers: int | None = None  # None: every layer
    xfail: str | None = None
    refused: str | None = None  # the compile must stop with an error matching this (what we cannot run)
    slow: bool = False  # export alone takes ~20 s on the CI machine
    attn_implementation: str = "eager"  # the HF attention code that is exported
    mla: bool = False  # multi-head latent attention: every attention layer is ``paged_mla`` over a latent cache
    engine: bool = False  # also through the engine: KV exhaustion preempts, abort frees every block

    @property
    def name(self) -> str:
        suffix = "" if self.attn_implementation == "eager" else f"-{self.attn_implementation}"
        return self.model_type + suffix


ZOO: tuple[ZooModel, ...] = (
    ZooModel("llama", "GQA, half-rotate RoPE, RMSNorm, SwiGLU"),
    ZooModel("mistral", "sliding window 8 on every layer", windows=(8, 8)),
    ZooModel("qwen2", "q/k/v bias"),
    ZooModel("qwen3", "q/k RMSNorm over the head dim"),
    ZooModel("gemma", "RMSNorm 1+w, GeGLU (tanh), scaled embeddings, tied head"),
    ZooModel("gemma2", "attention + final logit softcap, query_pre_attn_scalar, sliding/full layers",
             windows=(8, None)),
    ZooModel("gemma3_text", "sliding/full layers with their own RoPE bases, q/k norms", windows=(8, None)),
    ZooModel("phi3", "fused qkv and gate_up projections"),
    ZooModel("gpt_neox", "partial rotary (25%), parallel residual, LayerNorm, GELU MLP"),
    ZooModel("gpt2", "learned positions, Conv1D projections, no RoPE"),
    ZooModel("olmo2", "q/k RMSNorm over the whole projection, norms after the sublayers"),
    ZooModel("starcoder2", "LayerNorm with bias, GELU MLP with bias"),
    ZooModel("granite", "embedding/attention/residual/logit multipliers"),
    ZooModel("mixtral", "MoE: softmax top-2 routing, batched_mm experts", moe_layers=2),
    ZooModel("qwen3_moe", "MoE with renormalized top-k, q/k norms", moe_layers=2),
    ZooModel("qwen2_moe", "MoE plus a gated shared expert", moe_layers=2),
    ZooModel("cohere", "interleaved RoPE, parallel attention + MLP, logit scale"),
    ZooModel("phi", "partial rotary (50%), parallel attention + MLP"),
    ZooModel("olmo", "LayerNorm without parameters"),
    ZooModel("stablelm", "partial rotary (25%), LayerNorm"),
    ZooModel("falcon", "fused qkv with broadcast kv heads, scores /= sqrt(d) in place"),
    ZooModel("gptj", "interleaved partial rotary, scores / sqrt(d)"),
    ZooModel("opt", "learned positions with offset, ReLU MLP"),
    ZooModel("gpt_bigcode", "multi-query attention (one kv head), learned positions"),
    ZooModel("codegen", "mask added before the scale division, interleaved partial rotary"),
    ZooModel("nemotron", "squared-ReLU MLP, LayerNorm 1+w, partial rotary"),
    ZooModel("cohere2", "sliding/full layers, RoPE only on sliding layers", windows=(8, None)),
    ZooModel("olmo3", "sliding/full layers, q/k norms", windows=(8, None)),
    ZooModel("ministral", "sliding/full layers", windows=(8, None)),
    ZooModel("olmoe", "MoE without top-k renormalization, q/k norms", moe_layers=2),
    ZooModel("granitemoe", "MoE with Granite multipliers", moe_layers=2),
    ZooModel("phimoe", "MoE with sparsemixer routing", moe_layers=2),
    ZooModel("mistral", "HF SDPA attention code, sliding window as a boolean mask", windows=(8, 8),
             attn_implementation="sdpa"),
    ZooModel("gemma3_text", "HF SDPA attention code, sliding + full layer", windows=(8, None),
             attn_implementation="sdpa"),
    ZooModel("bloom", "ALiBi position bias through baddbmm, attention on [B * H, S, D] with bmm", alibi=True),
    ZooModel("mpt", "ALiBi bias built for max_seq_len and sliced per step, masked_fill mask", alibi=True),
    ZooModel("xglm", "bmm attention, scores clamped at the dtype's lowest value, sinusoidal positions"),
    ZooModel("gpt_neo", "local (window 8) + global layer: a causal buffer through where, unscaled scores",
             windows=(8, None)),
    ZooModel("llama4_text", "chunked attention (8) on the RoPE layer, NoPE layer with query temperature",
             chunks=(8, None)),
    ZooModel("hunyuan_v1_dense", "q/k norms after the rotary embedding, head_dim left to the checkpoint"),
    ZooModel("qwen3_next", "Gated DeltaNet layer (delta rule provided to transformers, causal conv, gated RMSNorm, "
             "GQA-style q/k heads) + full attention layer (output gate, partial rotary); MoE with a sigmoid-gated "
             "shared expert: state pool", windows=(None,), chunks=(None,), state_layers=1, state_op="gated_delta_rule",
             attention_layers=1, moe_layers=1, engine=True),
    ZooModel("bamba", "Mamba-2 layer (SSD scan, causal conv, gated RMSNorm) + attention layer: state pool",
             windows=(None,), chunks=(None,), state_layers=1, attention_layers=1, engine=True),
    ZooModel("nemotron_h", "Mamba-2 + attention + MLP-only layers (one sublayer each), state pool",
             windows=(None,), chunks=(None,), state_layers=1, attention_layers=1),
    ZooModel("granitemoehybrid", "Mamba-2 + attention layer, MoE with Granite multipliers, state pool",
             windows=(None,), chunks=(None,), state_layers=1, attention_layers=1, moe_layers=2),
    ZooModel("falcon_h1", "attention and Mamba-2 side by side in every layer, muP multipliers (a buffer its model's "
             "_init_weights fills), state pool", state_layers=2),
    ZooModel("minimax", "lightning attention (decayed linear attention in blocks of 16, the prompts span three) + "
             "full attention layer, MoE in both: state pool", windows=(None,), chunks=(None,), lightning_layers=1,
             attention_layers=1, moe_layers=2, engine=True),
    ZooModel("dots1", "DeepSeek-style sigmoid routing with a correction bias and a shared expert; layer 0 dense",
             moe_layers=1),
    ZooModel("gpt_oss", "attention sinks, sliding (8) + full layer, YaRN; MoE with a biased router, transposed "
             "experts with biases, interleaved gate/up and clamped SwiGLU", windows=(8, None), moe_layers=2,
             sinks=True, engine=True),
    ZooModel("deepseek_v3", "MLA (compressed q, latent 32 + rotary key 8, interleaved RoPE, YaRN mscale) over a "
             "latent cache; grouped sigmoid routing with a shared expert, layer 0 dense", mla=True, moe_layers=1,
             engine=True),
)
