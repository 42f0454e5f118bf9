"""MoE checkpoints store one tensor per expert; transformers 5 stacks them into the model's
``gate_up_proj``/``down_proj``. The weight source must see that and load through transformers."""

import torch
from safetensors import safe_open

from autodeploy.model_loading import (
    SafetensorsSource,
    TransformersSource,
    build_meta_model,
    choose_weight_source,
    open_checkpoint,
)
from autodeploy.tiny import make_tiny_checkpoint


def _source_for(model_dir):
    checkpoint = open_checkpoint(model_dir)
    model, _ = build_meta_model(checkpoint.config, torch.float32, "eager")
    return checkpoint, choose_weight_source(checkpoint, {n for n, _ in model.named_parameters()}, torch.float32)


def test_mixtral_per_expert_tensors_load_stacked_gate_first(tmp_path):
    model_dir = make_tiny_checkpoint("mixtral", tmp_path / "mixtral")
    checkpoint, source = _source_for(model_dir)
    assert isinstance(source, TransformersSource)
    loaded = dict(source)
    gate_up = loaded["model.layers.0.mlp.experts.gate_up_proj"]
    with safe_open(str(checkpoint.weight_files[0]), framework="pt") as stored:
        prefix = "model.layers.0.block_sparse_moe.experts.1"
        w1, w3 = stored.get_tensor(f"{prefix}.w1.weight"), stored.get_tensor(f"{prefix}.w3.weight")
    torch.testing.assert_close(gate_up[1], torch.cat([w1, w3]))  # gate rows, then up rows


def test_dense_checkpoint_streams_straight_from_safetensors(tmp_path):
    _, source = _source_for(make_tiny_checkpoint("llama", tmp_path / "llama"))
    assert isinstance(source, SafetensorsSource)
