"""Quantized models through the serving engine: every producer format via ``LLM`` (greedy tokens equal
to the quantized reference's), and online FP8 through the HTTP server and its start-up report."""

from pathlib import Path

import httpx
import pytest
import yaml
from conftest import COMPILE_OPTIONS, LiveServer, make_state

import autodeploy
from autodeploy import SamplingParams
from autodeploy.check import reference_streams
from autodeploy.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_serve_takes_the_quantization_flag(capsys):
    assert main(["serve", "ckpt", "--print_config", "--quantization", "fp8"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["quantization"] == "fp8"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_ct_fp8_dynamic", "qwen3_ct_fp8_static", "llama_ct_fp8_block",
                                  "qwen3_moe_ct_fp8_dynamic", "llama_modelopt_fp8", "qwen3_modelopt_nvfp4",
                                  "llama_ct_fp8_kv"])  # (its reference rounds k/v through e4m3 as our cache does)
def test_the_engine_serves_each_format(name):
    import torch

    path = FIXTURES / name
    llm = autodeploy.LLM(path, None, device="cpu", dtype="float32", max_seq_len=64, num_kv_blocks=16)
    prompts = [[5, 9, 17, 3], [40, 2, 77, 8, 12, 90, 33]]
    outs = llm.generate(prompts, GREEDY)
    streams, _ = reference_streams(path, prompts, GREEDY.max_tokens, torch.float32)
    assert [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)] == streams


@pytest.mark.slow
def test_online_fp8_over_http(tiny_dir, tokenizer):
    from autodeploy.serve.server import build_app
    from autodeploy.serve.startup import ServeSettings, startup_report

    compiled = autodeploy.compile(tiny_dir, quantization="fp8", **COMPILE_OPTIONS)
    offline = autodeploy.LLM(compiled, tokenizer).generate("The quick brown fox", GREEDY)[0].outputs[0].text
    state = make_state(compiled, tokenizer, engine_process=False)  # the report reads the engine
    server = LiveServer(build_app(state))
    try:
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == offline
        report = startup_report(compiled, state.engine.engine, ServeSettings(served_model_name="tiny"), server.url,
                                1.0, tokenizer)
        assert "quantization online fp8: FP8 e4m3 weights, per-channel scales" in report
        assert "left unquantized: lm_head" in report
    finally:
        server.close()
        state.engine.shutdown()
