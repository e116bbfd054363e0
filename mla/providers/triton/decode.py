# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Triton paged MQA decode over the flat MLA latent cache, and its split-KV reduce.

One kernel serves every decode contract of the provider:

* ``paged_decode``: asm-style paged decode (``q [T, H, L+R]``, ``qo_indptr`` with qlen >= 1,
  right-aligned causal rows), either *non-persistent* (the kernel splits each request's KV into
  ``num_splits`` equal ranges by the heuristic in :mod:`.schedule`) or *persistent* (work items
  from a planned :class:`~mla.providers.split_kv.SplitKVSchedule`);
* the small-head (Gluon-style) decode in :mod:`.small_head`, where every row of q is its own
  qlen-1 request (``UNIT_QLEN``).

A program owns one (request, KV range) work item and ``BLOCK_M`` packed query rows
(``row = qi·H + h``), so verify rows and small head counts share the MMA M dimension instead of
padding heads. Per KV tile it gathers ``BLOCK_N`` cache rows, found either through the engine's
block table (``PAGE_SIZE > 0``: position ``p`` of the request is row ``table[b, p // PAGE_SIZE]
* PAGE_SIZE + p % PAGE_SIZE``, one block id per page of the tile, a block outside the cache
masked; ``ROW_MAP``: a small-head verify row reads its request's table row) or by flat token id
(the per-token view the gluon provider's fallback hands it), computes
``S = q_nope·K_latᵀ + q_pe·K_ropeᵀ`` (two dots), an online softmax in the exp2 domain, and
``O += P·K_lat`` (V is the latent part of the same tile, loaded once). fp8 caches are loaded as
fp8 and widened to the dot dtype in registers; the per-tensor scale (read from its device tensor)
is folded into the score scale and the output. Work items covering a whole request write
``out``/``lse`` directly; split items write fp32 partials (normalised o, natural-log lse) that
:func:`~mla.providers.triton.merge.launch_merge` combines. With ``lse=None`` (``WRITE_LSE``
off) neither kernel stores the final LSE; the split partials keep theirs, which the reduce needs
for ``out``.

Rows with no visible key produce ``o = 0``, ``lse = -inf``. Everything here is graph-capturable:
grids come from shapes and Python ints, never from tensor values.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from mla.providers.calls import PagedDecodeCall
from mla.providers.triton.decode_launch import LOG2E, DecodeInputs, DecodeLaunch, launch_split_decode, num_sms
from mla.providers.triton.interpreter import interpreting
from mla.providers.triton.merge import request_rows
from mla.providers.triton.schedule import DecodeLaunchConfig, decode_launch_config


@triton.jit
def _key_end(lengths_ptr, req, kv_len, HAS_LENGTHS: tl.constexpr):
    """Where request ``req``'s keys end: ``lengths[req]`` clamped into ``[0, kv_len]`` with
    ``HAS_LENGTHS``, else ``kv_len`` (the causal limits keep ``kv_len``)."""
    if HAS_LENGTHS:
        return tl.minimum(tl.maximum(tl.load(lengths_ptr + req), 0), kv_len)
    return kv_len


@triton.jit
def _load_tile_ids(index_base, n0, hi, offs_n, num_rows, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Flat token ids of KV positions ``n0 + offs_n`` (int32; the row address is widened to
    int64 where it is formed, so no int64 id vector stays live across the pipelined loop): -1 past
    ``hi``; an id outside the cache's ``num_rows`` rows (the fill's -1 mark, a block past the
    cache: -1) the tile loads and the softmax mask (:func:`_key_valid`): such a key reads no
    memory and counts for nothing.

    ``PAGE_SIZE > 0``: ``index_base`` is the request's block-table row and position ``n`` is row
    ``block * PAGE_SIZE + n % PAGE_SIZE`` of block ``index_base[n // PAGE_SIZE]`` (the lanes of
    one page load the same id: one block-table read per page run of the tile); a block outside
    ``[0, num_rows // PAGE_SIZE)`` is masked, never clamped. (Tiles inside one page take
    :func:`_tile_block` instead.)"""
    n = n0 + offs_n
    if PAGE_SIZE >= BLOCK_N and PAGE_SIZE > 0:
        # A tile spans at most two pages: two scalar block-id loads instead of a per-lane load
        # (whose id vector made the 16-row bf16 launch spill: 255 registers + 272 bytes of stack
        # in the sm_90 compile report, against 222 and none this way).
        p0 = n0 // PAGE_SIZE
        first = tl.load(index_base + p0, mask=n0 < hi, other=-1)
        second = tl.load(index_base + p0 + 1, mask=(p0 + 1) * PAGE_SIZE < hi, other=-1)
        block = tl.where(n < (p0 + 1) * PAGE_SIZE, first, second)
        inside = (block.to(tl.uint32, bitcast=True) < num_rows // PAGE_SIZE) & (n < hi)
        return tl.where(inside, block * PAGE_SIZE + n % PAGE_SIZE, -1)
    if PAGE_SIZE > 0:
        block = tl.load(index_base + n // PAGE_SIZE, mask=n < hi, other=-1)
        inside = block.to(tl.uint32, bitcast=True) < num_rows // PAGE_SIZE
        return tl.where(inside, block * PAGE_SIZE + n % PAGE_SIZE, -1)
    # (the callers' unsigned compare with num_rows masks an id outside the cache)
    return tl.load(index_base + n, mask=n < hi, other=-1)


@triton.jit
def _key_valid(tok, num_rows):
    """Whether the rows ``tok`` of :func:`_load_tile_ids` are keys: inside ``[0, num_rows)``, one
    unsigned compare (-1, past ``hi`` or outside the cache, is not)."""
    return tok.to(tl.uint32, bitcast=True) < num_rows


@triton.jit
def _tile_block(index_base, n0, hi, PAGE_SIZE: tl.constexpr):
    """The block id of the tile at ``n0`` when every tile lies inside one page (``IN_PAGE``:
    non-persistent launches cut requests at multiples of the tile, and pages are a multiple of
    it): one scalar load a tile; -1 for a tile at or past ``hi``."""
    return tl.load(index_base + n0 // PAGE_SIZE, mask=n0 < hi, other=-1)


@triton.jit
def _tile_keys(handle, n0, hi, offs_n, num_rows, PAGE_SIZE: tl.constexpr, IN_PAGE: tl.constexpr):
    """``(tok, key_hi)`` of the tile at ``n0`` from what the loop carries for it (``handle``):
    the rows its positions read and the end of its keys. ``IN_PAGE``: ``handle`` is the tile's
    block id (:func:`_tile_block`), checked once: its rows are consecutive and ``key_hi`` is
    ``hi``, or ``n0`` (no key) for a block outside the cache. Otherwise ``handle`` is the id
    vector of :func:`_load_tile_ids` (-1: no key) and ``key_hi`` is ``hi``."""
    if IN_PAGE:
        inside = handle.to(tl.uint32, bitcast=True) < num_rows // PAGE_SIZE
        return handle * PAGE_SIZE + n0 % PAGE_SIZE + offs_n, tl.where(inside, hi, n0)
    else:  # noqa: RET505 (a constexpr branch; Triton wants one type from both returns otherwise)
        return handle, hi


@triton.jit
def _tile_ids(
    index_base, n0, hi, offs_n, num_rows,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IN_PAGE: tl.constexpr,
):  # fmt: skip
    """What the loop carries for the tile at ``n0`` (:func:`_tile_keys` reads it): its block id
    (``IN_PAGE``, :func:`_tile_block`) or its id vector (:func:`_load_tile_ids`)."""
    if IN_PAGE:
        return _tile_block(index_base, n0, hi, PAGE_SIZE)
    else:  # noqa: RET505 (a constexpr branch returning a scalar or a vector)
        return _load_tile_ids(index_base, n0, hi, offs_n, num_rows, PAGE_SIZE, BLOCK_N)


@triton.jit
def _load_kv_tile(
    kv_ptr, tok, n0, key_hi, num_rows, stride_kv, offs_n, offs_l, offs_r,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    IN_PAGE: tl.constexpr = False,
):  # fmt: skip
    """The latent ``[BLOCK_N, BLOCK_L]`` and rope ``[BLOCK_N, BLOCK_R]`` parts of the cache rows
    ``tok`` (rows that are no key and padded columns read as 0, never as memory: ``IN_PAGE``,
    positions from ``key_hi`` on (:func:`_tile_keys`); otherwise ids outside ``[0, num_rows)``,
    :func:`_key_valid`)."""
    if IN_PAGE:  # noqa: SIM108 (a constexpr branch: the other side is not compiled)
        n_ok = n0 + offs_n < key_hi
    else:
        n_ok = _key_valid(tok, num_rows)
    row_ptr = kv_ptr + tok.to(tl.int64)[:, None] * stride_kv
    if BLOCK_L == L:
        k_lat = tl.load(row_ptr + offs_l[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_lat = tl.load(row_ptr + offs_l[None, :], mask=n_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    if BLOCK_R == R:
        k_rope = tl.load(row_ptr + L + offs_r[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_rope = tl.load(row_ptr + L + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    return k_lat, k_rope


@triton.jit
def _attend_tile(
    q_nope, q_pe, k_lat, k_rope, n, tok, key_hi, num_rows, row_limit, m_i, l_i, acc, qk_scale,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, IN_PAGE: tl.constexpr = False,
):  # fmt: skip
    """One online-softmax step (exp2 domain) over KV positions ``n``: returns ``m, l, acc``.

    V is the same tile as K (its first ``L`` lanes): verify rows of one request share the tile,
    so a non-finite value in a key of the request's own that a row does not see reaches it as
    ``0 * NaN`` in the PV product. Keys outside the request (other requests, the null block,
    the tail past ``hi``) and ids outside the cache (:func:`_key_valid`; ``IN_PAGE``: positions
    from ``key_hi`` on, :func:`_tile_keys`) are never loaded (masked loads give 0) and never
    visible.
    """
    k_lat = k_lat.to(DOT_DTYPE)
    scores = tl.dot(q_nope, tl.trans(k_lat), input_precision=INPUT_PRECISION)
    scores = tl.dot(q_pe, tl.trans(k_rope.to(DOT_DTYPE)), scores, input_precision=INPUT_PRECISION)
    if IN_PAGE:
        visible = n[None, :] < tl.minimum(row_limit, key_hi)[:, None]
    else:
        visible = _key_valid(tok, num_rows)[None, :] & (n[None, :] < row_limit[:, None])
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DOT_DTYPE), k_lat, acc, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_rows", "stride_bt"])
def _mla_decode_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    qo_indptr_ptr,
    work_info_ptr,
    split_indptr_ptr,
    out_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_splits,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_kv,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    stride_po_w,
    stride_po_q,
    stride_po_h,
    stride_pl_w,
    stride_pl_q,
    qk_scale,
    kv_scale_ptr,
    num_rows,
    stride_bt,
    row_request_ptr,
    lengths_ptr,
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    MODE: tl.constexpr,
    UNIT_QLEN: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    REG_PIPELINE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROW_MAP: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
):
    pid = tl.program_id(0)
    rb = pid % ROW_BLOCKS
    work = pid // ROW_BLOCKS
    # The fp8 dequant scale is read on the device, so a captured graph sees its current value.
    if HAS_KV_SCALE:
        v_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * v_scale
    else:
        v_scale = 1.0

    # -- the work item: request, KV range [lo, hi) relative to the request, direct or partial --
    if MODE == 0:
        req = work // num_splits
        split = work % num_splits
        kv_start = tl.load(kv_indptr_ptr + req)
        kv_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
        kv_end = _key_end(lengths_ptr, req, kv_len, HAS_LENGTHS)
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
        direct = num_splits == 1
    else:
        req = tl.load(work_info_ptr + work * 4)
        if req < 0:
            return
        kv_start = tl.load(kv_indptr_ptr + req)
        kv_len = tl.load(kv_indptr_ptr + req + 1) - kv_start
        lo = tl.load(work_info_ptr + work * 4 + 1) - kv_start
        kv_end = _key_end(lengths_ptr, req, kv_len, HAS_LENGTHS)
        hi = tl.minimum(tl.load(work_info_ptr + work * 4 + 2) - kv_start, kv_end)
        direct = (tl.load(split_indptr_ptr + req + 1) - tl.load(split_indptr_ptr + req)) == 1

    q_start, qlen = request_rows(qo_indptr_ptr, req, UNIT_QLEN)

    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // H
    head = rows % H
    row_ok = qi < qlen
    # Right-aligned causal window: row qi sees relative keys < kv_len - qlen + qi + 1.
    row_limit = kv_len - qlen + qi + 1
    token = (q_start + qi).to(tl.int64)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    qn_ptrs = q_nope_ptr + token[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_l[None, :]
    qp_ptrs = q_pe_ptr + token[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_r[None, :]
    if BLOCK_L == L:
        q_nope = tl.load(qn_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q_nope = tl.load(qn_ptrs, mask=row_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    if BLOCK_R == R:
        q_pe = tl.load(qp_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q_pe = tl.load(qp_ptrs, mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_nope = q_nope.to(DOT_DTYPE)
    q_pe = q_pe.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_SIZE > 0:
        # Block-table keys: the request's (or, ROW_MAP, the row's request's) table row.
        if ROW_MAP:  # noqa: SIM108 (a constexpr branch: the other side is not compiled)
            table_row = tl.load(row_request_ptr + req).to(tl.int64)
        else:
            table_row = req.to(tl.int64)
        index_base = kv_indices_ptr + table_row * stride_bt
    else:
        index_base = kv_indices_ptr + kv_start
    # Non-persistent launches over pages a multiple of the tile: each tile inside one page, its
    # block id loaded and checked once (the loop carries that scalar, not an id vector).
    IN_PAGE: tl.constexpr = MODE == 0 and PAGE_SIZE > 0 and PAGE_SIZE % BLOCK_N == 0
    if REG_PIPELINE:
        # Hand-pipelined: the next tile's rows are loaded into registers before this tile is
        # computed (Triton's cp.async pipeliner does not take fp8 tiles that are widened
        # before the dots), and token ids run one tile further ahead.
        ids = _tile_ids(index_base, lo, hi, offs_n, num_rows, PAGE_SIZE, BLOCK_N, IN_PAGE)
        ids_next = _tile_ids(index_base, lo + BLOCK_N, hi, offs_n, num_rows, PAGE_SIZE, BLOCK_N, IN_PAGE)
        tok, key_hi = _tile_keys(ids, lo, hi, offs_n, num_rows, PAGE_SIZE, IN_PAGE)
        k_lat, k_rope = _load_kv_tile(
            kv_ptr, tok, lo, key_hi, num_rows, stride_kv, offs_n, offs_l, offs_r,
            L, R, BLOCK_L, BLOCK_R, IN_PAGE,
        )  # fmt: skip
        for n0 in range(lo, hi, BLOCK_N):
            ids_after = _tile_ids(
                index_base, n0 + 2 * BLOCK_N, hi, offs_n, num_rows, PAGE_SIZE, BLOCK_N, IN_PAGE
            )
            tok_next, key_hi_next = _tile_keys(
                ids_next, n0 + BLOCK_N, hi, offs_n, num_rows, PAGE_SIZE, IN_PAGE
            )
            k_lat_next, k_rope_next = _load_kv_tile(
                kv_ptr, tok_next, n0 + BLOCK_N, key_hi_next, num_rows, stride_kv, offs_n, offs_l, offs_r,
                L, R, BLOCK_L, BLOCK_R, IN_PAGE,
            )  # fmt: skip
            tok, key_hi = _tile_keys(ids, n0, hi, offs_n, num_rows, PAGE_SIZE, IN_PAGE)
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, k_lat, k_rope, n0 + offs_n, tok, key_hi, num_rows, row_limit, m_i, l_i, acc,
                qk_scale, DOT_DTYPE, INPUT_PRECISION, IN_PAGE,
            )  # fmt: skip
            k_lat, k_rope, ids, ids_next = k_lat_next, k_rope_next, ids_next, ids_after
    else:
        for n0 in range(lo, hi, BLOCK_N):
            ids = _tile_ids(index_base, n0, hi, offs_n, num_rows, PAGE_SIZE, BLOCK_N, IN_PAGE)
            tok, key_hi = _tile_keys(ids, n0, hi, offs_n, num_rows, PAGE_SIZE, IN_PAGE)
            k_lat, k_rope = _load_kv_tile(
                kv_ptr, tok, n0, key_hi, num_rows, stride_kv, offs_n, offs_l, offs_r,
                L, R, BLOCK_L, BLOCK_R, IN_PAGE,
            )  # fmt: skip
            m_i, l_i, acc = _attend_tile(
                q_nope, q_pe, k_lat, k_rope, n0 + offs_n, tok, key_hi, num_rows, row_limit, m_i, l_i, acc,
                qk_scale, DOT_DTYPE, INPUT_PRECISION, IN_PAGE,
            )  # fmt: skip

    has_keys = l_i != 0.0  # a NaN sum (a key the row sees is NaN) stays NaN
    safe_l = tl.where(has_keys, l_i, 1.0)
    # Natural-log LSE: (max + log2(sum)) in the exp2 domain, times ln 2.
    lse = tl.where(has_keys, (m_i + tl.math.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    o = tl.where(has_keys[:, None], acc * (v_scale / safe_l)[:, None], 0.0)
    o_mask = row_ok[:, None] & (offs_l[None, :] < L)
    if direct:
        o_ptrs = out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_l[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)
    else:
        wk = work.to(tl.int64)
        po_ptrs = part_o_ptr + wk * stride_po_w + qi[:, None] * stride_po_q + head[:, None] * stride_po_h
        tl.store(po_ptrs + offs_l[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + wk * stride_pl_w + qi * stride_pl_q + head, lse, mask=row_ok)


def _dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """Operand dtype of the tensor-core dots and its precision mode.

    16-bit queries set the dot dtype (a cache of the other 16-bit type is converted to it in
    registers); an fp8 cache with a 16-bit query runs fp16 dots, since fp8 → fp16 is one
    instruction per two values (fp8 → bf16 is several) and fp16 holds every fp8 value exactly
    (the query is rounded to fp16: finer than bf16, range ±65504). fp32 queries run fp32 dots
    in IEEE precision (a correctness path, slow). Under Triton's CPU interpreter, whose bf16
    dots are wrong (errors ~1e9), bf16 operands are widened to fp32 dots (exact for bf16).
    """
    if kv_dtype.itemsize == 1 and q_dtype in (torch.bfloat16, torch.float16):
        return tl.float16, "tf32"
    if q_dtype == torch.bfloat16:
        return (tl.float32, "ieee") if interpreting() else (tl.bfloat16, "tf32")
    if q_dtype == torch.float16:
        return tl.float16, "tf32"
    return tl.float32, "ieee"


def launch_kernel(config: DecodeLaunchConfig, decode: DecodeLaunch) -> bool:
    """Launch the decode kernel for one :class:`DecodeLaunch` of the shared skeleton
    (:func:`~mla.providers.triton.decode_launch.launch_split_decode`, whose module states the
    operands' contract) with ``config``'s tile; the skeleton launches the split reduce
    (returns ``False``: the kernel does not reduce its splits)."""
    x = decode.inputs
    rank, rope = x.q_nope.shape[2], x.q_pe.shape[2]
    dot_dtype, precision = _dot_dtype(x.q_nope.dtype, x.kv_cache.dtype)
    _mla_decode_kernel[decode.grid](
        *decode.tensors(),
        *decode.scalars(),
        decode.kv_scale,
        *decode.key_operands(),
        **decode.constexprs(),
        **decode.key_constexprs(),
        BLOCK_L=max(16, triton.next_power_of_2(rank)),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_KV_SCALE=x.kv_scale is not None,
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        REG_PIPELINE=config.reg_pipeline,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return False


def paged_decode(call: PagedDecodeCall, *, config: DecodeLaunchConfig | None = None) -> None:
    """Paged MQA decode (the ``paged-decode`` contract; ``call.schedule`` selects the persistent
    path, which takes a :class:`~mla.providers.split_kv.SplitKVSchedule`). ``config`` overrides the
    heuristic (benchmarks)."""
    inputs = DecodeInputs.paged(call, provider="triton", block_table=True)
    if config is None:
        config = decode_launch_config(
            batch=inputs.num_requests,
            rows=inputs.rows,
            max_seqlen_k=inputs.max_seqlen_k,
            num_sms=num_sms(call.q.device),
            kv_elem_size=call.kv_cache.element_size(),
            persistent=inputs.schedule is not None,
        )
    launch_split_decode(
        inputs, row_tile=config.block_m, num_splits=config.num_splits, launch=partial(launch_kernel, config)
    )


__all__ = ["LOG2E", "launch_kernel", "num_sms", "paged_decode"]
