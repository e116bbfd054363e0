# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Triton kernels of the lightning indexer (contract ``indexer``): scores and top-k.

Scores (:func:`index_scores`)
    ``scores[t, p] = sum_h w[t, h] · relu(softmax_scale · q[t, h] · key(p))`` into a float32
    ``[T, max_keys]`` workspace. A program owns a group of :attr:`IndexScoresConfig.rows`
    consecutive rows and one chunk of their positions and keeps the group's queries stationary
    (``[D, rows · heads]``, loaded once); the chunk's keys stream through in tiles of
    ``block_p`` positions, each tile one ``tl.dot`` with positions as the M dimension and
    (row, head) as N, so the reduction over heads runs along the accumulator's rows and rows of
    one request share every key tile (a prefill's consecutive rows: the key reads per FLOP fall
    by the group size). A group whose rows belong to several requests runs one pass per run of
    rows of one request. When the tile lies inside one cache block (``block_p`` divides the
    block size) its keys and scales are read as one contiguous block slice after one block-id
    load; otherwise every position looks up its block.

    Dot operands: fp8 keys with **fp8 queries** (``float8_e4m3fn``, DeepSeek-V3.2's indexer
    form: the queries quantized per (row, head) with the scale folded into the weights,
    :func:`mla.providers.formats.quantize_index_queries`) run fp8 dots (wgmma e4m3 on sm_90,
    fp32 accumulate) on the cache bytes as they are; fp8 keys with 16-bit queries widen the keys
    to fp16 in registers; float keys dot in the query's dtype (fp32 under the interpreter for
    bf16). Since the key scale and ``softmax_scale`` are positive, ``relu(s · x) = s ·
    relu(x)``: the softmax scale is folded into the weights once and the key's scale multiplies
    the reduced score once per position. Rows run longest first (the last rows of a causal
    prefill see the most positions); a decode of few rows over a long context cuts each row's
    positions into chunks so that the programs fill the device.

    Positions a row may not see (``p >= row_keys[t]``), and positions whose block id is outside
    the cache or past the block table, score ``-inf``; a request id outside the block table is
    clamped into it (memory safety, as the torch provider does). With ``stats`` the kernel also
    writes each (row, chunk)'s least and greatest finite score, which the top-k's histogram
    pass bins by.

Top-k (:func:`index_topk`)
    The scores of a chunk of rows (workspace bounded by :data:`INDEX_WORKSPACE_BYTES`), then
    :func:`mla.providers.triton.topk.radix_topk` (threshold select, three small launches, no
    ``torch.topk``): each row's ``min(topk, visible)`` best positions **in no score order**
    (ascending positions above the threshold score, then the threshold's share in ascending
    positions), ``-1`` after.

Both launchers are graph-capturable: grids and workspaces are sized by shapes and Python ints.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import triton
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.calls import IndexTopkCall
from mla.providers.formats import E4M3
from mla.providers.triton.decode import _dot_dtype, num_sms
from mla.providers.triton.host_math import round_up
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.pdl import pdl_options, wait_for_previous
from mla.providers.triton.topk import TopkConfig, radix_topk, topk_config

MIN_CHUNK = 1024
"""Fewest positions a program of the scores kernel is given when a row's positions are split."""
PROGRAMS_PER_SM = 4
"""Programs per SM the position split fills, at most (a few resident programs hide the key
loads; a split that leaves a partial wave of programs measured slower)."""
MAX_BLOCK_H = 128
"""Widest head block held stationary; more index heads run as several head blocks per tile."""


@attrs.frozen
class IndexScoresConfig:
    """Tunables of the scores kernel (:func:`index_scores_config` picks them)."""

    block_p: int = 64
    """Positions per tile (the dot's M dimension; a power of two, at least 16)."""
    rows: int = 1
    """Query rows per program sharing each key tile (a power of two; 1 with more than
    :data:`MAX_BLOCK_H` index heads)."""
    num_warps: int = 4
    num_stages: int = 2
    chunk: int | None = None
    """Positions per program (a multiple of ``block_p``); ``None``: :func:`position_chunk`."""


