"""Tiny random checkpoints of real HF architectures (tests, the model zoo, the quick start).

``make_tiny_checkpoint("llama", dir)`` builds the real transformers model class from
``AutoConfig.for_model`` shrunk to a few layers and a small hidden size, with random weights, and
saves it with ``save_pretrained`` (safetensors). Architecture-specific sizes live in ``TINY_OVERRIDES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    # special tokens inside the tiny vocabulary (defaults of some configs point past it)
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# model_type -> config fields on top of BASE (names as the HF config class spells them)
# Head dims are pinned to hidden / heads = 16 where the config has its own default; sliding windows
# are small (8) so that the canary's prompts (up to 40 tokens + 16 steps) cross them.
_SLIDING_THEN_FULL = {"layer_types": ["sliding_attention", "full_attention"]}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2}
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
         "beta_slow": 1.0}
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12}
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"head_dim": 16, "sliding_window": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 8, **_SLIDING_THEN_FULL,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 8, **_SLIDING_THEN_FULL},
    "phi3": {},
    "gpt_neox": {},  # partial rotary (25% of the head), parallel residual
    "gpt2": {},  # learned positions
    "olmo2": {},
    "starcoder2": {},
    "granite": {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                "logits_scaling": 2.0},
    "mixtral": {**_MOE},
    "qwen3_moe": {**_MOE, "head_dim": 16, "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen2_moe": {**_MOE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "cohere": {},  # interleaved rotary, parallel attention + MLP
    "phi": {},  # partial rotary (50%), LayerNorm, plain GELU MLP
    "olmo": {},  # LayerNorm without parameters
    "stablelm": {},  # partial rotary (25%)
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "gptj": {"rotary_dim": 8},  # interleaved partial rotary
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "gpt_bigcode": {"multi_query": True},
    "codegen": {"rotary_dim": 8, "n_ctx": 512},
    "nemotron": {"head_dim": 16},
    "persimmon": {},
    "olmoe": {**_MOE},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "glm": {"head_dim": 16},
    "helium": {"head_dim": 16},
    "cohere2": {"head_dim": 16, "sliding_window": 8, **_SLIDING_THEN_FULL},
    "smollm3": {},
    "exaone4": {"head_dim": 16},
    "olmo3": {"sliding_window": 8, **_SLIDING_THEN_FULL},
    "ministral": {"head_dim": 16, "sliding_window": 8, **_SLIDING_THEN_FULL},
    "bloom": {},  # ALiBi
    "mpt": {},  # ALiBi (its bias is built for max_seq_len 2048 and sliced per length)
    "xglm": {},  # bmm attention, scores clamped at the dtype's lowest value
    # local (window 8) then global layer: the config's attention_types must cover exactly num_layers
    "gpt_neo": {"attention_types": [[["local", "global"], 1]], "window_size": 8},
    # chunks of 8 on the RoPE layer, the NoPE layer full with its query temperature (floor_scale 4:
    # it changes every 4 tokens), dense MLPs (no MoE layer)
    "llama4_text": {"head_dim": 16, "attention_chunk_size": 8, "no_rope_layers": [1, 0], "floor_scale": 4,
                    "intermediate_size_mlp": 128, "num_local_experts": 4, "moe_layers": []},
    "hunyuan_v1_dense": {},  # its config leaves head_dim None (tiny_config fills it in)
    # Gated DeltaNet layer (2 key heads for 4 value heads) then full attention (output gate, partial rotary);
    # layer 0 dense, layer 1 MoE with a sigmoid-gated shared expert
    "qwen3_next": {**_MOE, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                   "mlp_only_layers": [0], "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16},
    # lightning (linear) attention layer 0 in blocks of 16 (the canary's 40-token prompts span three), full
    # attention layer 1, MoE in both
    "minimax": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "block_size": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    # Mamba-2 hybrids: layer 0 Mamba-2 (8 heads of 16, 2 groups, state 16, chunks of 16 so the canary's
    # 40-token prompts span three), layer 1 attention
    "bamba": {**_MAMBA2, "attn_layer_indices": [1]},
    "falcon_h1": {**_MAMBA2, "mamba_d_ssm": 128, "head_dim": 16},  # attention and Mamba-2 side by side in each layer
    "granitemoehybrid": {**_MAMBA2, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
                         "num_experts_per_tok": 2},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16,
                   "head_dim": 16, "layers_block_type": ["mamba", "attention", "mlp"], "num_hidden_layers": 3},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
              "first_k_dense_replace": 1},  # its config leaves the MoE sizes None; layer 0 dense, layer 1 MoE
    # sinks, sliding (8) then full layer, YaRN RoPE, MoE: router with bias, transposed experts with biases,
    # interleaved gate/up, clamped SwiGLU; YaRN's original context a quarter of the tiny maximum
    "gpt_oss": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                **_SLIDING_THEN_FULL, "rope_parameters": {**_YARN, "rope_theta": 150000.0}},
    # MLA (q through q_a/q_b with its norm, latent 32 + rotary key 8, nope 16, v 12, YaRN with mscale in
    # the softmax scale), layer 0 dense, layer 1 MoE with grouped sigmoid routing and a shared expert
    "deepseek_v3": {**_MLA, "q_lora_rank": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "rope_parameters": {**_YARN, "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
    # MLA without the q compression (q_proj, DeepSeek-V2-Lite), complex RoPE on the rotary part, softmax
    # top-k routing; layer 0 dense, layer 1 MoE with 2 shared experts
    "deepseek_v2": {**_MLA, "q_lora_rank": None, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_shared_experts": 2},
}


def tiny_config(model_type: str, **overrides: Any):
    from transformers import AutoConfig

    fields = {**BASE, **TINY_OVERRIDES.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    if getattr(config, "head_dim", 0) is None:  # configs that leave it to the checkpoint (hunyuan_v1_dense)
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def make_tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``model_type`` checkpoint (fp32 safetensors) to ``out_dir``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
