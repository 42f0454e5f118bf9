"""A tiny emulator of the straight-line PTX the kernels' e2m1 decoders hand to ``tl.inline_asm_elementwise``
(prmt, shl, shr, and, lop3, mov of a b32 into two b16 halves, cvt.f32.f16): the GPU-only decode paths
checked on the CPU, bit for bit, against the e2m1 table."""

from __future__ import annotations

import struct


def fp16_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def _prmt(a, b, selector):
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(source[(selector >> 4 * i) & 7] << 8 * i for i in range(4))


def _lop3(a, b, c, lut):
    bits = ((((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | (c >> i) & 1, i) for i in range(32))
    return sum(((lut >> index) & 1) << i for index, i in bits)


OPS = {"prmt.b32": _prmt, "shl.b32": lambda a, n: (a << n) & 0xFFFFFFFF, "shr.b32": lambda a, n: a >> n,
       "and.b32": lambda a, b: a & b, "lop3.b32": _lop3, "cvt.f32.f16": fp16_value}


def run_ptx(text: str, inputs: dict[str, int]) -> dict:
    """Every register after running ``text`` (``{ ... }`` of one asm block) on ``inputs`` ({"$4": word}):
    b32 registers as unsigned ints, cvt.f32.f16 results as Python floats."""
    regs = dict(inputs)

    def value(token):
        return regs[token] if token in regs else int(token, 0)

    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32":  # mov.b32 {lo, hi}, word
            halves, source = args.rsplit(",", 1)
            lo, hi = (h.strip() for h in halves.strip().strip("{}").split(","))
            regs[lo], regs[hi] = value(source.strip()) & 0xFFFF, value(source.strip()) >> 16
            continue
        dst, *sources = (a.strip() for a in args.split(","))
        regs[dst] = OPS[op](*map(value, sources))
    return regs
