"""Argument checks shared by the engine's entry points (the backend, its impl and the functional API)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla.core.errors import InvalidInputError
from mla.core.validate import (
    HostLengths,
    ValidateMode,
    check_block_ids,
    check_paged_request_values,
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


def check_paged_step(
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
    num_blocks: int,
    max_model_len: int | None = None,
    block_ids: bool,
    lengths: HostLengths | None = None,
) -> torch.Tensor | None:
    """The host rules of a paged step's requests (on host values: each request's query length
    and seq_len, with their ``lengths`` when the caller has them); with ``block_ids``
    (``validate="full"``) also every block id, reading ``block_table`` on the host. Returns
    that host table (else ``None``)."""
    check_paged_request_values(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table_shape=tuple(block_table.shape),
        block_size=block_size,
        max_model_len=max_model_len,
        lengths=lengths,
    )
    if not block_ids:
        return None
    table_cpu = block_table.cpu()
    check_block_ids(
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        block_table_cpu=table_cpu,
        block_size=block_size,
        num_blocks=num_blocks,
    )
    return table_cpu


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
