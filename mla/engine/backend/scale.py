"""The one owner of a backend's fp8 ``kv_scale`` (:class:`KVScale`).

Kernels read the per-tensor scale from a device tensor, so a captured CUDA graph replays with
the current value. A caller passes a float, a 0-d or one-element tensor, or ``None``: the door
that takes it (``AttentionImpl``'s calls, the functional API) checks it once and this owner
converts it once, into the float32 ``[1]`` device tensor the custom ops carry to the strategy's
``run`` and the provider; nothing after the door checks or converts it again.
"""

from __future__ import annotations

import torch

from mla.core.validate import check_cache_scale


class KVScale:
    """A backend's ``kv_scale``: its device buffer, and the check and conversion of a caller's
    value for a cache of ``kv_dtype``."""

    def __init__(self, kv_dtype: torch.dtype, device: torch.device) -> None:
        self.kv_dtype = kv_dtype
        self.buffer = torch.ones(1, dtype=torch.float32, device=device)
        """float32 ``[1]``: a float ``kv_scale`` (or a tensor of another dtype or device) lives here."""
        self.value: float | None = None
        """The float last written into :attr:`buffer` (``None``: a tensor was copied in, or nothing)."""

    def tensor(self, kv_scale: object, *, device: torch.device, required: bool = True) -> torch.Tensor | None:
        """Check ``kv_scale`` (:func:`~mla.core.validate.check_cache_scale`: an fp8 cache needs a
        finite float > 0 or a one-element float tensor on ``device``'s type, unless not
        ``required``; a float cache takes none) and :meth:`convert` it."""
        check_cache_scale(kv_scale, self.kv_dtype, device=device, required=required)
        return self.convert(kv_scale)  # type: ignore[arg-type]  # checked: a float, a tensor or None

    def convert(self, kv_scale: float | torch.Tensor | None) -> torch.Tensor | None:
        """A checked ``kv_scale`` as the float32 ``[1]`` device tensor the ops take, without a
        host sync: a float32 tensor on the buffer's device is used as it is (a graph then reads
        its current value), another tensor is copied into :attr:`buffer`, a float is written
        there when it changed; ``None`` stays ``None``."""
        if kv_scale is None:
            return None
        buffer = self.buffer
        if isinstance(kv_scale, torch.Tensor):
            if kv_scale.dtype == torch.float32 and kv_scale.device == buffer.device:
                return kv_scale.reshape(1)
            buffer.copy_(kv_scale.reshape(1), non_blocking=True)
            self.value = None
            return buffer
        if kv_scale != self.value:
            buffer.fill_(float(kv_scale))
            self.value = float(kv_scale)
        return buffer
