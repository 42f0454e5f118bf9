"""NVFP4's e2m1 codes decoded in Triton kernels (``quant_gemv.py``, ``nvfp4_gemv.py``, ``quant_gemm.py``): each code's
bits moved into an fp16 (the value times 2**-14, exact), in plain Triton (the interpreter) or by a PTX sequence
on the GPU (``e2m1_ptx``); the format itself is ``quant_reference.py``'s."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

E2M1_UNIT = 16384.0  # e2m1_to_fp16 returns the value times 2**-14


@triton.jit
def e2m1_to_fp16(code):
    """The e2m1 value of ``code`` (its low 4 bits) times 2**-14, as fp16: the sign bit moves to bit
    15, exponent and mantissa to bits 10-9, so exponent e > 0 reads as 2**(e - 15) and the e2m1
    subnormal 0.5 as fp16's subnormal 2**-15."""
    c = code.to(tl.uint16)
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True)


# e2m1_to_fp16 on four packed bytes at once (sm_80+ PTX; the interpreter runs e2m1_to_fp16): the
# bytes spread to the 16-bit halves of two words (prmt), then per half the low nibble's magnitude
# shifted to bits 11-9 and its sign to bit 15 (shl; and; lop3 0xE4 = c ? a : b), likewise the high
# nibble's. Out: low nibbles of bytes 0-1, 2-3, then high nibbles of bytes 0-1, 2-3 (fp16 pairs).
def _e2m1_asm() -> str:
    lines = ["{", ".reg .b32 t0, t1, a, b;", "prmt.b32 t0, $4, 0, 0x4140;", "prmt.b32 t1, $4, 0, 0x4342;"]
    for out, (word, magnitude, sign) in enumerate([("t0", 9, 12), ("t1", 9, 12), ("t0", 5, 8), ("t1", 5, 8)]):
        lines += [f"shl.b32 a, {word}, {magnitude};", f"shl.b32 b, {word}, {sign};",
                  "and.b32 b, b, 0x80008000;", f"lop3.b32 ${out}, a, b, 0x0E000E00, 0xE4;"]
    return "\n".join(lines + ["}"])


E2M1_ASM = tl.constexpr(_e2m1_asm())


@triton.jit
def e2m1_pairs_to_fp16(packed, ROWS: tl.constexpr, BYTES: tl.constexpr, ASM: tl.constexpr):
    """A [ROWS, BYTES] tile of packed bytes as [ROWS, 2 * BYTES] fp16 elements in order (low nibble
    first), times 2**-14 (``e2m1_to_fp16``); ``ASM``: four bytes per PTX sequence (``E2M1_ASM``)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(E2M1_ASM, "=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        low, high = e2m1_to_fp16(packed & 0xF), e2m1_to_fp16(packed >> 4)
    return tl.reshape(tl.join(low, high), [ROWS, 2 * BYTES])


@triton.jit
def nvfp4_block_dequantize(packed, scale, ROWS: tl.constexpr, ELEMENTS: tl.constexpr, ASM: tl.constexpr):
    """A [ROWS, ELEMENTS // 2] tile of packed bytes and its [ROWS, ELEMENTS // 16] e4m3 scales as
    [ROWS, ELEMENTS // 16, 16] fp16 values times 2**-14: exact (each product has at most 8
    significant bits and is a multiple of 2**-24, fp16's smallest subnormal, below 0.17)."""
    values = tl.reshape(e2m1_pairs_to_fp16(packed, ROWS, ELEMENTS // 2, ASM), [ROWS, ELEMENTS // 16, 16])
    return values * scale.to(tl.float16)[:, :, None]


def e2m1_ptx(device: torch.device) -> bool:
    """Whether kernels decode e2m1 with ``E2M1_ASM`` (compiled for a GPU) or in plain Triton (the
    interpreter)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
