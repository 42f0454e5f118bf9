"""The quantized-weight formats as the kernels read them: input checks and pure-torch references.

``quant_gemv.py`` and ``quant_gemm.py`` compute what the references here compute (dequantize, then
matmul in fp32), and refuse with the same ``ValueError`` what the checks here refuse. The canonical
ops (``autodeploy::fp8_linear``, ``nvfp4_linear``) keep references of their own with the same
semantics; these are the kernels' test oracles.

FP8 (e4m3fn, largest finite value 448): ``weight_scale`` multiplies the weight (the ``weight_scale``
of ModelOpt / compressed-tensors and the ``weight_scale_inv`` of the DeepSeek-V3 / Qwen3 block
format alike), of one of three kinds: per tensor (one value), per output channel (``[N]`` or
``[N, 1]``), or per block (``[ceil(N / bn), ceil(K / bk)]`` with ``block_size=(bn, bk)``).
Activations are quantized to e4m3 saturating (clamped to +-448, rounded to nearest even) with a
static per-tensor scale, a dynamic per-token scale ``amax(row) / 448``, or a dynamic per-group
scale ``amax(group) / 448`` (1 x ``group_size`` groups along K); a zero row or group gets the
scale ``MIN_AMAX / 448``.

NVFP4 (ModelOpt): ``weight_packed`` uint8 ``[N, K // 2]`` holds two e2m1 codes per byte along K,
element ``2j`` in the low nibble and ``2j + 1`` in the high one (ModelOpt's
``NVFP4QTensor.quantize`` packs ``(q[..., 1::2] << 4) | q[..., 0::2]`` and its ``dequantize`` unpacks
the same way); code bits are sign (8), exponent (6), mantissa (1): magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6. ``weight_scale`` float8_e4m3fn ``[N, K // 16]`` scales each run of 16 elements and the fp32
scalar ``weight_scale_2`` all of them: ``w = e2m1 * (weight_scale * weight_scale_2)``. Fused parts (q/k/v,
gate/up) keep their own global scales: ``weight_scale_2`` is then one per row ``[N]``.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
MIN_AMAX = 1e-12  # the amax of an all-zero row or group: a finite scale, the row quantizes to zeros
NVFP4_GROUP = 16
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------- checks


def check_activations(x: torch.Tensor, k: int, what: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, the weight expects {k} input features")


def check_bias(bias: torch.Tensor | None, n: int, what: str) -> None:
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{what}: bias has shape {tuple(bias.shape)}, expected ({n},)")


def fp8_scale_kind(weight: torch.Tensor, weight_scale: torch.Tensor, block_size=None,
                   what: str = "fp8") -> str:
    """``"tensor"``, ``"channel"`` or ``"block"``: the kind of ``weight_scale``, or a ValueError."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{what}: the weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                         f"of shape {tuple(weight.shape)}")
    if weight_scale.dtype != torch.float32:
        raise ValueError(f"{what}: weight_scale must be float32, got {weight_scale.dtype}")
    n, k = weight.shape
    if block_size is not None:
        bn, bk = _block_size(block_size, what)
        want = (-(-n // bn), -(-k // bk))
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"{what}: a weight of shape ({n}, {k}) in blocks of {(bn, bk)} needs a "
                             f"weight_scale of shape {want}, got {tuple(weight_scale.shape)}")
        return "block"
    if weight_scale.numel() == 1:
        return "tensor"
    if tuple(weight_scale.shape) in ((n,), (n, 1)):
        return "channel"
    raise ValueError(f"{what}: weight_scale of shape {tuple(weight_scale.shape)} is neither per tensor, per "
                     f"channel ({n},) nor per block (pass block_size) for a weight of shape ({n}, {k})")


def _block_size(block_size, what: str) -> tuple[int, int]:
    if len(block_size) != 2 or any(int(b) != b or b < 1 for b in block_size):
        raise ValueError(f"{what}: block_size must be two positive integers (rows, columns), "
                         f"got {block_size}")
    return int(block_size[0]), int(block_size[1])


def check_nvfp4(weight_packed, weight_scale, weight_scale_2, what: str = "nvfp4") -> tuple[int, int]:
    """``(N, K)`` of an NVFP4 weight, or a ValueError naming what does not fit."""
    if weight_packed.dtype != torch.uint8 or weight_packed.dim() != 2:
        raise ValueError(f"{what}: weight_packed must be a 2-D uint8 tensor (two e2m1 codes per byte), got "
                         f"{weight_packed.dtype} of shape {tuple(weight_packed.shape)}")
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    if k % NVFP4_GROUP:
        raise ValueError(f"{what}: K = {k} is not a multiple of the NVFP4 block of {NVFP4_GROUP}")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // NVFP4_GROUP):
        raise ValueError(f"{what}: weight_scale must be float8_e4m3fn of shape {(n, k // NVFP4_GROUP)}, got "
                         f"{weight_scale.dtype} of shape {tuple(weight_scale.shape)}")
    if weight_scale_2.dtype != torch.float32 or (weight_scale_2.numel() != 1 and tuple(weight_scale_2.shape) != (n,)):
        raise ValueError(f"{what}: weight_scale_2 must be one float32 value or one per row ({n},), got "
                         f"{weight_scale_2.dtype} of shape {tuple(weight_scale_2.shape)}")
    return n, k


# ----------------------------------------------------------------------------- references


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, block_size=None) -> torch.Tensor:
    """The fp32 weight [N, K] an FP8 weight and its scale stand for."""
    kind = fp8_scale_kind(weight, weight_scale, block_size)
    w = weight.float()
    if kind == "tensor":
        return w * weight_scale.reshape(())
    if kind == "channel":
        return w * weight_scale.reshape(-1, 1)
    bn, bk = _block_size(block_size, "fp8")
    n, k = w.shape
    return w * weight_scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def unpack_e2m1(weight_packed: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of the e2m1 codes packed two per byte (low nibble first)."""
    codes = torch.stack((weight_packed & 0xF, weight_packed >> 4), dim=-1).flatten(-2)
    return torch.tensor(E2M1_VALUES, device=weight_packed.device)[codes.long()]


def dequantize_nvfp4(weight_packed, weight_scale, weight_scale_2) -> torch.Tensor:
    check_nvfp4(weight_packed, weight_scale, weight_scale_2)
    global_scale = weight_scale_2.reshape(-1, 1) if weight_scale_2.dim() == 1 else weight_scale_2.reshape(())
    scale = (weight_scale.float() * global_scale).repeat_interleave(NVFP4_GROUP, 1)
    return unpack_e2m1(weight_packed) * scale


def fp8_quantize_reference(x: torch.Tensor, scale: torch.Tensor | None = None,
                           group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8, scale)`` with ``x ~ x_fp8 * scale``: static per tensor (``scale`` given), dynamic per
    token (scale [..., 1]) or per group of ``group_size`` columns (scale [..., ceil(K / group_size)],
    the last group the columns left)."""
    xf = x.float()
    if scale is not None:
        return _to_e4m3(xf / scale.float().reshape(())), scale
    groups = _column_groups(xf, group_size or x.shape[-1])
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    # a tensor divisor: on CUDA torch divides by a Python scalar as a multiplication by its reciprocal,
    # one ulp off the IEEE quotient the kernels compute (div_rn) for about half the rows (H100, 2026-12-07)
    found = amax / torch.full_like(amax, FP8_MAX)
    return _to_e4m3(groups / found).flatten(-2)[..., :x.shape[-1]], found.squeeze(-1)


def _column_groups(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [..., K] as [..., ceil(K / size), size], the last group padded with zeros."""
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % size)).unflatten(-1, (-1, size))


def _to_e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_weight_only_reference(x, weight, weight_scale, block_size=None, bias=None) -> torch.Tensor:
    """What ``fp8_gemv`` computes: x (unquantized) times the dequantized weight, in fp32."""
    return _linear(x.float(), dequantize_fp8(weight, weight_scale, block_size), bias, x.dtype)


def fp8_linear_reference(x, weight, weight_scale, input_scale=None, block_size=None,
                         bias=None) -> torch.Tensor:
    """What ``fp8_gemm`` computes: x quantized (static per tensor with ``input_scale``, per 1 x bk group
    with ``block_size``, else dynamic per token), times the dequantized weight, in fp32."""
    group = _block_size(block_size, "fp8")[1] if block_size is not None else None
    x_fp8, x_scale = fp8_quantize_reference(x, input_scale, group)
    if group is None:
        x_deq = x_fp8.float() * x_scale
    else:
        x_deq = (_column_groups(x_fp8.float(), group) * x_scale.unsqueeze(-1)).flatten(-2)[..., :x.shape[-1]]
    return _linear(x_deq, dequantize_fp8(weight, weight_scale, block_size), bias, x.dtype)


def nvfp4_linear_reference(x, weight_packed, weight_scale, weight_scale_2, bias=None) -> torch.Tensor:
    """What ``nvfp4_gemv`` and ``nvfp4_gemm`` compute: x times the dequantized weight, in fp32."""
    return _linear(x.float(), dequantize_nvfp4(weight_packed, weight_scale, weight_scale_2), bias, x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias, dtype) -> torch.Tensor:
    out = x @ weight.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)
