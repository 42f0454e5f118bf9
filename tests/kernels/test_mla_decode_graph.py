"""MLA decode steps through the CUDA-graph path (``autodeploy.cudagraph``), on the CPU.

A captured graph replays its kernels on static inputs that ``CudaGraphRunner.run`` refills in place: the
decode batch padded to the captured size (padding tokens write no slot, padding sequences have no tokens),
the block table padded to the model's widest. Here a stand-in replays by running the graph module again on
those same static tensors (no CUDA on this machine), so everything but the capture itself is the real path:
a tiny deepseek_v3 on the Triton MLA kernel (interpreter) must pass the canary with its decode steps served
by the graphs of batch sizes 1 and 2 (the kernel's launch depends on shapes only, and its op never reads a
value back to the host, which is what lets CUDA capture it: ``tests/gpu/test_models_gpu.py`` captures it for real).
"""

import pytest
import torch

from autodeploy.check import run_check
from autodeploy.compiler import compile as compile_model
from autodeploy.cudagraph import CudaGraphRunner, DirectStepGraph, _Captured
from autodeploy.tiny import make_tiny_checkpoint


class CountingStandIn(DirectStepGraph):
    """The CPU stand-in of a captured graph (a replay recomputes the step in place from the static inputs as
    they are now), counting its replays."""

    replays = 0

    def replay(self):
        self.replays += 1
        with torch.inference_mode():
            return super().replay()


def capture_on_cpu(runner: CudaGraphRunner) -> dict[int, CountingStandIn]:
    stand_ins = {}
    for size in runner.batch_sizes:
        buffers, pad, inputs = runner._static_step(size)
        stand_ins[size] = CountingStandIn()
        with torch.inference_mode():
            output = stand_ins[size].capture(runner.gm, inputs, f"the decode step of {size}", "batch_sizes=[]")
        runner.graphs[size] = _Captured(stand_ins[size], buffers, pad, output)
    return stand_ins


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_mla_decode_steps_through_the_graph_path_pass_the_canary(tmp_path):
    model_dir = make_tiny_checkpoint("deepseek_v3", tmp_path / "deepseek_v3")
    prompt_lens, steps = (5, 7), 5
    model = compile_model(model_dir, dtype="float32", device="cpu", attention_backend="triton",
                          max_seq_len=max(prompt_lens) + steps + 1)
    assert model.report.op_counts.get("paged_mla_triton") == 2
    model.cuda_graphs = CudaGraphRunner(model.gm, model.pool, [1, 2], model.capacity.max_blocks_per_seq)
    stand_ins = capture_on_cpu(model.cuda_graphs)
    result = run_check(model_dir, steps=steps, prompt_lens=prompt_lens, compiled=model)
    assert result.passed, result.summary()
    assert stand_ins[1].replays > 0 and stand_ins[2].replays > 0  # a decode alone, and two sequences decoding
