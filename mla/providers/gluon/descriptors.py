"""Host-side TMA descriptors of the Gluon kernels, made without re-running the constructor's checks.

Triton's Gluon ``TensorDescriptor`` is a dataclass whose ``__post_init__`` asserts the layout
facts TMA needs (a 16-byte-aligned base and row strides, positive sizes, a contiguous last dim,
a power-of-two block): about a fifth of a prefill launch's host time when three descriptors are
made per call. The prefill routes check the same facts (and say why a call goes elsewhere), so
:func:`unchecked_descriptor` makes the record directly once a route has taken the call. Where
the installed Triton's dataclass has other fields than the ones this module knows, it calls the
constructor (checks included).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

TMA_ALIGN = 16
"""Bytes: TMA needs 16-byte-aligned base addresses and row strides."""
KNOWN_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")
"""The fields of Triton 3.6's Gluon ``TensorDescriptor``, in order."""


@functools.cache
def _descriptor_class() -> tuple[type, bool]:
    """``(TensorDescriptor, whether its fields are KNOWN_FIELDS)``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415 (Gluon is optional)

    fields = tuple(field.name for field in dataclasses.fields(TensorDescriptor))
    return TensorDescriptor, fields == KNOWN_FIELDS


def unchecked_descriptor(
    base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int], layout: Any
) -> Any:
    """``TensorDescriptor(base, shape, strides, block_shape, layout)`` (zero padding) without its
    ``__post_init__`` checks: the caller has checked that TMA can read ``base`` this way."""
    cls, known = _descriptor_class()
    if not known:
        return cls(base, shape, strides, block_shape, layout)
    desc: Any = object.__new__(cls)
    desc.__dict__.update(
        base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout, padding="zero"
    )
    return desc


def token_descriptor(x: torch.Tensor, rows: int, box: int, layout: Any) -> Any:
    """TMA descriptor of ``[rows, box]`` boxes over the 2-D view ``[tokens, (H - 1)·stride(1) + D]``
    of ``x`` (``[tokens, H, D]``, row stride ``stride(0)``; a ``D``-wide tile of head ``h`` is the
    boxes at columns ``h·stride(1) + c·box``). A one-token tensor's row stride is never used
    (TMA still wants it 16-byte aligned). The caller has checked the layout (the prefill routes)."""
    tokens, heads, dim = x.shape
    width = (heads - 1) * x.stride(1) + dim
    row_stride = x.stride(0) if tokens > 1 else max(width, x.stride(0))
    per_align = TMA_ALIGN // x.element_size()
    row_stride = -(-row_stride // per_align) * per_align
    return unchecked_descriptor(x, [tokens, width], [row_stride, 1], [rows, box], layout)


__all__ = ["KNOWN_FIELDS", "TMA_ALIGN", "token_descriptor", "unchecked_descriptor"]
