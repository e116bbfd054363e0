"""Per-tensor fp8 quantization used by strategies that feed fp8 kernels."""

from __future__ import annotations

import torch


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ~= q.float() * scale`` with a dynamic per-tensor scale (device ops, no host sync).

    Returns ``(q, scale)``: ``q`` in ``dtype`` (an fp8 format) and ``scale`` a float32 0-dim
    tensor ``amax(|x|) / finfo(dtype).max`` (1 for an all-zero tensor).
    """
    finfo = torch.finfo(dtype)
    amax = x.detach().abs().amax().to(torch.float32)
    scale = torch.where(amax > 0, amax / finfo.max, torch.ones_like(amax))
    q = torch.clamp(x.to(torch.float32) / scale, finfo.min, finfo.max).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale
