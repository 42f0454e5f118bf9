"""The number formats of quantized linears, in plain torch: the definition every kernel is checked
against, and the quantizers that write test checkpoints and quantize bf16 weights online.

FP8 is ``float8_e4m3fn`` (largest finite value 448). A weight is ``fp8 * scale`` with ``scale``
fp32 of shape ``[]`` (per tensor), ``[N]`` (per output channel) or ``[ceil(N/bn), ceil(K/bk)]``
(per ``bn x bk`` block). Activations, where a format quantizes them, are rounded to FP8 and back
("fake quantization") before the matmul, which is what an FP8 tensor-core GEMM computes:

- ``static``: one scale from the checkpoint (``input_scale``): ``q = fp8(clamp(x / s, ±448)) * s``;
- ``token``: one scale per row, ``s = max|x_row| / 448`` (at least ``MIN_SCALE``);
- ``group``: one scale per row and group of ``group`` consecutive elements along K (block-scaled
  FP8's activations, groups of ``bk``).

NVFP4 stores e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) two per
byte along K, the element with the even index in the low nibble; each run of 16 elements along K
has an e4m3 scale, and the whole tensor an fp32 ``weight_scale_2``:
``w[n, k] = e2m1[n, k] * float(weight_scale[n, k // 16]) * weight_scale_2``.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # the per-token/group scale of an all-zero row
E2M1_MAX = 6.0
NVFP4_GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x / scale, ±448))`` with ``scale`` broadcast against ``x`` (fp32 math)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fake_quantize_activations(
    x: torch.Tensor, mode: str, input_scale: torch.Tensor | None = None, group: int | None = None
) -> torch.Tensor:
    """``x`` (fp32) as the FP8 GEMM sees it, for ``mode`` none/static/token/group (module doc)."""
    x = x.float()
    if mode == "none":
        return x
    if mode == "static":
        if input_scale is None:
            raise ValueError("static activation quantization needs an input_scale")
        scale = input_scale.float()
        return round_to_fp8(x, scale).float() * scale
    if mode == "token":
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return round_to_fp8(x, scale).float() * scale
    if mode == "group":
        if group is None or x.shape[-1] % group:
            raise ValueError(f"group activation quantization: K={x.shape[-1]} does not split into groups of {group}")
        grouped = x.unflatten(-1, (-1, group))
        scale = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return (round_to_fp8(grouped, scale).float() * scale).flatten(-2)
    raise ValueError(f"unknown activation quantization '{mode}' (none, static, token, group)")


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A ``[ceil(N/bn), ceil(K/bk)]`` block-scale grid repeated to ``shape`` = ``(N, K)``."""
    rows, cols = shape
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The fp32 value of an FP8 weight ``[N, K]`` with per-tensor, per-channel or block scales."""
    w, scale = weight.float(), scale.float()
    if scale.dim() == 2:
        if block is None:
            raise ValueError("a 2-d FP8 weight scale needs its block size")
        return w * expand_block_scale(scale, tuple(w.shape), block)
    if scale.dim() == 1:
        return w * scale[:, None]
    return w * scale


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [N, K], fp32 scale [N])`` with each row's largest magnitude mapped to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return round_to_fp8(w, scale[:, None]), scale


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, fp32 scale [])`` with the largest magnitude mapped to 448."""
    w = weight.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
    return round_to_fp8(w, scale), scale


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)])``, each block's largest magnitude at 448."""
    w = weight.float()
    rows, cols = w.shape
    bn, bk = block
    padded = w.new_zeros(-(-rows // bn) * bn, -(-cols // bk) * bk)
    padded[:rows, :cols] = w
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [gn, bn, gk, bk]
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    return round_to_fp8(w, expand_block_scale(scale, (rows, cols), block)), scale


def _e2m1_table(device: torch.device) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])  # code 8 + i is -E2M1_VALUES[i]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> fp32 ``[N, K]`` (low nibble first)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    return _e2m1_table(packed.device)[codes]


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """The fp32 value of an NVFP4 weight (module doc); ``scale_2`` is ``[]`` or one per row ``[N]``."""
    values = unpack_e2m1(packed)
    groups = scale.float().repeat_interleave(NVFP4_GROUP, dim=1)
    global_scale = scale_2.float()[:, None] if scale_2.dim() == 1 else scale_2.float()
    return values * groups * global_scale


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to the even code) of values already scaled into [-6, 6]."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    odd = (torch.arange(len(E2M1_VALUES), device=x.device) % 2).float()
    distance = (x.abs().unsqueeze(-1) - magnitudes).abs() + odd * 1e-6  # a tie goes to the even code
    index = distance.argmin(dim=-1)
    return (index + 8 * (x < 0)).to(torch.uint8)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 [N, K/2], e4m3 scale [N, K/16], fp32 scale_2 [])`` as ModelOpt computes them:
    ``scale_2 = amax / (6 * 448)``, each group's scale ``amax_group / 6 / scale_2`` (1 for an all-zero
    group) in e4m3's range [2^-9, 448], the values rounded to the nearest e2m1 (ties to even)."""
    w = weight.float()
    rows, cols = w.shape
    if cols % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs K divisible by {NVFP4_GROUP}, got {cols}")
    scale_2 = (w.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp(min=MIN_SCALE)
    groups = w.unflatten(1, (-1, NVFP4_GROUP))
    scale = groups.abs().amax(dim=-1) / E2M1_MAX / scale_2
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).clamp(2**-9, FP8_MAX).to(FP8_DTYPE)
    effective = (scale.float() * scale_2).unsqueeze(-1)
    scaled = torch.where(effective > 0, groups / effective, torch.zeros_like(groups)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _round_to_e2m1_codes(scaled.flatten(1))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale, scale_2
