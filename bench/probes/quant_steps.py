"""The quantized GEMVs with the step before them, for ``quant_kernels.py --steps``: the residual add + RMSNorm
before qkv and gate_up, SiLU·mul before down, either folded into the GEMV's operand loads (one launch:
``kernels/quant_gemv.py``'s prologues, what the fused ops run at one row) or apart (the step's Triton kernel,
then the plain GEMV: the ops with ``AUTODEPLOY_QUANT_GEMV_PROLOGUE=0``, as before 2026-12-07).

Each implementation takes the probe's x [M, K] and one weight set (``quant_kernels.formats()``); the step's
other inputs (the residual and the norm weight, or the up half of gate_up) are made beside x on first use and
reused by the timed replays. The reference: the step in fp32, then x times the fp32 dequantized weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-5
STEPS = {"add_norm": ("qkv", "gate_up"), "gated": ("down",)}  # the step before each 8B linear that has one
GEMVS = {"fp8_gemv channel": "fp8_channel", "fp8_gemv block128": "fp8_block", "nvfp4_gemv": "nvfp4"}
MODES = ("+step", "step apart")  # folded into the GEMV; the step's kernel, then the GEMV


class StepInputs:
    """The step's inputs beside each x (x kept with them: a freed x's address may come back)."""

    def __init__(self):
        self._made: dict = {}

    def of(self, x: torch.Tensor, step: str) -> tuple[torch.Tensor, ...]:
        """``(x, residual, norm weight)`` for ``add_norm``; ``(x, gate_up)`` for ``gated``, x its gate."""
        key = (x.data_ptr(), tuple(x.shape), step)
        if key not in self._made:
            if step == "gated":
                self._made[key] = (x, torch.cat([x, torch.randn_like(x)], -1))
            else:
                norm_weight = torch.rand(x.shape[-1], device=x.device, dtype=x.dtype) + 0.5
                self._made[key] = (x, torch.randn_like(x), norm_weight)
        return self._made[key]

    def operand(self, x: torch.Tensor, step: str) -> torch.Tensor:
        """The step's output in fp32: what the GEMV multiplies by the weight."""
        made = self.of(x, step)
        if step == "gated":
            gate, up = made[1].float().chunk(2, dim=-1)
            return F.silu(gate) * up
        summed = (x + made[1]).float()
        return F.rms_norm(summed, (x.shape[-1],), made[2].float(), EPS)


def step_call(gemv: str, step: str, mode: str, inputs: StepInputs):
    """``call(x, weights, launch=None)`` of one GEMV with its step, folded in or apart (``launch``: the GEMV's)."""
    from autodeploy.kernels import quant_gemv as qg
    from autodeploy.kernels.activation import act_mul
    from autodeploy.kernels.gemv import GemvPrologue, Prologue
    from autodeploy.kernels.norm import add_rms_norm

    nvfp4 = gemv.startswith("nvfp4")
    plain, fused = (qg.nvfp4_gemv, qg.nvfp4_prologue_gemv) if nvfp4 else (qg.fp8_gemv, qg.fp8_prologue_gemv)

    def call(x, t, launch=None):
        made = inputs.of(x, step)
        if mode == "+step" and step == "gated":
            return fused(made[1], **t, prologue=GemvPrologue(Prologue.GATED), launch=launch)[0]
        if mode == "+step":
            prologue = GemvPrologue(Prologue.ADD_RMS_NORM, made[1], made[2], EPS)
            return fused(x, **t, prologue=prologue, launch=launch)[0]
        if step == "gated":
            gate, up = made[1].chunk(2, dim=-1)
            return plain(act_mul(gate, up, "silu"), **t, launch=launch)
        return plain(add_rms_norm(x, made[1], made[2], EPS)[0], **t, launch=launch)

    return call


def implementations(impl_type) -> list:
    """The probe's ``Impl`` (``impl_type``) of every GEMV x step x mode, each at the shapes its step precedes."""
    inputs = StepInputs()
    impls = []
    for gemv, fmt in GEMVS.items():
        for step, shapes in STEPS.items():
            def reference(x, t, dequantized, step=step):
                return inputs.operand(x, step) @ dequantized().t()

            for mode in MODES:
                impls.append(impl_type(f"{gemv} {step} {mode}", fmt, step_call(gemv, step, mode, inputs), reference,
                                       max_rows=4, shapes=shapes))
    return impls


def summary(results, layers: int) -> list[str]:
    """Per GEMV and row count: a step's linears that have a step (qkv, gate_up, down, ``layers`` times) with the
    step folded in against apart, where every one was measured."""
    us = {(r.shape, r.rows, r.impl): r.us for r in results if r.us}
    lines = []
    for gemv in GEMVS:
        for rows in sorted({r.rows for r in results}):
            totals = {}
            for mode in MODES:
                parts = [us.get((shape, rows, f"{gemv} {step} {mode}")) for step, shapes in STEPS.items()
                         for shape in shapes]
                totals[mode] = layers * sum(parts) / 1e3 if all(parts) else None
            if all(totals.values()):
                folded, apart = totals["+step"], totals["step apart"]
                lines.append(f"8B decode, {rows} row(s), {gemv:<18} step + qkv/gate_up/down x {layers}: folded "
                             f"{folded:.3f} ms, apart {apart:.3f} ms ({folded - apart:+.3f} ms a step)")
    return lines
