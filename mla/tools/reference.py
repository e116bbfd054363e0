"""The reference math of MLA, written for clarity: per-request loops in float64.

For request ``b`` with query length ``q_b`` and KV length ``s_b`` (including the new tokens),
query row ``i`` attends keys ``0 .. s_b - q_b + i`` (right-aligned causal);
``o = softmax(q·k * scale) @ v`` and ``lse = log(sum(exp(q·k * scale)))`` (natural log). A row
with no keys gives ``o = 0`` and ``lse = -inf``; states merge as
``lse* = logaddexp(lse_a, lse_b)``, ``o = e^(lse_a-lse*) o_a + e^(lse_b-lse*) o_b``.

Sparse MLA (DeepSeek Sparse Attention) uses the same attention over only the tokens the
indexer selected: row ``t`` sees the request-local positions ``topk_indices[t]`` (``-1`` pads)
that its causal window allows. The indexer scores position ``p`` for row ``t`` as
``sum_h w[t, h] * relu(scale * q_idx[t, h] . k_idx[p])`` and keeps the highest ``topk``.

Used by the conformance kit (:mod:`mla.testing`), the tests and ``mla demo`` to check every
strategy. Slow; never used to serve.
"""

from __future__ import annotations

import torch

from mla.core.config import is_ds_mla, is_fp8
from mla.providers.formats import read_index_keys, unpack_ds_mla


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[M, H, D]``, k ``[N, H|1, D]``, v ``[N, H|1, Dv]``, visible ``[M, N]`` bool (float64).

    Row ``m`` is ``sum over visible n of p[m, n] * v[n]``: a value row ``m`` does not see never
    reaches it (not even as ``0 * NaN``); one it sees that is not finite makes it NaN."""
    heads = q.shape[1]
    scores = torch.einsum("mhd,nhd->hmn", q, k.expand(-1, heads, -1)) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, M]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    probs = torch.where(torch.isfinite(lse)[..., None], probs, 0.0)
    values = v.expand(-1, heads, -1)
    finite = torch.isfinite(values)
    out = torch.einsum("hmn,nhv->mhv", probs, torch.where(finite, values, 0.0))
    sees_bad = torch.einsum("mn,nh->mh", visible.to(out.dtype), (~finite).any(-1).to(out.dtype)) > 0
    out = torch.where(sees_bad[..., None], torch.full_like(out, float("nan")), out)
    return out, lse.transpose(0, 1)


def causal_visible(num_q: int, num_k: int, *, causal: bool = True) -> torch.Tensor:
    """Right-aligned causal mask ``[num_q, num_k]``: row ``i`` sees keys ``<= num_k - num_q + i``."""
    rows = torch.arange(num_q)[:, None]
    keys = torch.arange(num_k)[None, :]
    if not causal:
        return torch.ones(num_q, num_k, dtype=torch.bool)
    return keys <= rows + (num_k - num_q)


def reference_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode. Returns float64 ``out [T, H, L]`` and ``lse [T, H]``.

    Rows not owned by a request, and rows with no visible key, give ``o = 0``, ``lse = -inf``.
    """
    qsl = torch.arange(seq_lens.numel() + 1) if query_start_loc is None else query_start_loc
    return _paged_attention(
        q, kv_cache, block_table, seq_lens, qsl, None, softmax_scale, kv_lora_rank, kv_scale
    )


def reference_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen MHA prefill, bottom-right causal. Returns float64 ``out [T, H, Dv]``, ``lse``."""
    cu_q = cu_seqlens_q.cpu().to(torch.int64)
    cu_k = cu_seqlens_k.cpu().to(torch.int64)
    qd, kd, vd = (x.cpu().to(torch.float64) for x in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        visible = causal_visible(q1 - q0, k1 - k0, causal=causal)
        out[q0:q1], lse[q0:q1] = _attend(qd[q0:q1], kd[k0:k1], vd[k0:k1], visible, softmax_scale)
    return out, lse


def merge_reference(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state merge (``logaddexp`` of the LSEs, outputs weighted by ``e^(lse - lse*)``) in
    float64."""
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    w_a = torch.where(torch.isfinite(lse), torch.exp(lse_a.double() - safe), 0.0)
    w_b = torch.where(torch.isfinite(lse), torch.exp(lse_b.double() - safe), 0.0)
    return o_a.double() * w_a[..., None] + o_b.double() * w_b[..., None], lse


def dequantized_cache(
    kv_cache: torch.Tensor, *, kv_lora_rank: int, rope_dim: int, kv_scale: float | None = None
) -> torch.Tensor:
    """float64 ``[blocks, block_size, L+R]`` values of a latent cache in any format (bf16/fp16/
    fp32, per-tensor fp8 times ``kv_scale``, ``fp8_ds_mla`` bytes)."""
    blocks, block_size = kv_cache.shape[:2]
    if is_ds_mla(kv_cache.dtype):
        rows = unpack_ds_mla(kv_cache.reshape(blocks * block_size, -1).cpu(), kv_lora_rank, rope_dim)
        return rows.to(torch.float64).view(blocks, block_size, kv_lora_rank + rope_dim)
    cache = kv_cache.cpu().to(torch.float64)
    if is_fp8(kv_cache.dtype):
        cache = cache * (1.0 if kv_scale is None else kv_scale)
    return cache


