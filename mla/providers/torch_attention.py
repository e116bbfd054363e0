"""The torch reference provider's attention math: masked softmax statistics, and the decode
contracts (paged MQA decode, with or without a split-KV schedule, and small-head decode).

The rules of :mod:`mla.providers.torch_ref` hold here: exact (float32 accumulation), no host
sync, no data-dependent shape (every shape comes from the call's static bounds:
``max_seqlen_k``, the token count, the schedule's size), so a decode can be captured in a CUDA
graph. Masked positions still gather a row (the clamped index's); those rows are zeroed before
any product, so no value a row may not see reaches it, not even as ``0 * NaN``.

The cost follows the batch: one pass over the query tokens and the ``max_seqlen_k`` keys a token
may see, on both paths. A planned schedule (:class:`~mla.providers.split_kv.SplitKVSchedule`)
is emulated by its *coverage*: each key of a request counts as many times as the schedule's
work items of that request cover it. LSE-merging the items' partial softmaxes, as the kernels
do, is the same softmax with each key weighted by that count, so a correct schedule (every key
once) gives the plain result, a key no item covers is left out and a key two items cover
counts twice, as on the kernels. The part of an item's range outside its request counts for
nothing here (a kernel would read another request's keys there; a correct planner makes no
such item).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla.core.errors import PlanMismatchError
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.split_kv import SplitKVSchedule

CHUNK_ELEMENTS = 1 << 24
"""Upper bound on gathered elements per vectorized chunk (bounds host/device memory)."""


def dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` in float32, times the per-tensor ``scale`` of an fp8 tensor (``None``: none)."""
    out = x.to(torch.float32)
    return out if scale is None else out * scale


