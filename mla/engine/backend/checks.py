"""Argument checks shared by the engine's entry points (the backend, its impl and the functional API)."""

from __future__ import annotations

import torch

from mla.core.errors import InvalidInputError
from mla.core.validate import (
    ValidateMode,
    check_slots,
    check_write_kv,
    require_same_device,
    require_tensor,
)


def require_instance(argument: str, value: object, cls: type) -> None:
    """``value`` is a ``cls`` (an :class:`InvalidInputError` naming ``argument`` otherwise)."""
    if not isinstance(value, cls):
        raise InvalidInputError(argument, f"expected an mla.{cls.__name__}, got {type(value).__name__}")


def require_tensors(**tensors: object) -> None:
    """Each argument is a tensor (a readable error before any op dispatch)."""
    for name, value in tensors.items():
        require_tensor(name, value)


def require_on_q_device(q: torch.Tensor, **others: object) -> None:
    """Every tensor argument is on q's device (the op dispatches on the devices it is given)."""
    require_same_device(("q", q), *((name, t) for name, t in others.items() if isinstance(t, torch.Tensor)))


def check_kv_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None,
    mode: ValidateMode,
) -> None:
    """A KV write's arguments; ``validate="full"`` also reads the slots on the host and rejects
    slots outside the cache and slots two tokens share."""
    check_write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_scale)
    if mode == "full":
        check_slots(slot_mapping.cpu(), num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[1])