def reference_sparse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed MLA. Returns float64 ``out [T, H, L]`` and ``lse [T, H]``.

    Row ``i`` of request ``b`` (``q_b`` rows, ``s_b`` keys) attends the positions in
    ``topk_indices[t]`` (request-local, ``-1`` pads) that are ``<= s_b - q_b + i``; rows not
    owned by a request, or left with no position, give ``o = 0`` and ``lse = -inf``.
    """
    return _paged_attention(
        q, kv_cache, block_table, seq_lens, query_start_loc, topk_indices, softmax_scale,
        kv_lora_rank, kv_scale,
    )  # fmt: skip


def _paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk_indices: torch.Tensor | None,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of each request's rows over its paged keys (right-aligned causal),
    restricted to ``topk_indices`` when given (the dense decode is the sparse one with every
    position selected)."""
    num_tokens, heads, width = q.shape
    block_size = kv_cache.shape[1]
    cache = dequantized_cache(
        kv_cache, kv_lora_rank=kv_lora_rank, rope_dim=width - kv_lora_rank, kv_scale=kv_scale
    )
    qsl = query_start_loc.cpu().to(torch.int64)
    lens = seq_lens.cpu().to(torch.int64)
    table = block_table.cpu().to(torch.int64)
    indices = None if topk_indices is None else topk_indices.cpu().to(torch.int64)
    out = torch.zeros(num_tokens, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((num_tokens, heads), float("-inf"), dtype=torch.float64)
    qd = q.cpu().to(torch.float64)
    for b in range(lens.numel()):
        q0, q1, s = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        if q1 == q0 or s == 0:
            continue
        visible = causal_visible(q1 - q0, s)
        if indices is not None:
            visible = visible & selected_mask(indices[q0:q1], s)
        pos = torch.nonzero(visible.any(0))[:, 0]  # the positions some row attends
        visible = visible[:, pos]
        rows = cache[table[b, pos // block_size], pos % block_size]  # [n, L+R]
        o, row_lse = _attend(
            qd[q0:q1], rows[:, None, :], rows[:, None, :kv_lora_rank], visible, softmax_scale
        )
        out[q0:q1], lse[q0:q1] = o, row_lse
    return out, lse


def selected_mask(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool ``[M, num_keys]``: position ``p`` is in row ``m``'s ``indices`` (``-1`` and positions
    past ``num_keys`` ignored)."""
    rows = indices.shape[0]
    mask = torch.zeros(rows, num_keys + 1, dtype=torch.bool)
    target = torch.where((indices >= 0) & (indices < num_keys), indices, num_keys)
    mask.scatter_(1, target, True)
    return mask[:, :num_keys]


def reference_index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    key_dtype: torch.dtype,
    softmax_scale: float,
) -> list[torch.Tensor]:
    """The indexer's float64 scores per request: ``[q_b, s_b]`` with ``-inf`` at positions a
    row may not see (right-aligned causal). ``q [T, Hi, D]``, ``weights [T, Hi]``."""
    head_dim = q.shape[-1]
    block_size = index_cache.shape[1]
    qsl = query_start_loc.cpu().to(torch.int64)
    lens = seq_lens.cpu().to(torch.int64)
    table = block_table.cpu().to(torch.int64)
    qd, wd = q.cpu().to(torch.float64), weights.cpu().to(torch.float64)
    scores: list[torch.Tensor] = []
    for b in range(lens.numel()):
        q0, q1, s = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        pos = torch.arange(s)
        slots = table[b, pos // block_size] * block_size + pos % block_size
        keys = read_index_keys(index_cache.cpu(), key_dtype, slots, head_dim).to(torch.float64)
        logits = torch.relu(torch.einsum("mhd,nd->mhn", qd[q0:q1], keys) * softmax_scale)
        score = torch.einsum("mh,mhn->mn", wd[q0:q1], logits)
        scores.append(score.masked_fill(~causal_visible(q1 - q0, s), float("-inf")))
    return scores


def reference_topk(scores: list[torch.Tensor], topk: int) -> torch.Tensor:
    """int64 ``[T, topk]`` request-local positions of the highest scores per row (descending),
    ``-1`` past the row's visible positions; rows concatenated over requests."""
    rows: list[torch.Tensor] = []
    for score in scores:
        out = torch.full((score.shape[0], topk), -1, dtype=torch.int64)
        for m in range(score.shape[0]):
            visible = int(torch.isfinite(score[m]).sum())
            count = min(topk, visible)
            if count:
                out[m, :count] = torch.topk(score[m], count).indices
        rows.append(out)
    return torch.cat(rows) if rows else torch.empty(0, topk, dtype=torch.int64)
