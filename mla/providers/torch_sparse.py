"""DeepSeek Sparse Attention in plain torch: the torch provider's ``sparse-attention`` and
``indexer`` contracts (:class:`~mla.providers.calls.SparseAttentionCall`,
:class:`~mla.providers.calls.IndexTopkCall`, :class:`~mla.providers.calls.WriteIndexKeysCall`).

Written like kernels, as the rest of the torch provider: any device, no host sync, no
allocation whose size depends on tensor values (every shape comes from the call's tensors'
shapes and its Python ints), so they run inside a captured CUDA graph and on the ``meta``
device. The work follows the batch, never the cache: the sparse attention gathers only the
``T x K`` rows its slots name and the indexer scores ``T x max_keys`` positions, both in
chunks of rows (and positions) bounded by :data:`CHUNK_BYTES`.

Fixed shapes mean a masked entry still gathers a row (a clamped index's: the null block,
another request's, a stale one). Those rows are replaced by zeros (``torch.where`` on the
values) before any product, so nothing from memory a row may not see reaches it, not even as
``0 * NaN``.
"""

from __future__ import annotations

import torch

from mla.core.config import is_ds_mla
from mla.providers import formats
from mla.providers.calls import IndexTopkCall, SparseAttentionCall, WriteIndexKeysCall

CHUNK_BYTES = 64 << 20
"""Bound on the float32 working set of one chunk (gathered rows, scores) in bytes."""

_F32 = 4


