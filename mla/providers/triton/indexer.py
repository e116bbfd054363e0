# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Triton kernels of the lightning indexer (contract ``indexer``): scores and top-k.

Scores (:func:`index_scores`)
    ``scores[t, p] = sum_h w[t, h] · relu(softmax_scale · q[t, h] · key(p))`` into a float32
    ``[T, max_keys]`` workspace. A program owns one row ``t`` and one chunk of its positions and
    keeps the row's queries stationary: ``q[t]`` (all index heads, ``[D, BLOCK_H]``) is loaded
    once, then the chunk's keys stream through in tiles of ``BLOCK_P`` positions (read through
    the block table; fp8 keys widened in registers). Each tile is one ``tl.dot`` with positions
    as the M dimension and heads as N (``[BLOCK_P, D] · [D, BLOCK_H]``), so the reduction over
    heads runs along the accumulator's rows, mostly inside each thread. Since the key scale and
    ``softmax_scale`` are positive, ``relu(s · x) = s · relu(x)``: the softmax scale is folded
    into the weights once and the key's scale multiplies the reduced score once per position.
    Rows run longest first (the last row of a causal prefill sees the most positions); a decode
    of few rows over a long context cuts each row's positions into chunks so that the programs
    fill the device.

    Positions a row may not see (``p >= row_keys[t]``), and positions whose block id is outside
    the cache or past the block table, score ``-inf``; a request id outside the block table is
    clamped into it (memory safety, as the torch provider does).

Top-k (:func:`index_topk`)
    The scores of a chunk of rows (workspace bounded by :data:`INDEX_WORKSPACE_BYTES`), then a
    sorted ``torch.topk`` on the device; ``-inf`` positions become ``-1``.

Both launchers are graph-capturable: grids and workspaces are sized by shapes and Python ints.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.calls import IndexTopkCall
from mla.providers.formats import E4M3
from mla.providers.triton.decode import _dot_dtype, num_sms
from mla.providers.triton.launch_cache import LaunchCache

