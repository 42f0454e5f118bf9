"""The offline section: a batch job of ``--requests`` random prompts through autodeploy's engine (``autodeploy
bench offline``'s ``run_offline``) and through HF ``generate`` as an HF user runs one: ``hf_eager`` with its
dynamic cache, ``hf_static`` with ``cache_implementation="static"`` (transformers compiles its decode forward:
``torch.compile``, reduce-overhead). The HF peers run whole batches of one prompt length (random ids: no
padding), each request to exactly its output length, after one warm-up ``generate`` of the timed shape stopped
after a few tokens: it holds the static peer's compile, left out of the timing as autodeploy's compile is.

Floor: the run's linear-layer FLOPs (every prompt and generated token through every layer, the LM head once per
generated token) at the GEMM rate, plus the keys and values its decode steps read at the copy rate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from decode_bench import compile_autodeploy, free_memory, hf_model, llama_config
from table import IMPLS, TableRow

PEERS = IMPLS[1:]
HF_BATCH_SHORT, HF_BATCH_LONG = 512, 128  # the HF peers' first batch (halved while it runs out of memory)
HF_REQUESTS_LONG = 128  # HF peers past 512 tokens a request: the requests run (whole batches; scaled to all)
WARM_UP_TOKENS = 3


def add_options(group) -> None:
    group.add_argument("--offline", default="128/128,1000/1000", help="input/output lengths")
    group.add_argument("--offline-shape", default="llama8b", help="model shape")
    group.add_argument("--requests", type=int, default=512, help="requests")


def offline_floor_s(cfg, input_len: int, output_len: int, num_requests: int, flops_per_s: float,
                    bytes_per_s: float) -> float:
    """Seconds the run cannot beat: linear FLOPs at the GEMM rate plus the decode's KV reads at the copy rate."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    head = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    per_layer = 2 * h * cfg.num_attention_heads * head + 2 * h * kv + 3 * h * cfg.intermediate_size
    flops = 2 * (layers * per_layer * num_requests * (input_len + output_len)
                 + cfg.vocab_size * h * num_requests * output_len)
    # the token generated at context c reads c cached keys and values in every layer (bf16)
    kv_bytes = num_requests * sum(range(input_len, input_len + output_len)) * layers * 2 * kv * 2
    return flops / flops_per_s + kv_bytes / bytes_per_s


def table_rows(args, header) -> Iterator[TableRow]:
    cfg = llama_config(args.offline_shape)
    for case in args.offline.split(","):
        input_len, output_len = (int(n) for n in case.split("/"))
        workload = f"{args.offline_shape} {case} x {args.requests}"
        floor = offline_floor_s(cfg, input_len, output_len, args.requests, header.gemm_flops, header.bandwidth)
        if "autodeploy" in args.impls:
            for weights in args.weights:
                yield autodeploy_offline(cfg, input_len, output_len, args.requests, workload, floor, weights)
        peers = [impl for impl in PEERS if impl in args.impls]
        # sdpa: what from_pretrained gives an HF user (its eager attention runs out of memory at 1000 tokens)
        model = hf_model(cfg, attn_implementation="sdpa") if peers else None
        for impl in peers:
            yield hf_offline_row(model, impl, input_len, output_len, args.requests, workload, floor)
            torch._dynamo.reset()
        del model
        free_memory()


def autodeploy_offline(cfg, input_len: int, output_len: int, requests: int, workload: str, floor: float,
                       weights) -> TableRow:
    from autodeploy.serve.bench import run_offline

    max_batch = 512 if input_len + output_len <= 512 else 256  # 512 sequences at once where the pool holds them
    # the pool sized from free memory, not for max_batch sequences
    model, _ = compile_autodeploy(cfg, max_batch, input_len + output_len, weights.settings, num_kv_blocks=None,
                                  tokens_per_block=None, max_num_tokens=8192)
    result = run_offline(model, input_len, output_len, requests)
    print(result.summary(), flush=True)
    steps = result.steps
    note = (f"max batch {max_batch}; {steps.decode_steps} decode steps of "
            f"{steps.decode_ms / max(1, steps.decode_steps):.1f} ms at {steps.decode_seqs:.0f} seqs")
    del model
    free_memory()
    return TableRow("offline", workload, "autodeploy", result.seconds, result.output_throughput, floor, note,
                    weights.name)


def hf_offline_row(model, impl: str, input_len: int, output_len: int, requests: int, workload: str,
                   floor: float) -> TableRow:
    """The largest batch that fits (HF's caches and prefill activations grow with it), halved until it does."""
    short = input_len + output_len <= 512
    batch = HF_BATCH_SHORT if short else HF_BATCH_LONG
    to_run, note = requests if short else min(requests, HF_REQUESTS_LONG), ""
    while True:
        try:
            seconds, ran = hf_offline(model, impl, input_len, output_len, to_run, batch)
            break
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        # freed here, not in the except block, whose traceback still holds the failed batch's tensors
        note += f"batches of {batch} ran out of memory; "
        batch //= 2
        torch._dynamo.reset()
        free_memory()
    note += f"batches of {batch}"
    if ran < requests:  # the same batches again: the rate of the first ones is the run's rate
        note += f"; {ran} of the {requests} requests run, seconds scaled to all"
        seconds *= requests / ran
    return TableRow("offline", workload, impl, seconds, requests * output_len / seconds, floor, note)


class _StopAfter:
    """A stopping criterion: ``tokens`` new tokens past a ``prompt_len`` prompt (the warm-up's early end, which
    keeps the timed run's cache length, so the static peer compiles the shape it is timed on)."""

    def __init__(self, prompt_len: int, tokens: int):
        self.end = prompt_len + tokens

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.end, dtype=torch.bool,
                          device=input_ids.device)


def generate_batch(model, prompts: torch.Tensor, output_len: int, impl: str, stop_after: int | None = None):
    """Greedy ``generate`` of exactly ``output_len`` tokens per row (EOS suppressed until then)."""
    from transformers import StoppingCriteriaList

    if impl not in PEERS:
        raise ValueError(f"unknown HF peer {impl!r}; expected one of {PEERS}")
    criteria = StoppingCriteriaList([_StopAfter(prompts.shape[1], stop_after)] if stop_after else [])
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=0, stopping_criteria=criteria,
                          cache_implementation="static" if impl == "hf_static" else None)


@torch.inference_mode()
def hf_offline(model, impl: str, input_len: int, output_len: int, num_requests: int, batch: int,
               seed: int = 0) -> tuple[float, int]:
    """(seconds, requests run): ``num_requests`` random prompts in batches of ``batch``, after one warm-up.
    Every batch must come back ``input_len + output_len`` long: a shorter one would flatter the rate."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (num_requests, input_len), generator=gen).to(model.device)
    batch = min(batch, num_requests)
    if num_requests % batch:  # a smaller last batch would be a new static cache shape: a compile inside the timing
        raise ValueError(f"{num_requests} requests do not split into batches of {batch}")
    generate_batch(model, prompts[:batch], output_len, impl, stop_after=WARM_UP_TOKENS)
    _sync(model.device)
    start = time.perf_counter()
    for first in range(0, num_requests, batch):
        out = generate_batch(model, prompts[first:first + batch], output_len, impl)
        if out.shape[1] != input_len + output_len:
            raise RuntimeError(f"{impl}: generate returned {out.shape[1] - input_len} tokens, not {output_len}")
    _sync(model.device)
    return time.perf_counter() - start, num_requests


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