def softmax_stats(
    scores: torch.Tensor, masked: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim: the probabilities and the LSE.

    ``masked`` (broadcast like ``scores``) marks the keys left out. Rows without a key give zero
    probabilities and ``lse = -inf``; a NaN score among the keys gives NaN, as in the reference
    math. ``weights`` (broadcast likewise) counts key ``k`` ``weights[..., k]`` times (a
    schedule's coverage); ``None`` counts each once. ``scores`` is overwritten.
    """
    scores = scores.masked_fill_(masked, float("-inf"))
    # The largest score, or 0 where it is not finite (no key: -inf; exp then gives 0 or NaN).
    shift = torch.nan_to_num(scores.amax(dim=-1, keepdim=True), nan=0.0, posinf=0.0, neginf=0.0)
    probs = scores.sub_(shift).exp_()
    if weights is not None:
        probs = probs.mul_(weights)
    denom = probs.sum(dim=-1)
    lse = denom.log() + shift.squeeze(-1)  # log(0) = -inf: a row without a key
    probs = probs.div_(denom.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return probs, lse


def row_chunks(rows: int, per_row: int) -> range:
    """Row ranges of at most :data:`CHUNK_ELEMENTS` elements, ``per_row`` each."""
    step = max(1, CHUNK_ELEMENTS // max(1, per_row))
    return range(0, rows, step)


def token_requests(indptr: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens ``0..num_tokens-1``: their request (int64, clamped to the last one) and whether
    one owns them (a token at or past ``indptr[-1]``: graph padding)."""
    num_requests = indptr.numel() - 1
    # The requests whose rows end at or before token t, counted as the ends below t + 1.
    ends = torch.arange(1, num_tokens + 1, device=indptr.device, dtype=indptr.dtype)
    req = torch.searchsorted(indptr[1:], ends)
    owned = req < num_requests
    return req.clamp_(max=max(num_requests - 1, 0)), owned


class KeyRows(NamedTuple):
    """Where the keys of the rows of one :func:`latent_attention` call are in the cache: key
    ``j`` of row ``n`` is ``ids[starts[n] + j]`` (flat per-token ids: ``table`` is ``None``), or
    ``table[rows[n], j // page_size] * page_size + j % page_size`` (a block table)."""

    ids: torch.Tensor | None
    starts: torch.Tensor | None
    table: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    page_size: int = 1

    @classmethod
    def flat(cls, ids: torch.Tensor, starts: torch.Tensor) -> KeyRows:
        return cls(ids, starts)

    @classmethod
    def paged(cls, table: torch.Tensor, rows: torch.Tensor, page_size: int) -> KeyRows:
        return cls(None, None, table, rows, page_size)

    def cache_rows(
        self, lo: int, hi: int, offsets: torch.Tensor, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``lo..hi``'s cache row ids ``[hi - lo, len(offsets)]`` (int64, clamped into the
        cache) and which of them are outside the cache (a masked key, never clamped into use)."""
        last_row = num_rows - 1
        if self.table is None:
            assert self.ids is not None
            assert self.starts is not None
            pos = (self.starts[lo:hi, None] + offsets).clamp_(0, max(self.ids.numel() - 1, 0))
            tok = self.ids.index_select(0, pos.view(-1)).view(hi - lo, -1).to(torch.int64)
            row_ids = tok.clamp(0, last_row)
            return row_ids, row_ids != tok
        assert self.rows is not None
        ps, table = self.page_size, self.table
        page = (offsets // ps).clamp_(max=max(table.shape[1] - 1, 0))
        blocks = table.index_select(0, self.rows[lo:hi].to(torch.int64)).index_select(1, page)
        blocks = blocks.to(torch.int64)
        outside = (blocks < 0) | (blocks >= num_rows // ps)
        row_ids = torch.where(outside, 0, blocks * ps + offsets % ps)
        return row_ids, outside


def latent_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    keys: KeyRows,
    lengths: torch.Tensor,
    *,
    max_len: int,
    value_dim: int,
    scale: float,
    kv_scale: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row ``n`` of q ``[N, H, D]`` attends its keys ``j < lengths[n]`` (``j < max_len``),
    found in the cache by ``keys``; values are the first ``value_dim`` lanes. ``weights``
    ``[N, max_len]`` counts key ``j`` of row ``n`` that many times (0: left out). A key outside
    the cache (a block past it or negative, the fill's ``-1`` mark) reads nothing and counts
    for nothing. Returns float32 o ``[N, H, value_dim]``, lse ``[N, H]``."""
    n_rows, heads, dim = q.shape
    no_table = keys.table is not None and keys.table.shape[1] == 0
    if n_rows == 0 or max_len == 0 or kv_cache.shape[0] == 0 or no_table:  # no key in the cache
        return (
            q.new_zeros(n_rows, heads, value_dim, dtype=torch.float32),
            q.new_full((n_rows, heads), float("-inf"), dtype=torch.float32),
        )
    offsets = torch.arange(max_len, device=q.device)
    outs, lses = [], []
    step = row_chunks(n_rows, max_len * dim).step
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        row_ids, outside = keys.cache_rows(lo, hi, offsets, kv_cache.shape[0])
        # Keys left out: ids outside the cache, past the row's length, none of the schedule's.
        masked = outside | (offsets >= lengths[lo:hi, None])
        if weights is not None:
            masked |= weights[lo:hi] == 0
        rows = dequant(kv_cache.index_select(0, row_ids.view(-1)).view(hi - lo, max_len, dim), kv_scale)
        rows = torch.where(masked[..., None], 0.0, rows)  # a left-out key's row reads as 0
        scores = torch.matmul(q[lo:hi].to(torch.float32), rows.transpose(1, 2)).mul_(scale)
        probs, row_lse = softmax_stats(
            scores, masked[:, None, :], None if weights is None else weights[lo:hi, None, :]
        )
        outs.append(torch.matmul(probs, rows[..., :value_dim]))
        lses.append(row_lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def schedule_coverage(
    schedule: SplitKVSchedule, kv_indptr: torch.Tensor, *, batch: int, max_len: int
) -> torch.Tensor:
    """How many of the schedule's live work items cover each key position: float32
    ``[batch, max_len]`` (request, position within the request). Every item of ``work_info`` is
    read (``max_work``, the schedule's size: requests plus compute units); an item's range is
    clipped to ``[0, max_len]`` of its request. Sync-free: marks +1 at an item's start and -1 at
    its end in a ``[batch + 1, max_len + 1]`` table (row ``batch`` takes the idle items and
    those of requests past ``batch``), then a running sum along each request."""
    info = schedule.work_info.to(torch.int64)
    row = torch.remainder(info[:, 0].clamp(-1, batch), batch + 1)
    # (start, end) within the request, clipped to [0, max_len]; an end before its start: empty.
    span = (info[:, 1:3] - kv_indptr.index_select(0, row)[:, None]).clamp_(0, max_len).cummax(dim=1).values
    width = max_len + 1
    signs = torch.ones_like(span, dtype=torch.float32)
    signs[:, 1] = -1.0
    marks = torch.zeros((batch + 1) * width, dtype=torch.float32, device=info.device)
    marks.scatter_add_(0, span.add_((row * width)[:, None]).view(-1), signs.view(-1))
    return marks.view(batch + 1, width).cumsum(dim=1)[:batch, :max_len]


def paged_decode(call: PagedDecodeCall) -> None:
    """The ``paged-decode`` contract: right-aligned causal rows (row ``i`` of a request with
    ``q`` rows and ``s`` keys sees keys ``0 .. s - q + i``); with ``call.schedule`` (a
    :class:`~mla.providers.split_kv.SplitKVSchedule`) each key counts by the schedule's
    coverage (module docstring). Tokens past ``qo_indptr[B]`` (graph padding) get ``o = 0``,
    ``lse = -inf``."""
    schedule = call.schedule
    if schedule is not None and not isinstance(schedule, SplitKVSchedule):
        raise PlanMismatchError(f"the torch provider takes a SplitKVSchedule, got {type(schedule).__name__}")
    q, qo_indptr, kv_indptr = call.q, call.qo_indptr, call.kv_indptr
    num_tokens = q.shape[0]
    if qo_indptr.numel() < 2:  # no request: every token is graph padding
        call.out.zero_()
        if call.lse is not None:
            call.lse.fill_(float("-inf"))
        return
    req, owned = token_requests(qo_indptr, num_tokens)
    after = req + 1
    kv_start = kv_indptr.index_select(0, req)
    # Token t, row t - q_start of its request, sees kv_len - qlen + row + 1 keys:
    # kv_end - kv_start - q_end + t + 1, at most kv_len since t < q_end; 0 for graph padding.
    visible = kv_indptr.index_select(0, after) - kv_start - qo_indptr.index_select(0, after)
    visible = visible.add_(torch.arange(1, num_tokens + 1, device=q.device)).clamp_(min=0).mul_(owned)
    weights = None
    if schedule is not None:
        batch = kv_indptr.numel() - 1
        coverage = schedule_coverage(schedule, kv_indptr, batch=batch, max_len=call.max_seqlen_k)
        weights = coverage.index_select(0, req)
    if call.block_table is not None:
        keys = KeyRows.paged(call.block_table, req, call.page_size)
    else:
        assert call.kv_indices is not None, "paged decode: neither kv_indices nor block_table"
        keys = KeyRows.flat(call.kv_indices, kv_start)
    o, lse = latent_attention(
        q,
        call.kv_cache,
        keys,
        visible,
        max_len=call.max_seqlen_k,
        value_dim=call.out.shape[-1],
        scale=call.softmax_scale,
        kv_scale=call.kv_scale,
        weights=weights,
    )
    call.out.copy_(o)
    if call.lse is not None:
        call.lse.copy_(lse)


def small_head_decode(call: SmallHeadDecodeCall) -> None:
    """The ``small-head-decode`` contract: row ``t`` of q attends its ``seq_info[t+1] -
    seq_info[t]`` keys, from ``page_table[seq_info[t]:]`` or its block-table row."""
    q = torch.cat([call.q_nope, call.q_pe], dim=-1)
    rows = q.shape[0]
    starts = call.seq_info[:rows]
    if call.block_table is not None:
        table_rows = call.row_request
        if table_rows is None:
            table_rows = torch.arange(rows, device=q.device)
        keys = KeyRows.paged(call.block_table, table_rows[:rows], call.page_size)
    else:
        assert call.page_table is not None, "small-head decode: neither page_table nor block_table"
        keys = KeyRows.flat(call.page_table, starts)
    o, lse = latent_attention(
        q,
        call.kv_cache,
        keys,
        call.seq_info[1 : rows + 1] - starts,
        max_len=call.max_seqlen_k,
        value_dim=call.out.shape[-1],
        scale=call.softmax_scale,
        kv_scale=call.kv_scale,
    )
    call.out.copy_(o)
    if call.lse is not None:
        call.lse.copy_(lse)


__all__ = [
    "CHUNK_ELEMENTS",
    "KeyRows",
    "dequant",
    "latent_attention",
    "paged_decode",
    "row_chunks",
    "schedule_coverage",
    "small_head_decode",
    "softmax_stats",
    "token_requests",
]
