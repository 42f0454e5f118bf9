"""The decode layer chain on one GPU: what the paged attention costs *between* the GEMVs of a one-row step.

Every decoder layer of one batch-1 decode step, in one CUDA graph under PDL, as the engine runs it
after its passes: add+RMSNorm+qkv GEMV, paged attention with the RoPE folded in (context 512, the
cache write fused), o GEMV, add+RMSNorm+gate/up GEMV, SiLU-gated down GEMV. Distinct random weights
and KV pools per layer; LM head and sampling left out. Variants:

- ``linears only``: the o projection reads the q slice of the qkv output (no attention launch);
- ``copy kernel``: a PDL kernel that only copies that slice where the attention would be: what one
  more kernel in the chain costs, whatever it does;
- ``attention sN``: N flash-decoding splits, ``+preload``: each split's first block of pooled keys
  loaded before the PDL wait (``AttentionLaunch.preload_kv``);
- the default launch without the preload, with the next kernel's launch allowed after the wait
  instead of at the start (``AttentionLaunch.trigger``), with blocks of 64 keys;
- GEMV variants, each with its own linears-only baseline: one projection (qkv, o, gate/up, down) in
  other tiles (8 x 1024: half the programs; 2 x 1024: twice the programs at 48 registers), the o
  projection without its pre-wait weight tile (its 8 MB of first tiles then do not load while the
  attention runs), to see whether the attention gains from SM slots left free during the qkv GEMV's
  tail and what each projection's tiles cost.

``--timeline`` instead records, for a few layers of the default chain, when each program of each
kernel started, got past its PDL wait, (attention) loaded q, attended its preloaded key block and all
its keys, reached the merge counter, (the merging split) loaded the split weights and partials, and
stored (``autodeploy/kernels/trace.py``), and prints those times relative to the end of the kernel
before: where the attention's microseconds go between the GEMVs. ``--trigger`` changes where the
attention lets the o GEMV launch; ``--attention-only`` traces the attention launches back to back,
with no GEMV between them.

The attention's cost in the chain is (variant - linears only) / layers: its own latency plus the two
hand-offs it adds, which a standalone kernel timing leaves out. Each attention variant is first checked
on its own against the reference op (random q/k/v on layer 0's pool: output and written cache; bf16
passes below 1e-2): over 32 layers of random bf16 weights, outputs of different split counts drift
apart by a few percent, so the chain's outputs are not compared.

    python bench/layer_chain.py [--shapes llama8b,smollm2] [--context 512] [--timeline [--attention-only]]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace

import kernels_only  # noqa: F401  (autodeploy.kernels without transformers; this folder)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gemv_gpu import Layer as LinearLayer  # noqa: E402  (this folder)
from gpu_harness import BF16_TOL, DEV, graph_us, rel_err  # noqa: E402  (this folder)

import autodeploy.ops  # noqa: E402,F401  (registers the reference ops)
from autodeploy.kernels.attention_config import AttentionLaunch  # noqa: E402
from autodeploy.kernels import pdl, trace  # noqa: E402
from autodeploy.kernels.gemv import GemvLaunch, Prologue, gemv  # noqa: E402
from autodeploy.kernels.pdl import Trigger  # noqa: E402
from autodeploy.kernels.paged_attention import paged_attention_fwd  # noqa: E402

BF16 = torch.bfloat16
PAGE = 16
MAX_SEQ_LEN = 4096  # block-table width of the engine's graphs in the decode bench (sets the default splits)
SHAPES = {"llama8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, layers=32),
          "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536, layers=30)}


@dataclass
class Layer(LinearLayer):
    """gemv_gpu's linear weights of one layer, and its KV pool."""

    cache: torch.Tensor | None = None  # [blocks, 2, PAGE, kv_heads, head_dim]


@dataclass(frozen=True)
class Step:
    """The one sequence's metadata and rotary rows, shared by every layer."""

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def make_layers(shape: dict, context: int, device=DEV, dtype=BF16) -> tuple[list[Layer], Step]:
    h, d, heads, kv = shape["hidden"], shape["head_dim"], shape["heads"], shape["kv_heads"]
    qkv_out, inter = (heads + 2 * kv) * d, shape["inter"]
    blocks = -(-(context + 1) // PAGE)
    w = lambda n, k: torch.randn(n, k, device=device, dtype=dtype) / k**0.5  # noqa: E731
    norm = lambda: (1 + 0.1 * torch.randn(h, device=device)).to(dtype)  # noqa: E731
    layers = [Layer(w(qkv_out, heads * d), w(h, heads * d), w(2 * inter, h), w(h, inter), norm(), norm(),
                    torch.randn(blocks + 1, 2, PAGE, kv, d, device=device, dtype=dtype))
              for _ in range(shape["layers"])]
    table = torch.full((1, max(blocks, MAX_SEQ_LEN // PAGE)), 0, dtype=torch.int64, device=device)
    table[0, :blocks] = torch.randperm(blocks + 1, device=device)[:blocks]
    slot = table[0, context // PAGE] * PAGE + context % PAGE
    inv_freq = 500000.0 ** -(torch.arange(0, d, 2, device=device).float() / d)
    angles = (torch.tensor([float(context)], device=device)[:, None] * inv_freq).repeat(1, 2)
    step = Step(torch.tensor([0, 1], device=device), torch.tensor([context], device=device), table, slot.view(1),
                angles.cos().to(dtype), angles.sin().to(dtype))
    return layers, step


COPY = "copy"  # the variant with a copy kernel in the attention's place


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.allow_dependents(PDL)
    pdl.wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def copy_rows(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _copy_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, **pdl.launch_options(x.device))
    return out


Gemvs = tuple[tuple[str, GemvLaunch], ...]  # (projection, launch) overrides: qkv, o, gate_up, down


ROLES = ("qkv", "attention", "o", "gate_up", "down")  # the kernels of a layer, in launch order


def decode_step(layers: list[Layer], step: Step, shape: dict, x: torch.Tensor, res: torch.Tensor,
                launch: AttentionLaunch | str | None, gemvs: Gemvs = (),
                traces: dict[tuple[int, str], torch.Tensor] | None = None) -> torch.Tensor:
    """One row through every layer; ``launch`` None leaves the attention out, COPY puts a copy in its place;
    ``gemvs`` overrides projections' GEMV launches; ``traces`` maps (layer, role) to a trace buffer."""
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    tiles, traces = dict(gemvs), traces or {}
    for index, layer in enumerate(layers):
        buf = lambda role: traces.get((index, role))  # noqa: E731
        qkv, res = gemv(x, layer.qkv, prologue=Prologue.ADD_RMS_NORM, residual=res, norm_weight=layer.norm_in,
                        eps=1e-5, launch=tiles.get("qkv"), trace_buffer=buf("qkv"))
        if launch is None:
            attn = qkv[:, :heads * d]
        elif launch == COPY:
            attn = copy_rows(qkv[:, :heads * d])
        else:
            q = qkv[:, :heads * d].view(1, heads, d)
            k = qkv[:, heads * d:(heads + kv) * d].view(1, kv, d)
            v = qkv[:, (heads + kv) * d:].view(1, kv, d)
            attn = paged_attention_fwd(q, k, v, layer.cache, step.cu_seqlens, step.context_lens, step.block_table,
                                       step.slots, d ** -0.5, rope_cos=step.cos, rope_sin=step.sin,
                                       launch=launch, trace_buffer=buf("attention")).view(1, heads * d)
        o = gemv(attn, layer.o, launch=tiles.get("o"), trace_buffer=buf("o"))[0]
        gate_up, res = gemv(o, layer.gate_up, prologue=Prologue.ADD_RMS_NORM, residual=res,
                            norm_weight=layer.norm_post, eps=1e-5, launch=tiles.get("gate_up"),
                            trace_buffer=buf("gate_up"))
        x = gemv(gate_up, layer.down, prologue=Prologue.GATED, launch=tiles.get("down"), trace_buffer=buf("down"))[0]
    return x


Variant = tuple[str, "AttentionLaunch | str | None", Gemvs]  # label, attention, GEMV overrides


def gemv_variants() -> list[tuple[str, Gemvs]]:
    """Projections in other tiles, and the o projection without its pre-wait tile."""
    base = GemvLaunch.choose(1, 1024)
    tiles = lambda n: replace(base, block_n=n, block_k=1024)  # noqa: E731
    out = [(f"{role} {n} x 1024", ((role, tiles(n)),)) for role in ("qkv", "o", "gate_up", "down") for n in (2, 8)]
    out.append(("o no preload", (("o", replace(base, preload=False)),)))
    out.append(("all 2 x 1024", tuple((role, tiles(2)) for role in ("qkv", "o", "gate_up", "down"))))
    return out


def variants(shape: dict, device=DEV) -> list[Variant]:
    default = AttentionLaunch.choose(1, 1, shape["heads"], shape["kv_heads"], shape["head_dim"], MAX_SEQ_LEN,
                                     torch.device(device))
    out = [("linears only", None, ()), ("copy kernel", COPY, ()),
           (f"attention default (s{default.num_splits}, preload {default.preload_kv})", default, ())]
    for splits in (8, 16, 32):
        out.append((f"attention s{splits} +preload", replace(default, num_splits=splits, preload_kv=True), ()))
    out.append(("default, no preload", replace(default, preload_kv=False), ()))
    out.append(("default, second block early", replace(default, second_block_early=True), ()))
    out.append(("default, trigger after wait", replace(default, trigger=Trigger.AFTER_WAIT), ()))
    out.append(("default, trigger at exit", replace(default, trigger=Trigger.AFTER_LOOP), ()))
    out.append(("default, 64 keys per block", replace(default, block_n=64), ()))
    # (qkv 8 x 1024: half the programs, 4 per SM at 128 registers, so SM slots free up for the attention's
    # programs to start their pre-wait work during the qkv GEMV's tail)
    for label, gemvs in gemv_variants():
        out.append((f"linears only, {label}", None, gemvs))
        out.append((f"default, {label}", default, gemvs))
    return out


def check_attention(layer: Layer, step: Step, shape: dict, launch: AttentionLaunch) -> float:
    """Relative error of one attention launch against the reference op (output and written cache)."""
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    device, dtype = layer.cache.device, layer.cache.dtype
    q, k, v = (torch.randn(1, n, d, device=device, dtype=dtype) for n in (heads, kv, kv))
    got_cache, want_cache = layer.cache.clone(), layer.cache.clone()
    args = (step.cu_seqlens, step.context_lens, step.block_table, step.slots, d ** -0.5)
    got = paged_attention_fwd(q, k, v, got_cache, *args, rope_cos=step.cos, rope_sin=step.sin, launch=launch)
    want = torch.ops.autodeploy.paged_attention(
        q, k, v, want_cache, step.cu_seqlens.diff(), step.context_lens, step.cu_seqlens, step.block_table, step.slots,
        d ** -0.5, None, None, None, step.cos, step.sin, False)
    return max(rel_err(got, want), rel_err(got_cache, want_cache))


def chain(name: str, shape: dict, context: int, only: tuple[str, ...] = ()) -> list[str]:
    layers, step = make_layers(shape, context)
    torch.manual_seed(1)
    x = torch.randn(1, shape["hidden"], device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    lines, base_us = [f"{name}: {shape['layers']} layers, batch 1, context {context}"], {}
    for label, launch, gemvs in variants(shape):
        if only and not any(label == p or label.startswith(p + " ") for p in only):
            continue
        check = ""
        if isinstance(launch, AttentionLaunch):
            err = check_attention(layers[0], step, shape, launch)
            check = f"  check {err:.1e} {'ok' if err < BF16_TOL else 'FAIL'}"
        us = graph_us([lambda a=launch, g=gemvs: decode_step(layers, step, shape, x, res, a, g)], reps=20)
        if launch is None:  # the baseline of the variants with the same GEMVs
            base_us[gemvs] = us
        extra = (us - base_us[gemvs]) / shape["layers"]
        lines.append(f"  {label:<46}{us / 1e3:>8.3f} ms {us / shape['layers']:>7.2f} us/layer"
                     f"{'' if launch is None else f'  attention +{extra:5.2f} us/layer'}{check}")
        print(lines[-1], flush=True)
    layers.clear()  # free this shape's weights and pools before the next shape
    torch.cuda.empty_cache()
    return lines


def trace_buffers(layers: list[Layer], shape: dict, launch: AttentionLaunch, traced: range,
                  gemvs: Gemvs = ()) -> dict[tuple[int, str], torch.Tensor]:
    """Trace buffers for every kernel of the ``traced`` layers and the down GEMV before the first."""
    attention = (1 + 1) * shape["kv_heads"] * launch.num_splits  # one tile + one padding tile per KV head
    programs = {"qkv": layers[0].qkv.shape[0], "attention": attention, "o": layers[0].o.shape[0],
                "gate_up": layers[0].gate_up.shape[0], "down": layers[0].down.shape[0]}
    launches = {role: GemvLaunch.choose(1, 1024) for role in ROLES} | dict(gemvs)
    out = {}
    for index in traced:
        for role in ROLES:
            count = programs[role]
            if role != "attention":
                count = -(-count // launches[role].block_n)
            out[(index, role)] = trace.buffer(count, torch.device(DEV))
    block_n = launches["down"].block_n
    first = traced.start - 1
    out[(first, "down")] = trace.buffer(-(-programs["down"] // block_n), torch.device(DEV))
    return out


def _events(buf: torch.Tensor, event: int, t0: int) -> torch.Tensor:
    """Times (us, relative to t0) at which the programs that reached ``event`` got there."""
    column = buf[:, event]
    return (column[column != trace.UNSET] - t0).double() / 1e3


def _summary(times: torch.Tensor) -> str:
    if times.numel() == 0:
        return f"{'-':>23}"
    q = torch.quantile(times, torch.tensor([0.0, 0.5, 1.0], dtype=times.dtype))
    return f"{q[0]:7.2f} {q[1]:7.2f} {q[2]:7.2f}"


def _mergers(buf: torch.Tensor, next_buf: torch.Tensor | None, t0: int) -> list[str]:
    """One line per program that merged its tile's splits (row: trace.program_index): its SM, its
    arrival, loads and store, and (given ``next_buf``) how many programs of the next kernel had started
    on that SM by the time it stored."""
    lines = []
    for row in (buf[:, 8] != trace.UNSET).nonzero().flatten().tolist():
        t = lambda e: (buf[row, e].item() - t0) / 1e3  # noqa: E731
        sm, stored = buf[row, 0].item(), buf[row, 5].item()
        line = (f"    merger {row:4d} on SM {sm:3d}: arrived {t(4):6.2f} lse {t(8):6.2f} "
                f"parts {t(9):6.2f} stored {t(5):6.2f}")
        if next_buf is not None:
            neighbours = int(((next_buf[:, 0] == sm) & (next_buf[:, 1] <= stored)).sum())
            line += f"; {neighbours} programs of the next kernel there"
        lines.append(line)
    return lines


EVENT_NAMES = {1: "start", 2: "after wait", 6: "q loaded", 7: "1st block", 3: "attended", 4: "arrived",
               8: "lse loaded", 9: "parts loaded", 5: "stored"}
ATTENTION_EVENTS = (1, 2, 6, 7, 3, 4, 8, 9, 5)  # in program order, the last one the kernel's end
GEMV_EVENTS = (1, 2, 3)


def _event_lines(buf: torch.Tensor, events: tuple[int, ...], t0: int) -> list[str]:
    return [f"    {EVENT_NAMES[event]:<12}{_summary(_events(buf, event, t0))}" for event in events]


def _replay_traced(run, buffers) -> None:
    """Capture ``run`` in a CUDA graph, replay it a few times, then once more with every trace buffer
    cleared: events of one replay only (the merging split changes from replay to replay)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(4):
        graph.replay()
    for buf in buffers:
        buf.fill_(trace.UNSET)
    graph.replay()
    torch.cuda.synchronize()


def timeline(name: str, shape: dict, context: int, traced: range, gemvs: Gemvs = (),
             trigger: Trigger | None = None) -> list[str]:
    """Per kernel of the traced layers: min / median / max time of each event, in us after the end
    of the kernel before it (its last program's store). ``trigger``: the attention's, instead of its default."""
    layers, step = make_layers(shape, context)
    x = torch.randn(1, shape["hidden"], device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    launch = AttentionLaunch.choose(1, 1, shape["heads"], shape["kv_heads"], shape["head_dim"], MAX_SEQ_LEN,
                                    torch.device(DEV))
    if trigger is not None:
        launch = replace(launch, trigger=trigger)
    traces = trace_buffers(layers, shape, launch, traced, gemvs)
    _replay_traced(lambda: decode_step(layers, step, shape, x, res, launch, gemvs, traces), traces.values())
    lines = [f"{name}: batch 1, context {context}, {launch}, GEMV overrides {dict(gemvs)}; us after the previous "
             "kernel's last store (min / median / max over programs)"]
    previous_end = int(traces[(traced.start - 1, "down")][:, 3].max())
    for index in traced:
        for role in ROLES:
            buf = traces[(index, role)].cpu()
            events = ATTENTION_EVENTS if role == "attention" else GEMV_EVENTS
            lines.append(f"  layer {index} {role:<9} ({buf.shape[0]} programs, "
                         f"{int((buf[:, 1] != trace.UNSET).sum())} traced, "
                         f"{len(set(buf[:, 0].tolist()))} SMs)")
            lines += _event_lines(buf, events, previous_end)
            if role == "attention":
                lines += _mergers(buf, traces[(index, "o")].cpu(), previous_end)
            ends = buf[:, events[-1]]
            if (ends != trace.UNSET).any():
                previous_end = int(ends[ends != trace.UNSET].max())
    print("\n".join(lines), flush=True)
    return lines


def attention_timeline(name: str, shape: dict, context: int, traced: range) -> list[str]:
    """The attention launches of every layer back to back (no GEMVs between them: the same q/k/v each
    time), layers ``traced`` traced: the merge's events when nothing else runs on the GPU."""
    layers, step = make_layers(shape, context)
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q, k, v = (torch.randn(1, n, d, device=DEV, dtype=BF16) for n in (heads, kv, kv))
    launch = AttentionLaunch.choose(1, 1, heads, kv, d, MAX_SEQ_LEN, torch.device(DEV))
    traces = {index: trace.buffer(2 * kv * launch.num_splits, torch.device(DEV)) for index in traced}
    args = (step.cu_seqlens, step.context_lens, step.block_table, step.slots, d ** -0.5)
    _replay_traced(lambda: [paged_attention_fwd(q, k, v, layer.cache, *args, rope_cos=step.cos, rope_sin=step.sin,
                                                launch=launch, trace_buffer=traces.get(index))
                            for index, layer in enumerate(layers)], traces.values())
    lines = [f"{name}: attention only, back to back, context {context}, {launch}; us after the first program's start"]
    for index in traced:
        buf = traces[index].cpu()
        t0 = int(buf[:, 1][buf[:, 1] != trace.UNSET].min())
        lines.append(f"  layer {index} attention")
        lines += _event_lines(buf, ATTENTION_EVENTS, t0)
        lines += _mergers(buf, None, t0)
    print("\n".join(lines), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama8b,smollm2")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--timeline", action="store_true", help="trace layers 8-9 instead of timing variants")
    parser.add_argument("--attention-only", action="store_true",
                        help="--timeline of the attention launches alone, back to back")
    parser.add_argument("--trigger", choices=[t.name.lower() for t in Trigger], default=None,
                        help="--timeline: where the attention lets the o GEMV launch (default: its launch's)")
    parser.add_argument("--only", default="", help="';'-separated labels (or label prefixes up to a space) to time")
    args = parser.parse_args()
    os.environ.setdefault("AUTODEPLOY_PDL", "1")
    print("torch", torch.__version__, "|", torch.cuda.get_device_name(0), flush=True)
    lines = []
    for name in args.shapes.split(","):
        if args.timeline:
            trigger = Trigger[args.trigger.upper()] if args.trigger else None
            if args.attention_only:
                attention_timeline(name, SHAPES[name], args.context, range(8, 10))
                continue
            timeline(name, SHAPES[name], args.context, range(8, 10), trigger=trigger)
        else:
            lines += chain(name, SHAPES[name], args.context, tuple(p.strip() for p in args.only.split(";") if p.strip()))
    print("\n".join(lines))
    return 0 if all("FAIL" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
