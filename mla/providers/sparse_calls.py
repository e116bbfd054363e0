"""The sparse (DeepSeek Sparse Attention) kernel contracts as call records: the sparse attention
over selected cache slots, the slot conversion, the indexer's top-k and its key write. The
conventions of :mod:`mla.providers.calls` hold here too; that module re-exports these records.
"""

from __future__ import annotations

import attrs
import torch

from mla.core.errors import InvalidInputError


@attrs.frozen(kw_only=True, eq=False)
class SparseAttentionCall:
    """Sparse MLA in the absorbed MQA form (contract ``sparse-attention``).

    Query row ``t`` attends exactly the cache rows ``slots[t, :]`` that are ``>= 0`` (a row's
    slots are distinct; ``-1`` pads): ``s = (q_t . k) * softmax_scale`` over those rows,
    ``o_t = softmax(s) @ v`` with ``v`` the first ``L`` lanes of each row, ``lse_t =
    logsumexp(s)``. A row with no slot gets ``o = 0`` and ``lse = -inf``. Which tokens a row
    sees (causality, the indexer's choice) is entirely in ``slots``.
    """

    q: torch.Tensor
    """``[T, H, L+R]`` in the model dtype, contiguous."""
    kv_cache: torch.Tensor
    """Flat cache ``[N_tok, W]``: a float dtype (``W = L+R``), fp8 e4m3 with ``kv_scale``
    (``W = L+R``), or uint8 ``fp8_ds_mla`` rows (``W = L + 4 L/128 + 2 R``)."""
    slots: torch.Tensor
    """int32 ``[T, K]`` flat cache row ids, ``-1`` for none (a slot past the cache is invalid
    too and never read); may be a view with a contiguous last dim."""
    out: torch.Tensor
    """``[T, H, L]`` in q's dtype."""
    lse: torch.Tensor | None
    """``[T, H]`` float32, or ``None`` (not wanted)."""
    kv_lora_rank: int
    rope_dim: int
    softmax_scale: float
    kv_scale: torch.Tensor | None
    """float32 ``[1]`` dequant scale of a per-tensor fp8 cache, else ``None``."""
    lengths: torch.Tensor | None = None
    """int32 ``[T]`` or ``None``: row ``t`` attends only ``slots[t, :lengths[t]]`` (clamped to
    ``[0, K]``); the columns at or past it are never read, so a kernel skips their tiles. The
    same result as those columns set to ``-1`` (a causal prefill's early rows, a short
    request's decode: the indexer leaves their tails ``-1``). ``None``: all ``K`` columns.
    :class:`SparseSlotsCall` writes it."""


@attrs.frozen(kw_only=True, eq=False)
class SparseSlotsCall:
    """Request-local token positions to cache slots, on the device (no host sync).

    ``slots[t, j] = block_table[row_request[t], p // block_size] * block_size + p % block_size``
    for ``p = indices[t, j]`` with ``0 <= p < row_keys[t]`` and a block id inside the cache;
    ``-1`` otherwise. Entries that are neither ``-1`` nor valid (a position the row may not see,
    a block id outside the cache) become ``-1`` too and are added to ``invalid_count``: a bad
    index never reads another request's rows.
    """

    indices: torch.Tensor
    """int32 ``[T, K]`` request-local positions, ``-1`` pads."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``."""
    row_request: torch.Tensor
    """int32 ``[T]``: the request (block-table row) of each query row (clamped to the table)."""
    row_keys: torch.Tensor
    """int32 ``[T]``: positions ``0 .. row_keys[t] - 1`` are visible to row ``t`` (causal);
    0 for graph-padding rows."""
    block_size: int
    num_blocks: int
    """Blocks in the cache the slots index (the run's cache tensor)."""
    slots: torch.Tensor
    """int32 ``[T, K]`` output (may be ``indices`` itself, converted in place)."""
    invalid_count: torch.Tensor
    """int32 ``[1]`` device counter, incremented by the number of invalid entries."""
    lengths: torch.Tensor | None = None
    """int32 ``[T]`` output or ``None``: ``1 +`` the last column of row ``t`` whose slot is valid
    (0 when none), the :attr:`SparseAttentionCall.lengths` of the converted slots."""