PREFILL_ROWS = 4 * 132
"""Rows from which the fp8 scores launch is the prefill one (:func:`index_scores_config`: two
rows a program share each key tile)."""


def index_scores_config(*, rows: int, fp8_dot: bool) -> IndexScoresConfig:
    """The scores kernel's launch for ``rows`` rows, from sweeps on the H200
    (``docs/performance.md``, "Kernel choices"). 16-bit dots: 64-position tiles on 4 warps, two
    stages deep, one row per program. fp8 dots: for many rows (a prefill) two rows per program,
    three stages; for few rows (a decode) one row per program and five stages: the key stream
    of a few rows is latency-bound, and deeper rings (6-8) measured no better."""
    if not fp8_dot:
        return IndexScoresConfig()
    if rows >= PREFILL_ROWS:
        return IndexScoresConfig(rows=2, num_stages=3)
    return IndexScoresConfig(num_stages=5)


@triton.jit
def _score_segment(
    q_all,
    w_all,
    q_ptr,
    w_ptr,
    cache_ptr,
    block_table_ptr,
    scores_ptr,
    stats_ptr,
    t0,
    chunk_id,
    req,
    seg,
    row_hi,
    lo,
    end,
    Hi,
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
    stride_st_k,
    stride_st_t,
    softmax_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    STATS: tl.constexpr,
):
    """The scores of the rows ``seg`` (a mask over the program's ``ROWS`` rows, all of request
    ``req``) for the chunk's positions ``[lo, end)``: keys of ``req`` stream through once for
    all of them; ``row_hi[r]``: row ``r`` sees positions below it."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, ROWS)
    d_ok = offs_d < D
    seg_hi = tl.max(tl.where(seg, row_hi, lo), 0)
    out_rows = scores_ptr + (t0 + offs_r).to(tl.int64) * stride_sc_t
    # Running elementwise extremes, reduced once after the loop (a reduction per tile stalls the
    # key stream on its cross-warp exchange).
    low = tl.full([BLOCK_P, ROWS], float("inf"), tl.float32)
    high = tl.full([BLOCK_P, ROWS], float("-inf"), tl.float32)
    for p0 in range(lo, seg_hi, BLOCK_P):
        p = p0 + offs_p
        if TILE_IN_BLOCK:
            # The tile lies inside one cache block: one block id, contiguous keys and scales.
            column = p0 // BLOCK_SIZE
            block = tl.load(block_table_ptr + req * stride_bt + column, mask=column < max_blocks, other=-1)
            block = block.to(tl.int64)
            tile_ok = (column < max_blocks) & (block >= 0) & (block < num_blocks)
            block = tl.where(tile_ok, block, 0)
            key_ok = (p < seg_hi) & tile_ok
            offset = p0 % BLOCK_SIZE
            if FP8:
                base = cache_ptr + block * (BLOCK_SIZE * (D + 4))
                keys = tl.load(
                    base + (offset + offs_p)[:, None] * D + offs_d[None, :],
                    mask=tile_ok & d_ok[None, :],
                    other=0,
                )
                scale_ptr = (base + BLOCK_SIZE * D + offset * 4).to(tl.pointer_type(tl.float32))
                key_scale = tl.load(scale_ptr + offs_p, mask=tile_ok, other=0.0)
            else:
                base = cache_ptr + block * stride_c_blk + offset * stride_c_tok
                keys = tl.load(
                    base + offs_p[:, None] * stride_c_tok + offs_d[None, :],
                    mask=tile_ok & d_ok[None, :],
                    other=0.0,
                )
                key_scale = tl.full([BLOCK_P], 1.0, tl.float32)
        else:
            p_ok = (p < seg_hi) & (p // BLOCK_SIZE < max_blocks)
            block = tl.load(block_table_ptr + req * stride_bt + p // BLOCK_SIZE, mask=p_ok, other=-1).to(
                tl.int64
            )
            key_ok = p_ok & (block >= 0) & (block < num_blocks)
            block = tl.where(key_ok, block, 0)
            offset = p % BLOCK_SIZE
            k_mask = key_ok[:, None] & d_ok[None, :]
            if FP8:
                base = cache_ptr + block * (BLOCK_SIZE * (D + 4))
                keys = tl.load(base[:, None] + offset[:, None] * D + offs_d[None, :], mask=k_mask, other=0)
                key_scale = tl.load(
                    (base + BLOCK_SIZE * D + offset * 4).to(tl.pointer_type(tl.float32)),
                    mask=key_ok,
                    other=0.0,
                )
            else:
                k_ptrs = cache_ptr + (block * stride_c_blk + offset * stride_c_tok)[:, None] + offs_d[None, :]
                keys = tl.load(k_ptrs, mask=k_mask, other=0.0)
                key_scale = tl.full([BLOCK_P], 1.0, tl.float32)
        if FP8:
            keys = keys.to(tl.float8e4nv, bitcast=True)
        keys = keys.to(DOT_DTYPE)
        if HEAD_BLOCKS == 1:
            logits = tl.dot(keys, q_all, input_precision=INPUT_PRECISION)
            weighted = tl.maximum(logits, 0.0) * w_all[None, :]
            if ROWS == 1:
                score = tl.sum(weighted, 1)[:, None]
            else:
                score = tl.sum(tl.reshape(weighted, (BLOCK_P, ROWS, BLOCK_H)), 2)
        else:
            # Several head blocks (more than 128 index heads): one row per program.
            acc = tl.zeros([BLOCK_P], tl.float32)
            offs_h = tl.arange(0, BLOCK_H)
            for hb in range(HEAD_BLOCKS):
                h = hb * BLOCK_H + offs_h
                h_ok = h < Hi
                q_blk = tl.load(
                    q_ptr + t0 * stride_q_t + h[None, :] * stride_q_h + offs_d[:, None],
                    mask=d_ok[:, None] & h_ok[None, :],
                    other=0.0,
                ).to(DOT_DTYPE)
                w_blk = (
                    tl.load(w_ptr + t0 * stride_w_t + h * stride_w_h, mask=h_ok, other=0.0) * softmax_scale
                )
                logits = tl.dot(keys, q_blk, input_precision=INPUT_PRECISION)
                acc += tl.sum(tl.maximum(logits, 0.0) * w_blk[None, :], 1)
            score = acc[:, None]
        visible = key_ok[:, None] & (p[:, None] < row_hi[None, :])
        score = tl.where(visible, score * key_scale[:, None], float("-inf"))
        if STATS:
            finite = visible & (tl.abs(score) < float("inf"))
            low = tl.minimum(low, tl.where(finite, score, float("inf")))
            high = tl.maximum(high, tl.where(finite, score, float("-inf")))
        tl.store(out_rows[None, :] + p[:, None], score, mask=seg[None, :] & (p < end)[:, None])
    # Positions of the chunk past the segment's last visible one (the loop above covered whole
    # tiles from ``lo``).
    tail = lo + tl.cdiv(seg_hi - lo, BLOCK_P) * BLOCK_P
    for p0 in range(tail, end, BLOCK_P):
        p = p0 + offs_p
        tl.store(
            out_rows[None, :] + p[:, None],
            tl.full([BLOCK_P, ROWS], float("-inf"), tl.float32),
            mask=seg[None, :] & (p < end)[:, None],
        )
    if STATS:
        stat_rows = stats_ptr + (t0 + offs_r).to(tl.int64) * stride_st_t + chunk_id
        tl.store(stat_rows, tl.min(low, 0), mask=seg)
        tl.store(stat_rows + stride_st_k, tl.max(high, 0), mask=seg)


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    block_table_ptr,
    row_request_ptr,
    row_keys_ptr,
    scores_ptr,
    stats_ptr,
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
    stride_st_k,
    stride_st_t,
    softmax_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    STATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (group of ``ROWS`` rows, chunk of positions): ``scores[t, p]`` for the chunk's
    positions of the group's rows; rows of one request share each key tile."""
    wait_for_previous(PDL)
    groups = tl.cdiv(rows, ROWS)
    t0 = ((groups - 1 - tl.program_id(0)) * ROWS).to(tl.int64)
    chunk_id = tl.program_id(1)
    lo = chunk_id * chunk
    end = tl.minimum(lo + chunk, max_keys)
    offs_r = tl.arange(0, ROWS)
    row_ok = t0 + offs_r < rows
    row_keys = tl.load(row_keys_ptr + t0 + offs_r, mask=row_ok, other=0)
    row_hi = tl.maximum(tl.minimum(end, row_keys), lo)
    requests = tl.minimum(
        tl.maximum(tl.load(row_request_ptr + t0 + offs_r, mask=row_ok, other=0), 0), last_request
    )
    offs_d = tl.arange(0, BLOCK_D)
    tl.arange(0, BLOCK_H)
    d_ok = offs_d < D

    if HEAD_BLOCKS == 1:
        # The group's queries, stationary: ``[D, ROWS * BLOCK_H]`` (row-major over (row, head)).
        col = tl.arange(0, ROWS * BLOCK_H)
        col_r = col // BLOCK_H
        col_h = col % BLOCK_H
        col_ok = (col_h < Hi) & (t0 + col_r < rows)
        q_all = tl.load(
            q_ptr + (t0 + col_r)[None, :] * stride_q_t + col_h[None, :] * stride_q_h + offs_d[:, None],
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_all = (
            tl.load(w_ptr + (t0 + col_r) * stride_w_t + col_h * stride_w_h, mask=col_ok, other=0.0)
            * softmax_scale
        )
    else:
        q_all = tl.zeros([BLOCK_D, BLOCK_H], DOT_DTYPE)
        w_all = tl.zeros([BLOCK_H], tl.float32)

    if ROWS == 1:
        _score_segment(
            q_all, w_all, q_ptr, w_ptr, cache_ptr, block_table_ptr, scores_ptr, stats_ptr, t0, chunk_id,
            tl.max(requests, 0).to(tl.int64), row_ok, row_hi, lo, end, Hi, max_blocks, num_blocks,
            stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_bt, stride_c_blk, stride_c_tok,
            stride_sc_t, stride_st_k, stride_st_t, softmax_scale,
            D, BLOCK_D, BLOCK_H, HEAD_BLOCKS, BLOCK_P, BLOCK_SIZE, ROWS, FP8, DOT_DTYPE, INPUT_PRECISION,
            TILE_IN_BLOCK, STATS,
        )  # fmt: skip
    else:
        # One segment per run of rows of one request (normally the whole group).
        for j in range(ROWS):
            req = tl.max(tl.where(offs_r == j, requests, 0), 0)
            prev = tl.max(tl.where(offs_r == j - 1, requests, -1), 0)
            if (t0 + j < rows) & (req != prev):
                seg = (offs_r >= j) & row_ok & (requests == req)
                _score_segment(
                    q_all, w_all, q_ptr, w_ptr, cache_ptr, block_table_ptr, scores_ptr, stats_ptr, t0,
                    chunk_id, req.to(tl.int64), seg, row_hi, lo, end, Hi, max_blocks, num_blocks,
                    stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_bt, stride_c_blk, stride_c_tok,
                    stride_sc_t, stride_st_k, stride_st_t, softmax_scale,
                    D, BLOCK_D, BLOCK_H, HEAD_BLOCKS, BLOCK_P, BLOCK_SIZE, ROWS, FP8, DOT_DTYPE,
                    INPUT_PRECISION, TILE_IN_BLOCK, STATS,
                )  # fmt: skip


INDEX_SCORES_LAUNCH = LaunchCache(_index_scores_kernel)


def position_chunk(*, rows: int, max_keys: int, num_sms: int, block_p: int = 64) -> int:
    """Positions per program of the scores kernel: all of a row's (``max_keys``, rounded up to
    whole tiles) when the rows alone give :data:`PROGRAMS_PER_SM` programs per SM or more,
    otherwise the row cut into as many chunks (of at least :data:`MIN_CHUNK` positions) as keep
    the programs within that many per SM. ``rows``: programs along the rows (row groups)."""
    whole = round_up(max(1, max_keys), block_p)
    target = PROGRAMS_PER_SM * num_sms
    if rows >= target:
        return whole
    splits = max(1, min(target // max(1, rows), -(-whole // MIN_CHUNK)))
    return round_up(-(-whole // splits), block_p)


def _operands(call: IndexTopkCall) -> tuple[bool, tl.dtype, str]:
    """``(fp8 keys, dot dtype, precision)``; fp8 queries need fp8 keys."""
    fp8 = call.key_dtype == E4M3
    if call.q.dtype == E4M3:
        if not fp8:
            raise InvalidInputError("q", "fp8 (e4m3) index queries need fp8 index keys")
        return True, tl.float8e4nv, "tf32"
    dot_dtype, precision = _dot_dtype(call.q.dtype, call.key_dtype)
    return fp8, dot_dtype, precision


def check_score_operands(call: IndexTopkCall, scores: torch.Tensor, *, fp8: bool) -> None:
    """Raise :class:`InvalidInputError` unless a scores kernel can read ``call`` and write
    ``scores``: an fp8 index-key cache contiguous (its block layout), ``q``, the cache, the block
    table and ``scores`` with a contiguous last dim."""
    cache = call.index_cache
    if fp8 and not cache.is_contiguous():
        raise InvalidInputError("index_cache", "an fp8 index-key cache must be contiguous (its block layout)")
    if (
        call.q.stride(-1) != 1
        or cache.stride(-1) != 1
        or call.block_table.stride(-1) != 1
        or scores.stride(-1) != 1
    ):
        raise InvalidInputError("q", "q, index_cache, block_table and scores need a contiguous last dim")


def check_stats(stats: torch.Tensor | None, rows: int, chunks: int) -> None:
    """Raise :class:`InvalidInputError` unless ``stats`` is ``None`` or ``[2, rows, chunks]``."""
    if stats is not None and tuple(stats.shape) != (2, rows, chunks):
        raise InvalidInputError("stats", f"expected [2, {rows}, {chunks}], got {tuple(stats.shape)}")


def index_scores(
    call: IndexTopkCall,
    scores: torch.Tensor,
    *,
    chunk: int | None = None,
    stats: torch.Tensor | None = None,
    config: IndexScoresConfig | None = None,
) -> None:
    """Fill ``scores`` (float32 ``[T, max_keys]``, last dim contiguous) with the indexer's scores
    of ``call`` (``-inf`` where a row may not see the position). ``stats``: float32 ``[2, T,
    chunks]`` (``chunks = cdiv(max_keys, chunk)``, :func:`score_chunks`) receives each (row,
    chunk)'s least and greatest finite score (``+inf``/``-inf`` where none). ``config``: the
    launch (default :func:`index_scores_config`); ``chunk`` overrides its chunk (a multiple of
    its ``block_p``; tests)."""
    q, weights, cache, table = call.q, call.weights, call.index_cache, call.block_table
    rows, index_heads, head_dim = q.shape
    if rows == 0 or call.max_keys == 0:
        return
    fp8, dot_dtype, precision = _operands(call)
    check_score_operands(call, scores, fp8=fp8)
    if config is None:
        config = index_scores_config(rows=rows, fp8_dot=dot_dtype == tl.float8e4nv)
    if chunk is not None:
        config = attrs.evolve(config, chunk=chunk)
    block_h = min(MAX_BLOCK_H, max(16, triton.next_power_of_2(index_heads)))
    head_blocks = triton.cdiv(index_heads, block_h)
    group = 1 if head_blocks > 1 else config.rows
    chunk = score_chunk(call, config, num_sms(q.device))
    if chunk <= 0 or chunk % config.block_p:
        raise InvalidInputError("chunk", f"must be a positive multiple of {config.block_p}, got {chunk}")
    chunks = triton.cdiv(call.max_keys, chunk)
    check_stats(stats, rows, chunks)
    block_size = cache.shape[1]
    INDEX_SCORES_LAUNCH.launch(
        (triton.cdiv(rows, group), chunks),
        q,
        weights,
        cache,
        table,
        call.row_request,
        call.row_keys,
        scores,
        scores if stats is None else stats,
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
        0 if stats is None else stats.stride(0),
        0 if stats is None else stats.stride(1),
        call.softmax_scale,
        D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=block_h,
        HEAD_BLOCKS=head_blocks,
        BLOCK_P=config.block_p,
        BLOCK_SIZE=block_size,
        ROWS=group,
        FP8=fp8,
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        TILE_IN_BLOCK=block_size % config.block_p == 0,
        STATS=stats is not None,
        **pdl_options(q.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def score_chunk(call: IndexTopkCall, config: IndexScoresConfig, sms: int) -> int:
    """Positions per program of the scores kernel for ``call`` under ``config``."""
    if config.chunk is not None:
        return config.chunk
    group = config.rows if call.q.shape[1] <= MAX_BLOCK_H else 1
    groups = triton.cdiv(call.q.shape[0], group)
    return position_chunk(rows=groups, max_keys=call.max_keys, num_sms=sms, block_p=config.block_p)


INDEX_WORKSPACE_BYTES = 512 << 20
"""Bound on the workspace of one :func:`index_topk` chunk of rows: the float32 scores, the
top-k's histograms and candidates (about 50 KB a row over 8192 positions: an 8192-token prefill
runs as one chunk; a prefill of 8192 rows over 128K positions would need 4 GB of scores at
once)."""


ScoresKernel = Callable[..., None]
"""A scores kernel with :func:`index_scores`'s signature (``(call, scores, *, stats, config)``)."""


def index_topk(
    call: IndexTopkCall,
    *,
    scores_config: IndexScoresConfig | None = None,
    select_config: TopkConfig | None = None,
    scores_kernel: ScoresKernel | None = None,
) -> None:
    """The indexer's scores (:func:`index_scores` into a float32 ``[rows, max_keys]`` workspace
    per chunk of rows, with each chunk's score range) and the threshold top-k
    (:func:`~mla.providers.triton.topk.radix_topk`) on the device: per row the ``min(topk,
    visible)`` best positions in no score order, then ``-1``. ``scores_config`` and
    ``select_config`` override the launches (the probe's sweeps); ``scores_kernel`` replaces
    :func:`index_scores` (another provider's kernel, same contract and chunking)."""
    indices = call.indices
    rows, topk = indices.shape
    if rows == 0 or topk == 0:
        return
    if min(topk, call.max_keys) == 0:
        indices.fill_(-1)
        return
    device = indices.device
    sms = num_sms(device)
    fp8_dot = call.q.dtype == E4M3
    config = scores_config or index_scores_config(rows=rows, fp8_dot=fp8_dot)
    select = select_config or topk_config(rows=rows, max_keys=call.max_keys, num_sms=sms)
    chunk = score_chunk(call, config, sms)
    config = attrs.evolve(config, chunk=chunk)
    chunks = triton.cdiv(call.max_keys, chunk)
    splits = triton.cdiv(call.max_keys, select.split)
    cand = min(select.cand_cap, call.max_keys)
    per_row = 4 * call.max_keys + 8 * chunks + 4 * splits * select.bins + 4 * cand
    step = max(1, min(rows, INDEX_WORKSPACE_BYTES // per_row))
    scores = torch.empty(step, call.max_keys, dtype=torch.float32, device=device)
    stats = torch.empty(2, step, chunks, dtype=torch.float32, device=device)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        part = (
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
        part_stats = stats[:, : hi - lo]
        (scores_kernel or index_scores)(part, scores[: hi - lo], stats=part_stats, config=config)
        radix_topk(
            scores[: hi - lo],
            indices[lo:hi],
            k=topk,
            lengths=part.row_keys,
            stats=part_stats,
            config=select,
        )


__all__ = [
    "INDEX_WORKSPACE_BYTES",
    "PREFILL_ROWS",
    "IndexScoresConfig",
    "check_score_operands",
    "check_stats",
    "index_scores",
    "index_scores_config",
    "index_topk",
    "position_chunk",
    "score_chunk",
]
