"""The suite's offline section: a batch job of ``--requests`` random prompts through autodeploy's engine
(``autodeploy bench offline``'s ``run_offline``) and through HF ``generate`` (``hf_peers.py``).

Floor: the run's linear-layer FLOPs (every prompt and generated token through every layer, the LM head once
per generated token) at the GEMM rate, plus the keys and values its decode steps read (each generated token
attends to its whole context) at the copy rate; the prompts' attention is left out.

    python bench/full_table.py --sections offline --offline 128/128 --impls autodeploy
"""

from __future__ import annotations

from collections.abc import Iterator

import hf_peers
import torch
from decode_bench import free_memory, hf_model, llama_config
from hf_peers import IMPLS as PEERS
from table import TableRow


def add_options(group) -> None:
    group.add_argument("--offline", default="128/128,1000/1000", help="input/output lengths")
    group.add_argument("--offline-shape", default="llama8b", help="model shape")
    group.add_argument("--requests", type=int, default=512, help="requests")
    group.add_argument("--hf-batch-short", type=int, default=512, help="HF peers: batch at 128/128")
    group.add_argument("--hf-batch-long", type=int, default=128,
                       help="HF peers: batch at 1000/1000 (halved while it runs out of memory)")
    group.add_argument("--hf-requests-long", type=int, default=128,
                       help="HF peers at 1000/1000: requests run (whole batches; the rate scales to all)")


def offline_floor_s(cfg, input_len: int, output_len: int, num_requests: int, flops_per_s: float,
                    bytes_per_s: float) -> float:
    """Seconds the run cannot beat: linear FLOPs at the GEMM rate plus the decode's KV reads at the copy rate."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    head = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head
    per_layer = 2 * h * cfg.num_attention_heads * head + 2 * h * kv + 3 * h * cfg.intermediate_size
    tokens = num_requests * (input_len + output_len)
    flops = 2 * (layers * per_layer * tokens + cfg.vocab_size * h * num_requests * output_len)
    # the token generated at context c reads c cached keys and values in every layer (bf16)
    contexts = sum(range(input_len, input_len + output_len))
    kv_bytes = num_requests * contexts * layers * 2 * kv * 2
    return flops / flops_per_s + kv_bytes / bytes_per_s


def table_rows(args, header) -> Iterator[TableRow]:
    cfg = llama_config(args.offline_shape)
    for case in args.offline.split(","):
        input_len, output_len = (int(n) for n in case.split("/"))
        workload = f"{args.offline_shape} {case} x {args.requests}"
        floor = offline_floor_s(cfg, input_len, output_len, args.requests, header.gemm_flops, header.bandwidth)
        if "autodeploy" in args.impls:
            for weights in args.weights:
                yield autodeploy_offline(cfg, input_len, output_len, args, workload, floor, weights)
        peers = [impl for impl in PEERS if impl in args.impls]
        # sdpa: what from_pretrained gives an HF user (its eager attention runs out of memory at 1000 tokens)
        model = hf_model(cfg, attn_implementation="sdpa") if peers else None
        for impl in peers:
            yield hf_offline_row(model, impl, input_len, output_len, args, workload, floor)
            torch._dynamo.reset()
        del model
        free_memory()


def autodeploy_offline(cfg, input_len: int, output_len: int, args, workload: str, floor: float, weights) -> TableRow:
    from autodeploy.serve.bench import run_offline

    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig

    max_batch = 512 if input_len + output_len <= 512 else 256  # 512 sequences at once where the pool holds them
    config = CompileConfig(**{"weights": "random", "device": "cuda", "max_batch_size": max_batch,
                              "max_num_tokens": 8192, "max_seq_len": input_len + output_len + 64, **weights.settings})
    model = compile_config(cfg, config)
    result = run_offline(model, input_len, output_len, args.requests)
    print(result.summary(), flush=True)
    steps = result.steps
    note = (f"max batch {max_batch}; {steps.decode_steps} decode steps of "
            f"{steps.decode_ms / max(1, steps.decode_steps):.1f} ms at {steps.decode_seqs:.0f} seqs")
    del model
    free_memory()
    return TableRow("offline", workload, "autodeploy", result.seconds, result.output_throughput, floor, note,
                    weights.name)


def hf_offline_row(model, impl: str, input_len: int, output_len: int, args, workload: str, floor: float) -> TableRow:
    """The largest batch that fits (HF's caches and prefill activations grow with it), halved until it does."""
    batch = args.hf_batch_short if input_len + output_len <= 512 else args.hf_batch_long
    requests = args.requests if input_len + output_len <= 512 else min(args.requests, args.hf_requests_long)
    note = ""
    while True:
        try:
            seconds, ran = hf_peers.hf_offline(model, impl, input_len, output_len, requests, batch)
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
    if ran < args.requests:  # the same batches again: the rate of the first ones is the run's rate
        note += f"; {ran} of the {args.requests} requests run, seconds scaled to all"
        seconds *= args.requests / ran
    return TableRow("offline", workload, impl, seconds, args.requests * output_len / seconds, floor, note)
