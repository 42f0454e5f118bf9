"""The engine's host time per step, without a GPU: the real engine over a model that only stages metadata.

    python bench/engine_host.py [--requests 512 --input_len 128 --output_len 128] [--profile]

``HostOnlyModel`` keeps the ``CompiledModel`` contract (metadata staged into reused buffers as a
CUDA-graph step does, logits rows returned) but runs no forward, so ``autodeploy bench offline``'s
loop (``run_offline``, async scheduling on) measures only what the host does per step: scheduling,
staging, sampling launches, bookkeeping, reports. On the H200 this host work is what paces the
decode steps of the offline benchmark when it exceeds the device's step time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from dataclasses import replace
from types import SimpleNamespace

import torch

sys.path.insert(0, ".")  # noqa: E402 (run from the repository root)

from autodeploy.kvcache.metadata import BatchMetadata, Padding, StepBuffers  # noqa: E402
from autodeploy.sampling_params import RequestOutputKind  # noqa: E402


class HostOnlyModel:
    """The engine-facing surface of ``CompiledModel`` with the forward left out."""

    def __init__(self, *, max_batch_size: int, max_num_tokens: int, max_seq_len: int, num_blocks: int,
                 block_size: int = 16, vocab_size: int = 64):
        self.config = SimpleNamespace(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
        self.hf_config = SimpleNamespace(eos_token_id=None)
        self.device = torch.device("cpu")
        self.block_size, self.num_blocks, self.max_seq_len, self.vocab_size = block_size, num_blocks, max_seq_len, vocab_size
        max_blocks = -(-max_seq_len // block_size)
        self._buffers = StepBuffers(Padding(max_num_tokens, max_batch_size, max_blocks).metadata_size, "cpu")
        self._logits = torch.zeros(max_num_tokens, vocab_size)

    def __call__(self, chunks, deferred=None) -> torch.Tensor:
        batch = BatchMetadata.build(chunks, self.block_size, self.device, buffers=self._buffers)
        if deferred is not None:
            deferred.write(batch.input_ids)
        return self._logits[: batch.num_logits]


def main() -> None:
    from autodeploy.serve import bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--input_len", type=int, default=128)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--max_batch_size", type=int, default=512)
    parser.add_argument("--max_num_tokens", type=int, default=8192)
    parser.add_argument("--profile", action="store_true", help="cProfile the run, print the top functions")
    parser.add_argument("--delta", action="store_true", help="per-step reports of every request (as the server)")
    args = parser.parse_args()
    max_seq_len = args.input_len + args.output_len + 16
    model = HostOnlyModel(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                          max_seq_len=max_seq_len, num_blocks=args.requests * (-(-max_seq_len // 16)) + 1)
    original = bench.Engine  # the engine as on CUDA: async scheduling, frozen long-lived objects
    bench.Engine = lambda m, tok, cfg: original(m, tok, replace(cfg, overlap=True, freeze_gc=True))
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    kind = RequestOutputKind.DELTA if args.delta else RequestOutputKind.FINAL_ONLY
    result = bench.run_offline(model, args.input_len, args.output_len, args.requests, output_kind=kind)
    if profiler:
        profiler.disable()
    steps = result.steps
    print(f"{args.requests} requests x ({args.input_len} in, {args.output_len} out): {result.seconds:.2f} s of host work")
    print(f"  decode-only steps: {steps.decode_steps} x {steps.decode_ms / max(1, steps.decode_steps):.2f} ms "
          f"at {steps.decode_seqs:.0f} sequences; prefilling steps: {steps.prefill_steps} x "
          f"{steps.prefill_ms / max(1, steps.prefill_steps):.2f} ms")
    if profiler:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(30)


if __name__ == "__main__":
    main()