@attrs.frozen(kw_only=True, eq=False)
class IndexTopkCall:
    """The lightning indexer's scores and top-k over a paged index-key cache (contract ``indexer``).

    ``score[t, p] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . key(p))`` for the
    positions ``p < row_keys[t]`` of row ``t``'s request (``key(p)`` read through
    ``block_table[row_request[t]]``, fp8 keys dequantized by their per-token scale);
    ``indices[t]`` gets the ``min(topk, row_keys[t], max_keys)`` positions of highest score,
    then ``-1`` (a position whose block id is outside the cache or past the block table is not
    scored, so such a row keeps fewer). The positions are in no particular order (the torch
    provider sorts them by descending score, the Triton one does not: attention over them is
    order-invariant). Ties may break either way.
    """

    q: torch.Tensor
    """``[T, Hi, D]`` index queries (after their rope), float dtype; or ``float8_e4m3fn`` with
    fp8 keys (DeepSeek-V3.2's form: quantized per (row, head), the scale folded into
    ``weights``; :func:`mla.providers.formats.quantize_index_queries`)."""
    weights: torch.Tensor
    """``[T, Hi]`` float32 per-head weights (the model's, e.g. ``weights_proj(x) * Hi ** -0.5``)."""
    index_cache: torch.Tensor
    """``[blocks, block_size, D]`` of a float dtype, or uint8 ``[blocks, block_size, D + 4]``
    fp8 keys with per-token scales (:class:`mla.core.config.IndexerSpec`)."""
    key_dtype: torch.dtype
    """The keys' dtype (``float8_e4m3fn`` for the byte layout)."""
    block_table: torch.Tensor
    row_request: torch.Tensor
    """int32 ``[T]``."""
    row_keys: torch.Tensor
    """int32 ``[T]`` visible positions per row (0: none, e.g. graph padding)."""
    max_keys: int
    """Static bound on ``row_keys`` (sizes the work; no host read of ``row_keys``)."""
    softmax_scale: float
    topk: int
    indices: torch.Tensor
    """int32 ``[T, topk]`` output: request-local positions, ``-1`` pads."""


@attrs.frozen(kw_only=True, eq=False)
class WriteIndexKeysCall:
    """Write new tokens' index keys into the index-key cache (contract ``indexer``); fp8 keys
    are quantized per token with a power-of-two scale (:func:`mla.providers.formats.quantize_index_keys`)."""

    keys: torch.Tensor
    """``[N, D]`` float (after the key norm and rope)."""
    index_cache: torch.Tensor
    key_dtype: torch.dtype
    slot_mapping: torch.Tensor
    """``[N]`` flat slots (negative or past the cache = skip)."""


def check_lengths(lengths: torch.Tensor | None, rows: int, device: torch.device) -> None:
    """Raise :class:`InvalidInputError` (argument ``lengths``) unless ``lengths`` is ``None`` or
    int32 ``[rows]`` with stride 1 on ``device`` (the kernels index it by row); its values need
    no check (a kernel clamps each into ``[0, K]``)."""
    if lengths is None:
        return
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (rows,) or lengths.stride(0) != 1:
        raise InvalidInputError(
            "lengths",
            f"expected int32 [{rows}] with stride 1, got {lengths.dtype} {tuple(lengths.shape)} "
            f"strides {lengths.stride()}",
        )
    if lengths.device != device:
        raise InvalidInputError("lengths", f"expected device {device} (the query's), got {lengths.device}")


__all__ = ["IndexTopkCall", "SparseAttentionCall", "SparseSlotsCall", "WriteIndexKeysCall", "check_lengths"]
