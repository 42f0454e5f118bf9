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
- ``qkv 8 x 1024``: the qkv GEMV in one wave of larger tiles (its own linears-only baseline), to
  see whether the attention gains from SM slots left free during the qkv GEMV's tail.

The attention's cost in the chain is (variant - linears only) / layers: its own latency plus the two
hand-offs it adds, which a standalone kernel timing leaves out. Each attention variant is first checked
on its own against the reference op (random q/k/v on layer 0's pool: output and written cache; bf16
passes below 1e-2): over 32 layers of random bf16 weights, outputs of different split counts drift
apart by a few percent, so the chain's outputs are not compared.

    python bench/layer_chain.py [--shapes llama8b,smollm2] [--context 512]
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
from autodeploy.kernels import pdl  # noqa: E402
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


def decode_step(layers: list[Layer], step: Step, shape: dict, x: torch.Tensor, res: torch.Tensor,
                launch: AttentionLaunch | str | None, qkv_launch: GemvLaunch | None = None) -> torch.Tensor:
    """One row through every layer; ``launch`` None leaves the attention out, COPY puts a copy in its place;
    ``qkv_launch`` overrides the qkv GEMV's launch."""
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    for layer in layers:
        qkv, res = gemv(x, layer.qkv, prologue=Prologue.ADD_RMS_NORM, residual=res, norm_weight=layer.norm_in,
                        eps=1e-5, launch=qkv_launch)
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
                                       launch=launch).view(1, heads * d)
        o = gemv(attn, layer.o)[0]
        gate_up, res = gemv(o, layer.gate_up, prologue=Prologue.ADD_RMS_NORM, residual=res,
                            norm_weight=layer.norm_post, eps=1e-5)
        x = gemv(gate_up, layer.down, prologue=Prologue.GATED)[0]
    return x


Variant = tuple[str, "AttentionLaunch | str | None", "GemvLaunch | None"]  # label, attention, qkv GEMV


def variants(shape: dict, device=DEV) -> list[Variant]:
    default = AttentionLaunch.choose(1, 1, shape["heads"], shape["kv_heads"], shape["head_dim"], MAX_SEQ_LEN,
                                     torch.device(device))
    out = [("linears only", None, None), ("copy kernel", COPY, None),
           (f"attention default (s{default.num_splits}, preload {default.preload_kv})", default, None)]
    for splits in (8, 16, 32):
        out.append((f"attention s{splits} +preload", replace(default, num_splits=splits, preload_kv=True), None))
    out.append(("default, no preload", replace(default, preload_kv=False), None))
    out.append(("default, trigger after wait", replace(default, trigger=Trigger.AFTER_WAIT), None))
    out.append(("default, 64 keys per block", replace(default, block_n=64), None))
    # The qkv GEMV in 8 x 1024 tiles: half the programs, one wave (8B: 768 programs, 7 per SM), so SM
    # slots are free for the attention's programs to start their pre-wait work during its tail.
    qkv_tiles = replace(GemvLaunch.choose(1, 1024), block_n=8, block_k=1024)
    out.append(("linears only, qkv 8 x 1024", None, qkv_tiles))
    out.append(("default, qkv 8 x 1024", default, qkv_tiles))
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


def chain(name: str, shape: dict, context: int) -> list[str]:
    layers, step = make_layers(shape, context)
    torch.manual_seed(1)
    x = torch.randn(1, shape["hidden"], device=DEV, dtype=BF16)
    res = torch.randn_like(x)
    lines, base_us = [f"{name}: {shape['layers']} layers, batch 1, context {context}"], {}
    for label, launch, qkv_launch in variants(shape):
        check = ""
        if isinstance(launch, AttentionLaunch):
            err = check_attention(layers[0], step, shape, launch)
            check = f"  check {err:.1e} {'ok' if err < BF16_TOL else 'FAIL'}"
        us = graph_us([lambda a=launch, g=qkv_launch: decode_step(layers, step, shape, x, res, a, g)], reps=20)
        if launch is None:  # the baseline of the variants with the same qkv GEMV
            base_us[qkv_launch] = us
        extra = (us - base_us[qkv_launch]) / shape["layers"]
        lines.append(f"  {label:<42}{us / 1e3:>8.3f} ms {us / shape['layers']:>7.2f} us/layer"
                     f"{'' if launch is None else f'  attention +{extra:5.2f} us/layer'}{check}")
        print(lines[-1], flush=True)
    layers.clear()  # free this shape's weights and pools before the next shape
    torch.cuda.empty_cache()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama8b,smollm2")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("AUTODEPLOY_PDL", "1")
    print("torch", torch.__version__, "|", torch.cuda.get_device_name(0), flush=True)
    lines = []
    for name in args.shapes.split(","):
        lines += chain(name, SHAPES[name], args.context)
    print("\n".join(lines))
    return 0 if all("FAIL" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
