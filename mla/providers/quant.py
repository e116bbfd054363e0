"""Per-tensor fp8 quantization used by strategies that feed fp8 kernels, and the device buffer
that carries a per-tensor scale to the kernels."""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import InvalidInputError


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ~= q.float() * scale`` with a dynamic per-tensor scale (device ops, no host sync).

    Returns ``(q, scale)``: ``q`` in ``dtype`` (an fp8 format) and ``scale`` a float32 0-dim
    tensor ``amax(|x|) / finfo(dtype).max`` over the finite values of ``x`` (1 when there are
    none or all are zero), so a NaN in one request's rows does not change every other row's
    rounding; non-finite values stay NaN or saturate.
    """
    finfo = torch.finfo(dtype)
    amax = torch.nan_to_num(x.detach().abs(), nan=0.0, posinf=0.0).amax().to(torch.float32)
    scale = torch.where(amax > 0, amax / finfo.max, torch.ones_like(amax))
    q = torch.clamp(x.to(torch.float32) / scale, finfo.min, finfo.max).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale


@attrs.define
class ScaleBuffer:
    """A persistent float32 ``[1]`` device buffer behind a per-tensor scale (the fp8 ``kv_scale``).

    Kernels read scales from device tensors, so a captured CUDA graph replays with the current
    value. :meth:`tensor` turns what a caller passes into that tensor without a host sync: a
    float is written into the buffer (only when it changed), a one-element tensor is used as is
    when it already is float32 on the buffer's device and copied into the buffer otherwise.
    """

    buffer: torch.Tensor
    value: float | None = None
    """The float last written into ``buffer`` (``None``: a tensor was copied in, or nothing)."""

    @classmethod
    def allocate(cls, device: torch.device) -> ScaleBuffer:
        return cls(torch.ones(1, dtype=torch.float32, device=device))

    def tensor(self, scale: float | torch.Tensor | None, argument: str = "kv_scale") -> torch.Tensor | None:
        """``scale`` as a float32 ``[1]`` tensor on the buffer's device (``None`` stays ``None``)."""
        if scale is None:
            return None
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.dtype.is_floating_point:
                raise InvalidInputError(
                    argument,
                    f"expected a float or a one-element float tensor, got {scale.dtype} {tuple(scale.shape)}",
                )
            if scale.dtype == torch.float32 and scale.device == self.buffer.device:
                return scale.reshape(1)
            self.buffer.copy_(scale.reshape(1), non_blocking=True)
            self.value = None
            return self.buffer
        if scale != self.value:
            self.buffer.fill_(float(scale))
            self.value = float(scale)
        return self.buffer
