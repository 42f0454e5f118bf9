"""Non-persistent buffers are not in the checkpoint: the meta model's loader fills them as HF's
``_init_weights`` does, also where an ancestor's call writes them (FalconH1's ``mup_vector``)."""

import torch

from autodeploy.model_loading import build_meta_model
from autodeploy.tiny import tiny_config


def test_a_buffer_filled_by_the_models_init_weights_gets_its_values():
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    config = tiny_config("falcon_h1", ssm_multipliers=[2.0, 0.5, 3.0, 0.25, 4.0])
    _, buffers = build_meta_model(config, torch.float32, "eager")
    want = compute_mup_vector(config)
    for layer in range(config.num_hidden_layers):
        torch.testing.assert_close(buffers[f"model.layers.{layer}.mamba.mup_vector"], want, rtol=0, atol=0)
