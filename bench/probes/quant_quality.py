"""Quality of quantized variants of one model on a held-out text: top-1 agreement with a baseline
(the bf16 model) at every position, and perplexity. CPU or GPU; one prefill of the whole text per
variant through the compiled model (every position's logits), teacher-forced.

    python bench/probes/quant_quality.py                               # the demo model: bf16, online fp8, nvfp4
    python bench/probes/quant_quality.py --extra ct-fp8-dynamic=/path/to/llmcompressor/checkpoint \\
                                  --extra modelopt-nvfp4=/path/to/modelopt/checkpoint

The producer checkpoints of the demo model come from ``tests/fixtures/quant/make_fixtures.py demo``
(their own virtualenv). Results are in docs/quantization.md.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "quant_heldout.txt"


@dataclass(frozen=True)
class Quality:
    name: str
    top1_agreement: float  # share of positions whose argmax equals the baseline's
    confident_agreement: float  # the same over positions where the baseline is not near a tie
    perplexity: float
    seconds: float


def heldout_tokens(tokenizer, limit: int | None = None) -> list[int]:
    ids = tokenizer.encode(HELDOUT.read_text())
    return ids[:limit] if limit else ids


def position_logits(model_dir, tokens: list[int], **options) -> torch.Tensor:
    """fp32 logits ``[len(tokens), vocab]`` of one teacher-forced prefill of ``tokens``."""
    import autodeploy
    from autodeploy.kvcache.metadata import SequenceChunk

    blocks = -(-len(tokens) // 16) + 1
    model = autodeploy.compile(model_dir, max_seq_len=len(tokens) + 16, num_kv_blocks=blocks, max_batch_size=1,
                               max_num_tokens=max(len(tokens), 256), **options)
    chunk = SequenceChunk(tuple(tokens), 0, tuple(range(blocks)), num_logits=len(tokens))
    return model([chunk]).float().cpu()


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    targets = torch.tensor(tokens[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(nll.item())


# a position whose baseline top-1 probability leads the runner-up by less than this is a near-tie: its
# argmax flips under any rounding (bf16 against fp32 flips 2.4% of the demo model's positions)
TIE_MARGIN = 0.1


def compare(name: str, logits: torch.Tensor, baseline: torch.Tensor, tokens: list[int], seconds: float) -> Quality:
    agree = logits.argmax(-1) == baseline.argmax(-1)
    top2 = baseline.softmax(-1).topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN
    return Quality(name, agree.float().mean().item(), agree[confident].float().mean().item(),
                   perplexity(logits, tokens), seconds)


def evaluate(variants: dict[str, tuple[Path, dict]], tokens: list[int], baseline: str) -> list[Quality]:
    """``variants``: name -> (checkpoint, compile options); ``baseline`` names one of them."""
    logits, seconds = {}, {}
    for name, (path, options) in variants.items():
        start = time.perf_counter()
        logits[name] = position_logits(path, tokens, **options)
        seconds[name] = time.perf_counter() - start
    return [compare(n, logits[n], logits[baseline], tokens, seconds[n]) for n in variants]


def table(results: list[Quality], tokens: int) -> str:
    lines = [f"{'variant':<20}{'top-1 vs bf16':>14}{'(no near-ties)':>15}{'perplexity':>12}{'s':>8}"
             f"   ({tokens} held-out tokens; near-tie: bf16 top-2 within {TIE_MARGIN} probability)"]
    lines += [f"{r.name:<20}{r.top1_agreement:>14.4f}{r.confident_agreement:>15.4f}{r.perplexity:>12.3f}"
              f"{r.seconds:>8.1f}" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=None, help="use the first N tokens of the text")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                        help="a quantized checkpoint of the same model (repeatable)")
    args = parser.parse_args()
    from autodeploy.demo import default_model_path
    from autodeploy.model_loading import resolve_model_path
    from autodeploy.serve.tokenizer import load_tokenizer

    path = resolve_model_path(args.model or default_model_path())
    tokens = heldout_tokens(load_tokenizer(path), args.tokens)
    common = {"device": args.device, "dtype": "bfloat16"}
    variants = {"bf16": (path, common), "online fp8": (path, {**common, "quantization": "fp8"}),
                "online nvfp4": (path, {**common, "quantization": "nvfp4"})}
    for item in args.extra:
        name, _, directory = item.partition("=")
        variants[name] = (Path(directory), common)
    print(table(evaluate(variants, tokens, "bf16"), len(tokens)))


if __name__ == "__main__":
    main()