def _chunk(total: int, per_item_bytes: int) -> int:
    """Items per chunk so that ``items * per_item_bytes`` stays within :data:`CHUNK_BYTES`."""
    return max(1, min(total, CHUNK_BYTES // max(1, per_item_bytes)))


# -- sparse attention -------------------------------------------------------------------------


def _gather_latent(call: SparseAttentionCall, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(latent [..., L], rope [..., R])`` of the cache rows at ``index`` (in range)."""
    cache, rank, rope_dim = call.kv_cache, call.kv_lora_rank, call.rope_dim
    if is_ds_mla(cache.dtype):
        return formats.ds_mla_parts(cache[index], rank, rope_dim)
    if cache.element_size() == 1:
        # fp8 storage: gather the bytes (every device has a byte gather), then reinterpret.
        rows = cache.view(torch.uint8)[index].view(cache.dtype).to(torch.float32)
    else:
        rows = cache[index].to(torch.float32)
    if call.kv_scale is not None:
        rows = rows * call.kv_scale
    return rows[..., :rank], rows[..., rank : rank + rope_dim]


def _masked_softmax(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised probabilities and LSE over the last dim of ``scores`` where ``valid``.

    Rows without a valid entry give zero probabilities and ``lse = -inf``; a NaN score among the
    valid entries gives NaN, as in the reference math."""
    scores = torch.where(valid, scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    probs = torch.exp(scores - safe_max)
    denom = probs.sum(dim=-1)
    lse = torch.where(denom == 0, float("-inf"), torch.log(denom) + safe_max.squeeze(-1))
    probs = probs / denom.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return probs, lse


def sparse_attention(call: SparseAttentionCall) -> None:
    """Each query row attends exactly its valid slots (see :class:`SparseAttentionCall`).

    A slot that is ``-1`` (or, out of contract, outside the cache) is masked, and so is every
    column ``j >= lengths[t]`` when ``call.lengths`` (int32 ``[T]``) is given (a negative length
    masks the whole row, one above ``K`` none: the clamp to ``[0, K]``). Computes in float32;
    writes ``out`` in its dtype and ``lse`` only when given."""
    q, slots, out, lse = call.q, call.slots, call.out, call.lse
    rows, heads, _ = q.shape
    width = slots.shape[1]
    rank, rope_dim = call.kv_lora_rank, call.rope_dim
    cache_rows = call.kv_cache.shape[0]
    if rows == 0:
        return
    if width == 0 or cache_rows == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    # Per row: K gathered rows (raw bytes, float32 values, masked copy) and three [H, K] score
    # tensors (scores, exp, probabilities).
    row_bytes = call.kv_cache.shape[-1] * call.kv_cache.element_size() + 2 * _F32 * (rank + rope_dim)
    step = _chunk(rows, width * (row_bytes + 3 * _F32 * heads))
    columns = torch.arange(width, device=slots.device)[None, :]
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        slot = slots[lo:hi].to(torch.int64)
        valid = (slot >= 0) & (slot < cache_rows)
        if call.lengths is not None:
            valid = valid & (columns < call.lengths[lo:hi].to(torch.int64)[:, None])
        latent, rope = _gather_latent(call, torch.clamp(slot, 0, cache_rows - 1))
        latent = torch.where(valid[..., None], latent, 0.0)
        rope = torch.where(valid[..., None], rope, 0.0)
        qf = q[lo:hi].to(torch.float32)
        scores = torch.einsum("nhl,nkl->nhk", qf[..., :rank], latent)
        scores = scores + torch.einsum("nhr,nkr->nhk", qf[..., rank : rank + rope_dim], rope)
        probs, row_lse = _masked_softmax(scores * call.softmax_scale, valid[:, None, :])
        out[lo:hi].copy_(torch.einsum("nhk,nkl->nhl", probs, latent))
        if lse is not None:
            lse[lo:hi].copy_(row_lse)


# -- indexer ----------------------------------------------------------------------------------


def write_index_keys(call: WriteIndexKeysCall) -> None:
    """Write (fp8: quantize per token, then write) the new tokens' index keys at their slots
    (:func:`mla.providers.formats.write_index_keys`)."""
    formats.write_index_keys(call.keys, call.index_cache, call.key_dtype, call.slot_mapping)


def _index_keys(
    call: IndexTopkCall, block: torch.Tensor, offset: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """float32 ``[n, p, D]`` keys at ``(block [n, p], offset [p])`` (both in range)."""
    cache = call.index_cache
    if call.key_dtype != formats.E4M3:
        return cache[block, offset].to(torch.float32)
    values, scales = formats.index_cache_blocks(cache, head_dim)
    keys = values.view(torch.uint8)[block, offset].view(formats.E4M3).to(torch.float32)
    return keys * scales[block, offset][..., None]


def index_topk(call: IndexTopkCall) -> None:
    """The indexer's top-k request-local positions per query row (see :class:`IndexTopkCall`).

    Scores the ``max_keys`` positions of each row in float32; a position at or past
    ``row_keys[t]``, past the block table, or whose block id is outside the cache scores
    ``-inf`` and is never selected. Writes ``min(topk, max_keys)`` positions in descending score
    order (``-1`` where the score is ``-inf``), then ``-1`` up to ``topk`` columns."""
    q, indices = call.q, call.indices
    rows, heads, head_dim = q.shape
    max_keys, topk = call.max_keys, call.topk
    count = min(topk, max_keys)
    if rows == 0 or topk == 0:
        return
    if count < topk:
        indices[:rows, count:].fill_(-1)
    if count == 0:
        return
    cache_blocks, block_size = call.index_cache.shape[:2]
    table = call.block_table
    if table.numel() == 0 or cache_blocks == 0:
        indices[:rows, :count].fill_(-1)
        return
    table_tokens = table.shape[1] * block_size
    device = q.device
    # Rows per chunk: their [max_keys] float32 scores and the top-k working copy; positions per
    # chunk: each (row, position) gathers a key and its [H] logits (and their ReLU).
    row_step = _chunk(rows, 2 * _F32 * max_keys)
    for lo in range(0, rows, row_step):
        hi = min(lo + row_step, rows)
        request = torch.clamp(call.row_request[lo:hi].to(torch.int64), 0, table.shape[0] - 1)[:, None]
        visible = call.row_keys[lo:hi].to(torch.int64)[:, None]
        qf = q[lo:hi].to(torch.float32)
        weights = call.weights[lo:hi].to(torch.float32)
        scores = torch.empty(hi - lo, max_keys, dtype=torch.float32, device=device)
        pos_step = _chunk(max_keys, (hi - lo) * _F32 * (2 * head_dim + 2 * heads))
        for p0 in range(0, max_keys, pos_step):
            p1 = min(p0 + pos_step, max_keys)
            pos = torch.arange(p0, p1, device=device)
            column = torch.clamp(pos // block_size, max=table.shape[1] - 1)
            block = table[request, column[None, :]].to(torch.int64)
            valid = (
                (pos[None, :] < visible)
                & (pos[None, :] < table_tokens)
                & (block >= 0)
                & (block < cache_blocks)
            )
            block = torch.clamp(block, 0, cache_blocks - 1)
            keys = _index_keys(call, block, (pos % block_size)[None, :], head_dim)
            keys = torch.where(valid[..., None], keys, 0.0)
            logits = torch.relu(torch.einsum("nhd,npd->nhp", qf, keys) * call.softmax_scale)
            score = torch.einsum("nh,nhp->np", weights, logits)
            scores[:, p0:p1] = torch.where(valid, score, float("-inf"))
        top, position = torch.topk(scores, count, dim=-1, largest=True, sorted=True)
        position = torch.where(top == float("-inf"), -1, position)
        indices[lo:hi, :count].copy_(position)


__all__ = ["CHUNK_BYTES", "index_topk", "sparse_attention", "write_index_keys"]
