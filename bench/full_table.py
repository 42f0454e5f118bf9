"""Issue 4's benchmark in one run and one table: decode steps, offline throughput and cold start, each for
HF eager, HF static cache + torch.compile and autodeploy, each against a floor measured in the same run.

    python bench/full_table.py                                     # every section (~15-20 min on one GPU)
    python bench/full_table.py --sections decode --json out/decode.json
    python bench/full_table.py --merge out/decode.json out/offline.json   # one table from sections run apart

Floors (what the GPU cannot beat, from the copy bandwidth and the bf16 GEMM rate timed at the start):

- decode: the bytes one step must stream (every linear weight, the LM head, the KV cache read) / copy
  bandwidth (``decode_bench.py``, whose rows these are);
- offline: the run's linear-layer FLOPs (every prompt and generated token through every layer, the LM
  head once per generated token) / the GEMM rate, plus the keys and values the decode steps read
  (each generated token attends to its whole context) / copy bandwidth; the prompt's attention is left out;
- cold start: none (process start to the first generated token, ``cold_start.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

SECTIONS = ("decode", "offline", "coldstart")
PEERS = ("hf_eager", "hf_static")


@dataclass(frozen=True)
class TableRow:
    section: str  # decode | offline | coldstart
    workload: str  # e.g. "llama8b batch 64", "llama8b 128/128 x 512"
    impl: str
    seconds: float  # per step (decode), for the run (offline), to the first token (cold start)
    tokens_per_s: float | None = None
    floor_s: float | None = None
    note: str = ""

    @property
    def roofline_share(self) -> float | None:
        return self.floor_s / self.seconds if self.floor_s else None


def gemm_rate(size: int = 8192, repeats: int = 20) -> float:
    """bf16 GEMM FLOP/s of one ``size``-cube matmul in a loop (the anchors' 767 TFLOP/s on the H200)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3)


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


def decode_rows(args, bandwidth: float) -> Iterator[TableRow]:
    import decode_bench

    options = argparse.Namespace(batches=args.batches, static_batches=args.static_batches, context=args.context,
                                 steps=args.steps, impls="hf,autodeploy,engine", backend="triton", set=[], label="")
    for shape in args.shapes.split(","):
        for r in decode_bench.run_shape(shape, options, bandwidth):
            impl = {"autodeploy": "autodeploy bare step", "autodeploy_engine": "autodeploy engine"}.get(r.impl, r.impl)
            yield TableRow("decode", f"{shape} batch {r.batch}", impl, r.ms_per_step / 1e3, r.tokens_per_s,
                           r.floor_ms / 1e3, r.note)


def offline_rows(args, bandwidth: float, flops: float) -> Iterator[TableRow]:
    from decode_bench import hf_model, llama_config

    cfg = llama_config(args.offline_shape)
    for case in args.offline.split(","):
        input_len, output_len = (int(n) for n in case.split("/"))
        workload = f"{args.offline_shape} {case} x {args.requests}"
        floor = offline_floor_s(cfg, input_len, output_len, args.requests, flops, bandwidth)
        if "autodeploy" in args.impls:
            yield _autodeploy_offline(cfg, input_len, output_len, args, workload, floor)
        peers = [impl for impl in PEERS if impl in args.impls]
        # sdpa: what from_pretrained gives an HF user (its eager attention runs out of memory at 1000 tokens)
        model = hf_model(cfg, attn_implementation="sdpa") if peers else None
        for impl in peers:
            yield _hf_offline(model, impl, input_len, output_len, args, workload, floor)
            torch._dynamo.reset()
        del model
        _free()


def _autodeploy_offline(cfg, input_len: int, output_len: int, args, workload: str, floor: float) -> TableRow:
    from autodeploy.compiler import compile_config
    from autodeploy.config import CompileConfig
    from autodeploy.serve.bench import run_offline

    # as `bash bench/run_h200.sh offline128 offline1000`: 512 sequences at once where the pool holds them
    max_batch = 512 if input_len + output_len <= 512 else 256
    config = CompileConfig(weights="random", dtype="bfloat16", device="cuda", max_batch_size=max_batch,
                           max_num_tokens=8192, max_seq_len=input_len + output_len + 64)
    model = compile_config(cfg, config)
    result = run_offline(model, input_len, output_len, args.requests)
    print(result.summary(), flush=True)
    steps = result.steps
    note = (f"max batch {max_batch}; {steps.decode_steps} decode steps of "
            f"{steps.decode_ms / max(1, steps.decode_steps):.1f} ms at {steps.decode_seqs:.0f} seqs")
    del model
    _free()
    return TableRow("offline", workload, "autodeploy", result.seconds, result.output_throughput, floor, note)


def _hf_offline(model, impl: str, input_len: int, output_len: int, args, workload: str, floor: float) -> TableRow:
    from hf_peers import hf_offline

    batch = args.hf_batch_short if input_len + output_len <= 512 else args.hf_batch_long
    requests = args.requests if input_len + output_len <= 512 else min(args.requests, args.hf_requests_long)
    note = ""
    while True:  # the largest batch that fits: HF's caches and prefill activations grow with it
        try:
            seconds, ran = hf_offline(model, impl, input_len, output_len, requests, batch)
            break
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        # freed here, not in the except block, whose traceback still holds the failed batch's tensors
        note += f"batches of {batch} ran out of memory; "
        batch //= 2
        torch._dynamo.reset()
        _free()
    note += f"batches of {batch}"
    if ran < args.requests:  # the same batches again: the rate of the first ones is the run's rate
        note += f"; {ran} of the {args.requests} requests run, seconds scaled to all"
        seconds *= args.requests / ran
    return TableRow("offline", workload, impl, seconds, args.requests * output_len / seconds, floor, note)


def coldstart_rows(args) -> Iterator[TableRow]:
    from cold_start import IMPLS, cold_start

    for impl in (i for i in IMPLS if i in args.impls):
        seconds, stages = cold_start(args.offline_shape, impl)
        yield TableRow("coldstart", f"{args.offline_shape} cold start to first token", impl, seconds,
                       note=stages.split("; ", 1)[-1])


def print_table(rows: list[TableRow], headers: list[dict]) -> None:
    """One table; a line per run the rows came from (device, versions, the floors' rates)."""
    print()
    for h in headers:
        print(f"{h['date']} {h['device']} | torch {h['torch']}, triton {h['triton']}, transformers "
              f"{h['transformers']} | copy {h['bandwidth'] / 1e12:.2f} TB/s | bf16 GEMM {h['gemm_flops'] / 1e12:.0f} "
              f"TFLOP/s | sections {h['sections']}")
    print(f"{'workload':<36}{'impl':<24}{'time':>10}{'tok/s':>10}{'floor':>10}{'roofline':>9}  note")
    for r in rows:
        tokens = f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-"
        floor = _time(r.section, r.floor_s) if r.floor_s else "-"
        share = f"{r.roofline_share:.0%}" if r.roofline_share else "-"
        print(f"{r.workload:<36}{r.impl:<24}{_time(r.section, r.seconds):>10}{tokens:>10}{floor:>10}{share:>9}"
              f"  {r.note}")


def _time(section: str, seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if section == "decode" else f"{seconds:.2f} s"


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run(args, save: Callable[[list[TableRow], dict], None]) -> tuple[list[TableRow], dict]:
    """Every row of ``args.sections``; ``save`` gets the rows so far after each one (a run cut short keeps them)."""
    import transformers
    import triton
    from decode_bench import copy_bandwidth

    header = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "transformers": transformers.__version__, "sections": args.sections,
              "bandwidth": copy_bandwidth(), "gemm_flops": gemm_rate()}
    print(header, flush=True)
    sections = {"decode": lambda: decode_rows(args, header["bandwidth"]),
                "offline": lambda: offline_rows(args, header["bandwidth"], header["gemm_flops"]),
                "coldstart": lambda: coldstart_rows(args)}
    rows = []
    for section in args.sections.split(","):
        if section not in sections:
            raise SystemExit(f"unknown section {section!r}; expected some of {', '.join(SECTIONS)}")
        for row in sections[section]():
            rows.append(row)
            print(row, flush=True)
            save(rows, header)
    return rows, header


def save_json(path: str | None) -> Callable[[list[TableRow], dict], None]:
    def save(rows: list[TableRow], header: dict) -> None:
        if path:
            with open(path, "w") as f:
                json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=1)

    return save


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--shapes", default="llama8b,smollm2", help="decode: model shapes")
    p.add_argument("--batches", default="1,8,64,256", help="decode: batch sizes")
    p.add_argument("--static-batches", default="1,8,64,256",
                   help="decode: batches with HF static cache + torch.compile")
    p.add_argument("--context", type=int, default=512, help="decode: cached tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="decode: timed steps")
    p.add_argument("--impls", default="autodeploy," + ",".join(PEERS), help="offline and cold start: which to run")
    p.add_argument("--offline", default="128/128,1000/1000", help="offline: input/output lengths")
    p.add_argument("--offline-shape", default="llama8b", help="offline and cold start: model shape")
    p.add_argument("--requests", type=int, default=512, help="offline: requests")
    p.add_argument("--hf-batch-short", type=int, default=512, help="offline, HF peers: batch at 128/128")
    p.add_argument("--hf-batch-long", type=int, default=128,
                   help="offline, HF peers: batch at 1000/1000 (halved while it runs out of memory)")
    p.add_argument("--hf-requests-long", type=int, default=128,
                   help="offline, HF peers at 1000/1000: requests run (whole batches; the rate scales to all)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="print one table from these files")
    args = p.parse_args()
    args.impls = tuple(args.impls.split(","))  # parsed once; the sections test membership
    unknown = set(args.impls) - {"autodeploy", *PEERS}
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; expected some of autodeploy, {', '.join(PEERS)}")
    if args.merge:
        loaded = [json.load(open(path)) for path in args.merge]
        rows = [TableRow(**row) for part in loaded for row in part["rows"]]
        print_table(rows, [part["header"] for part in loaded])
        return
    rows, header = run(args, save_json(args.json))
    print_table(rows, [header])


if __name__ == "__main__":
    main()