BLOCK_P = 64
"""Positions per tile of the scores kernel (the dot's M dimension). 64-position tiles on 4 warps,
two stages deep, were the fastest of a sweep of 64/128/256 positions, 4/8 warps and 2/3 stages
on the H200 (fp8 keys, 64 index heads: 8192-token prefill 1865 µs against 2081 for 128 on 8
warps; 64 decode rows over 32768 positions 146 against 163)."""
MIN_CHUNK = 1024
"""Fewest positions a program of the scores kernel is given when a row's positions are split."""
PROGRAMS_PER_SM = 4
"""Programs per SM the position split fills, at most (a few resident programs hide the key
loads; a split that leaves a partial wave of programs measured slower)."""
MAX_BLOCK_H = 128
"""Widest head block held stationary; more index heads run as several head blocks per tile."""


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    block_table_ptr,
    row_request_ptr,
    row_keys_ptr,
    scores_ptr,
    rows,
    Hi,
    max_keys,
    chunk,
    last_request,
    max_blocks,
    num_blocks,
    stride_q_t,
    stride_q_h,
    stride_w_t,
    stride_w_h,
    stride_bt,
    stride_c_blk,
    stride_c_tok,
    stride_sc_t,
    softmax_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Program (row, chunk of positions): ``scores[t, p]`` for the chunk's positions."""
    t = (rows - 1 - tl.program_id(0)).to(tl.int64)
    lo = tl.program_id(1) * chunk
    end = tl.minimum(lo + chunk, max_keys)
    row_keys = tl.load(row_keys_ptr + t)
    hi = tl.maximum(tl.minimum(end, row_keys), lo)
    out_row = scores_ptr + t * stride_sc_t
    offs_p = tl.arange(0, BLOCK_P)
    req = tl.minimum(tl.maximum(tl.load(row_request_ptr + t), 0), last_request).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_ok = offs_d < D

    if HEAD_BLOCKS == 1:
        h_ok = offs_h < Hi
        q_t = tl.load(
            q_ptr + t * stride_q_t + offs_h[None, :] * stride_q_h + offs_d[:, None],
            mask=d_ok[:, None] & h_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w = tl.load(w_ptr + t * stride_w_t + offs_h * stride_w_h, mask=h_ok, other=0.0) * softmax_scale

    for p0 in range(lo, hi, BLOCK_P):
        p = p0 + offs_p
        p_ok = (p < hi) & (p // BLOCK_SIZE < max_blocks)
        block = tl.load(block_table_ptr + req * stride_bt + p // BLOCK_SIZE, mask=p_ok, other=-1).to(tl.int64)
        key_ok = p_ok & (block >= 0) & (block < num_blocks)
        block = tl.where(key_ok, block, 0)
        offset = p % BLOCK_SIZE
        k_mask = key_ok[:, None] & d_ok[None, :]
        if FP8:
            base = cache_ptr + block * (BLOCK_SIZE * (D + 4))
            keys = tl.load(base[:, None] + offset[:, None] * D + offs_d[None, :], mask=k_mask, other=0)
            keys = keys.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
            key_scale = tl.load(
                (base + BLOCK_SIZE * D + offset * 4).to(tl.pointer_type(tl.float32)), mask=key_ok, other=0.0
            )
        else:
            k_ptrs = cache_ptr + (block * stride_c_blk + offset * stride_c_tok)[:, None] + offs_d[None, :]
            keys = tl.load(k_ptrs, mask=k_mask, other=0.0).to(DOT_DTYPE)
            key_scale = tl.full([BLOCK_P], 1.0, tl.float32)
        if HEAD_BLOCKS == 1:
            logits = tl.dot(keys, q_t, input_precision=INPUT_PRECISION)
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1)
        else:
            score = tl.zeros([BLOCK_P], tl.float32)
            for hb in range(HEAD_BLOCKS):
                h = hb * BLOCK_H + offs_h
                h_ok = h < Hi
                q_blk = tl.load(
                    q_ptr + t * stride_q_t + h[None, :] * stride_q_h + offs_d[:, None],
                    mask=d_ok[:, None] & h_ok[None, :],
                    other=0.0,
                ).to(DOT_DTYPE)
                w_blk = tl.load(w_ptr + t * stride_w_t + h * stride_w_h, mask=h_ok, other=0.0) * softmax_scale
                logits = tl.dot(keys, q_blk, input_precision=INPUT_PRECISION)
                score += tl.sum(tl.maximum(logits, 0.0) * w_blk[None, :], 1)
        score = tl.where(key_ok, score * key_scale, float("-inf"))
        tl.store(out_row + p, score, mask=p < end)

    # Positions of the chunk past the row's last visible one (the loop above covered whole tiles
    # from ``lo``).
    tail = lo + tl.cdiv(hi - lo, BLOCK_P) * BLOCK_P
    for p0 in range(tail, end, BLOCK_P):
        p = p0 + offs_p
        tl.store(out_row + p, tl.full([BLOCK_P], float("-inf"), tl.float32), mask=p < end)


INDEX_SCORES_LAUNCH = LaunchCache(_index_scores_kernel)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def position_chunk(*, rows: int, max_keys: int, num_sms: int) -> int:
    """Positions per program of the scores kernel: all of a row's (``max_keys``, rounded up to
    whole tiles) when the rows alone give :data:`PROGRAMS_PER_SM` programs per SM or more,
    otherwise the row cut into as many chunks (of at least :data:`MIN_CHUNK` positions) as keep
    the programs within that many per SM."""
    whole = _round_up(max(1, max_keys), BLOCK_P)
    target = PROGRAMS_PER_SM * num_sms
    if rows >= target:
        return whole
    splits = max(1, min(target // max(1, rows), -(-whole // MIN_CHUNK)))
    return _round_up(-(-whole // splits), BLOCK_P)


def index_scores(
    call: IndexTopkCall,
    scores: torch.Tensor,
    *,
    chunk: int | None = None,
) -> None:
    """Fill ``scores`` (float32 ``[T, max_keys]``, last dim contiguous) with the indexer's scores
    of ``call`` (``-inf`` where a row may not see the position). ``chunk`` overrides
    :func:`position_chunk` (a multiple of :data:`BLOCK_P`; tests)."""
    q, weights, cache, table = call.q, call.weights, call.index_cache, call.block_table
    rows, index_heads, head_dim = q.shape
    if rows == 0 or call.max_keys == 0:
        return
    fp8 = call.key_dtype == E4M3
    if fp8 and not cache.is_contiguous():
        raise InvalidInputError("index_cache", "an fp8 index-key cache must be contiguous (its block layout)")
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or table.stride(-1) != 1 or scores.stride(-1) != 1:
        raise InvalidInputError("q", "q, index_cache, block_table and scores need a contiguous last dim")
    if chunk is None:
        chunk = position_chunk(rows=rows, max_keys=call.max_keys, num_sms=num_sms(q.device))
    elif chunk <= 0 or chunk % BLOCK_P:
        raise InvalidInputError("chunk", f"must be a positive multiple of {BLOCK_P}, got {chunk}")
    dot_dtype, precision = _dot_dtype(q.dtype, call.key_dtype)
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(index_heads)))
    INDEX_SCORES_LAUNCH.launch(
        (rows, triton.cdiv(call.max_keys, chunk)),
        q,
        weights,
        cache,
        table,
        call.row_request,
        call.row_keys,
        scores,
        rows,
        index_heads,
        call.max_keys,
        chunk,
        max(table.shape[0] - 1, 0),
        table.shape[1] if table.shape[0] else 0,  # an empty table: no position is in range
        cache.shape[0],
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        weights.stride(1),
        table.stride(0),
        cache.stride(0),
        cache.stride(1),
        scores.stride(0),
        call.softmax_scale,
        D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=block_h,
        HEAD_BLOCKS=triton.cdiv(index_heads, block_h),
        BLOCK_P=BLOCK_P,
        BLOCK_SIZE=cache.shape[1],
        FP8=fp8,
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        num_warps=8 if block_h > 64 else 4,  # 4 for 64 index heads
        num_stages=2,
    )


INDEX_WORKSPACE_BYTES = 256 << 20
"""Bound on the float32 score workspace of one :func:`index_topk` chunk of rows (a prefill of
8192 rows over 128K positions would need 4 GB at once)."""


def index_topk(call: IndexTopkCall) -> None:
    """The indexer's scores (:func:`index_scores` into a float32 ``[rows, max_keys]`` workspace
    per chunk of rows, at most :data:`INDEX_WORKSPACE_BYTES`) and a sorted ``torch.topk`` on the
    device; positions scored ``-inf`` (not visible) become ``-1``, as do the columns past
    ``max_keys``."""
    indices = call.indices
    rows, topk = indices.shape
    if rows == 0 or topk == 0:
        return
    count = min(topk, call.max_keys)
    if count < topk:
        indices[:, count:].fill_(-1)
    if count == 0:
        return
    step = max(1, min(rows, INDEX_WORKSPACE_BYTES // (4 * call.max_keys)))
    scores = torch.empty(step, call.max_keys, dtype=torch.float32, device=indices.device)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        chunk = (
            call
            if (lo, hi) == (0, rows)
            else attrs.evolve(
                call,
                q=call.q[lo:hi],
                weights=call.weights[lo:hi],
                row_request=call.row_request[lo:hi],
                row_keys=call.row_keys[lo:hi],
                indices=indices[lo:hi],
            )
        )
        index_scores(chunk, scores[: hi - lo])
        values, positions = torch.topk(scores[: hi - lo], count, dim=1, largest=True, sorted=True)
        indices[lo:hi, :count].copy_(torch.where(values == float("-inf"), -1, positions))


__all__ = ["BLOCK_P", "INDEX_WORKSPACE_BYTES", "index_scores", "index_topk", "position_chunk"]
