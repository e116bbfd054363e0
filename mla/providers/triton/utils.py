# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Triton utility kernels: LSE state merge, page-index expansion and planning, KV-cache write
(an ``fp8_ds_mla`` cache's write is :func:`mla.providers.triton.sparse.write_kv_ds_mla`).

Each launcher is graph-capturable: grids come from tensor shapes and host ints
(``num_tokens``), never from tensor values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla.core.config import is_ds_mla
from mla.core.errors import InvalidInputError
from mla.providers.calls import ExpandPagesCall, FillPagesCall, MergeStatesCall, WriteKVCall
from mla.providers.transforms import fill_page_indices as torch_fill_page_indices
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.sparse import write_kv_ds_mla


@triton.jit
def _merge_states_kernel(
    o_a_ptr,
    lse_a_ptr,
    o_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_out_ptr,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    stride_o_t,
    stride_o_h,
    stride_la_t,
    stride_la_h,
    stride_lb_t,
    stride_lb_h,
    stride_lo_t,
    stride_lo_h,
    H,
    D,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Program (token, head): ``lse* = logaddexp(a, b)``; ``o = e^(a-lse*) o_a + e^(b-lse*) o_b``."""
    pid = tl.program_id(0)
    t = (pid // H).to(tl.int64)
    h = pid % H
    lse_a = tl.load(lse_a_ptr + t * stride_la_t + h * stride_la_h)
    lse_b = tl.load(lse_b_ptr + t * stride_lb_t + h * stride_lb_h)
    top = tl.maximum(lse_a, lse_b)
    finite = top > float("-inf")
    top_safe = tl.where(finite, top, 0.0)
    w_a = tl.where(finite, tl.exp(lse_a - top_safe), 0.0)
    w_b = tl.where(finite, tl.exp(lse_b - top_safe), 0.0)
    total = w_a + w_b
    inv = tl.where(finite, 1.0 / tl.where(finite, total, 1.0), 0.0)
    w_a = w_a * inv
    w_b = w_b * inv
    if WRITE_LSE:
        merged = tl.where(finite, top_safe + tl.log(tl.where(finite, total, 1.0)), float("-inf"))
        tl.store(lse_out_ptr + t * stride_lo_t + h * stride_lo_h, merged)
    a_row = o_a_ptr + t * stride_a_t + h * stride_a_h
    b_row = o_b_ptr + t * stride_b_t + h * stride_b_h
    o_row = out_ptr + t * stride_o_t + h * stride_o_h
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = d < D
        x_a = tl.load(a_row + d, mask=ok, other=0.0).to(tl.float32)
        x_b = tl.load(b_row + d, mask=ok, other=0.0).to(tl.float32)
        # A side with zero weight (an empty -inf state) is dropped, not multiplied, so garbage
        # (NaN) in its output rows cannot leak.
        mixed = tl.where(w_a > 0.0, x_a * w_a, 0.0) + tl.where(w_b > 0.0, x_b * w_b, 0.0)
        tl.store(o_row + d, mixed.to(out_ptr.dtype.element_ty), mask=ok)


def merge_states(call: MergeStatesCall) -> None:
    """Merge two attention states (the ``merge-states`` contract).

    o ``[T, H, D]`` (any strides with a contiguous last dim), lse ``[T, H]`` fp32. Each program
    reads its row of both inputs before writing, so ``out`` may alias ``o_a`` or ``o_b``.
    """
    o_a, lse_a, o_b, lse_b = call.o_a, call.lse_a, call.o_b, call.lse_b
    out, lse_out = call.out, call.lse_out
    for name, tensor in (("o_a", o_a), ("o_b", o_b), ("out", out)):
        if tensor.stride(-1) != 1:
            raise InvalidInputError(
                name, f"last dim must be contiguous (stride 1); strides {tensor.stride()}"
            )
    num_tokens, heads, dim = out.shape
    if num_tokens * heads == 0:
        return
    lse_o = lse_a if lse_out is None else lse_out
    _merge_states_kernel[(num_tokens * heads,)](
        o_a,
        lse_a,
        o_b,
        lse_b,
        out,
        lse_o,
        o_a.stride(0),
        o_a.stride(1),
        o_b.stride(0),
        o_b.stride(1),
        out.stride(0),
        out.stride(1),
        lse_a.stride(0),
        lse_a.stride(1),
        lse_b.stride(0),
        lse_b.stride(1),
        lse_o.stride(0),
        lse_o.stride(1),
        heads,
        dim,
        BLOCK_D=min(1024, max(16, triton.next_power_of_2(dim))),
        WRITE_LSE=lse_out is not None,
        num_warps=4,
    )


@triton.jit
def _expand_page_indices_kernel(
    block_table_ptr,
    kv_indptr_ptr,
    out_ptr,
    num_requests,
    num_tokens,
    stride_bt,
    search_steps,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program over ``BLOCK`` flat tokens: binary-search each token's request in ``kv_indptr``,
    then ``out[i] = block_table[r, t // bs] * bs + t % bs`` with ``t = i - kv_indptr[r]``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_tokens
    # Largest r in [0, num_requests) with kv_indptr[r] <= i (requests own [indptr[r], indptr[r+1])).
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + num_requests - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        start = tl.load(kv_indptr_ptr + mid, mask=ok, other=0)
        go_right = start <= i
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    t = i - tl.load(kv_indptr_ptr + lo, mask=ok, other=0)
    block = tl.load(block_table_ptr + lo.to(tl.int64) * stride_bt + t // BLOCK_SIZE, mask=ok, other=0)
    block = block.to(tl.int64)
    value = block * BLOCK_SIZE + t % BLOCK_SIZE
    # A negative block id, or one past an int32 token id, is marked outside the cache (-1).
    value = tl.where((block >= 0) & (value <= 2147483647), value, -1)
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=ok)


def expand_page_indices(call: ExpandPagesCall) -> None:
    """Block table ``[B, max_blocks]`` → flat token ids ``out[:num_tokens]`` (the
    ``expand-pages`` contract). Requests with equal indptr entries (empty) own no token; the
    search picks the last request starting at or before each token, which is the owner because
    empty requests start where the owner ends."""
    block_table, kv_indptr, out = call.block_table, call.kv_indptr, call.out
    block_size, num_tokens = call.block_size, call.num_tokens
    num_requests = kv_indptr.numel() - 1
    if num_tokens == 0 or num_requests <= 0:
        return
    if block_table.stride(-1) != 1:
        raise InvalidInputError("block_table", "last dim must be contiguous (stride 1)")
    block = 256
    _expand_page_indices_kernel[(triton.cdiv(num_tokens, block),)](
        block_table,
        kv_indptr,
        out,
        num_requests,
        num_tokens,
        block_table.stride(0),
        max(1, num_requests.bit_length()),
        BLOCK_SIZE=block_size,
        BLOCK=block,
        num_warps=4,
    )


FILL_DO_NOT_SPECIALIZE = ("num_requests", "stride_bt", "max_len", "num_blocks")
"""The fill kernel's int arguments that change per step: not specialized on (one compiled
kernel for every batch size and bound)."""


@triton.jit(do_not_specialize=FILL_DO_NOT_SPECIALIZE)
def _fill_page_indices_kernel(
    seq_lens_ptr,
    block_table_ptr,
    kv_indptr_ptr,
    out_ptr,
    num_requests,
    stride_bt,
    max_len,
    num_blocks,
    qsl_ptr,
    qo_ptr,
    count_ptr,
    length_count_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CHECK_BLOCKS: tl.constexpr,
    COPY_QO: tl.constexpr,
    WRITE_IDS: tl.constexpr,
    COUNT: tl.constexpr,
    COUNT_LENGTHS: tl.constexpr,
    QLEN_FROM_QSL: tl.constexpr,
):
    """Program (request ``b``, chunk ``c``): sum the clamped lengths of requests ``< b`` (its
    start), write ``kv_indptr[b+1]`` (chunk 0) and the flat ids (-1 outside the cache) of tokens
    ``c*BLOCK .. (c+1)*BLOCK`` of request ``b`` (``WRITE_IDS``; without it the chunk is
    ``BLOCK`` pages and writes no id); chunk 0 also copies ``qsl[b+1]`` to ``qo[b+1]``
    (``COPY_QO``). ``COUNT``: the chunk's tokens outside the cache are added to ``count``.
    ``COUNT_LENGTHS``: chunk 0 adds 1 to ``length_count`` when request ``b``'s length is bad
    (negative, past ``max_len``, or ``0 < seq_len < qlen``; qlen from ``qsl`` with
    ``QLEN_FROM_QSL``, else 1)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_B)
    start = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, b, BLOCK_B):
        prior = b0 + offs_b
        lens = tl.load(seq_lens_ptr + prior, mask=prior < b, other=0).to(tl.int64)
        start += tl.sum(tl.minimum(tl.maximum(lens, 0), max_len), 0)
    raw = tl.load(seq_lens_ptr + b).to(tl.int64)
    length = tl.minimum(tl.maximum(raw, 0), max_len)
    if c == 0:
        tl.store(kv_indptr_ptr + b + 1, (start + length).to(tl.int32))
        if b == 0:
            tl.store(kv_indptr_ptr, start.to(tl.int32))
        if COPY_QO:
            tl.store(qo_ptr + b + 1, tl.load(qsl_ptr + b + 1).to(tl.int32))
            if b == 0:
                tl.store(qo_ptr, tl.load(qsl_ptr).to(tl.int32))
        if COUNT_LENGTHS:
            bad_length = (raw < 0) | (raw > max_len)
            if QLEN_FROM_QSL:
                qlen = (tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)).to(tl.int64)
                bad_length = bad_length | ((raw > 0) & (raw < qlen))
            if bad_length:
                tl.atomic_add(length_count_ptr, 1)
    row = block_table_ptr + b.to(tl.int64) * stride_bt
    if WRITE_IDS:
        t = c * BLOCK + tl.arange(0, BLOCK)
        ok = t < length
        block = tl.load(row + t // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        value = block * BLOCK_SIZE + t % BLOCK_SIZE
        # Block ids outside the cache are marked -1 (the kernels mask it): negative, past
        # ``num_blocks`` (``CHECK_BLOCKS``) or past an int32 id.
        inside = (block >= 0) & (value <= 2147483647)
        if CHECK_BLOCKS:
            inside = inside & (block < num_blocks)
        tl.store(out_ptr + start + t, tl.where(inside, value, -1).to(tl.int32), mask=ok)
        bad = tl.sum((ok & ~inside).to(tl.int32), 0)
    else:
        # One block id per page: the tokens of an outside page are counted, nothing is written.
        page = c * BLOCK + tl.arange(0, BLOCK)
        in_page = tl.minimum(tl.maximum(length - page.to(tl.int64) * BLOCK_SIZE, 0), BLOCK_SIZE)
        block = tl.load(row + page, mask=in_page > 0, other=0).to(tl.int64)
        outside = block < 0
        if CHECK_BLOCKS:
            outside = outside | (block >= num_blocks)
        bad = tl.sum(tl.where(outside, in_page, 0), 0).to(tl.int32)
    if COUNT:  # noqa: SIM102 (a constexpr branch around a run-time one)
        if bad > 0:
            tl.atomic_add(count_ptr, bad)


FILL_LAUNCH = LaunchCache(_fill_page_indices_kernel)
"""The fill's launches: through the compiled kernel after the first of each specialization
(:mod:`.launch_cache`), since a decode build is this one launch."""


def fill_page_indices(call: FillPagesCall) -> None:
    """:class:`~mla.providers.calls.FillPagesCall` as one launch: a program per (request,
    ``BLOCK`` tokens of ``max_len``), each summing the lengths before its request itself (no
    second pass, no host sync), with the ``qo_indptr`` copy folded in; launched through
    :data:`FILL_LAUNCH`."""
    if call.compact:  # (a per-request count of the kept tokens first: the torch form's scans)
        torch_fill_page_indices(call)
        return
    write_ids = call.kv_indices is not None
    block_table, seq_lens, qsl, qo = call.block_table, call.seq_lens, call.query_start_loc, call.qo_indptr
    num_requests = seq_lens.numel()
    copy_qo = qsl is not None and qo is not None
    if num_requests == 0:
        call.kv_indptr[:1].zero_()
        if qsl is not None and qo is not None:
            qo.copy_(qsl)
        return
    strides = block_table.stride()
    if strides[-1] != 1:
        raise InvalidInputError("block_table", "last dim must be contiguous (stride 1)")
    block, max_len, num_blocks, count = 1024, call.max_len, call.num_blocks, call.invalid_count
    lengths = call.length_count
    read_qsl = qsl is not None and (copy_qo or lengths is not None)
    units = max_len if write_ids else -(-max_len // call.block_size)  # tokens, or pages
    chunks = -(-units // block)
    FILL_LAUNCH.launch(
        (num_requests, chunks if chunks > 1 else 1),
        seq_lens,
        block_table,
        call.kv_indptr,
        call.kv_indices if call.kv_indices is not None else seq_lens,
        num_requests,
        strides[0],
        max_len,
        num_blocks or 1,
        qsl if read_qsl else seq_lens,
        qo if copy_qo else seq_lens,
        count if count is not None else seq_lens,
        lengths if lengths is not None else seq_lens,
        BLOCK_SIZE=call.block_size,
        BLOCK=block,
        BLOCK_B=128,
        CHECK_BLOCKS=num_blocks is not None,
        COPY_QO=copy_qo,
        WRITE_IDS=write_ids,
        COUNT=count is not None,
        COUNT_LENGTHS=lengths is not None,
        QLEN_FROM_QSL=read_qsl and lengths is not None,
        num_warps=4,
    )


@triton.jit
def _write_kv_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_ptr,
    stride_c,
    stride_pe,
    stride_slot_row,
    scale_ptr,
    fp8_max,
    num_slots,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """Program per new token: copy ``[kv_c | k_pe]`` to cache row ``slot`` (skip negative
    slots and slots past the cache's ``num_slots`` rows); fp8 caches store
    ``clamp(value / scale, ±max)`` rounded to nearest-even, with the
    scale read from its device tensor."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0 or slot >= num_slots:
        return
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lat = tl.load(kv_c_ptr + n * stride_c + offs_l, mask=offs_l < L, other=0.0).to(tl.float32)
    rope = tl.load(k_pe_ptr + n * stride_pe + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
    if QUANTIZE:
        scale = tl.load(scale_ptr)
        lat = tl.minimum(tl.maximum(lat / scale, -fp8_max), fp8_max)
        rope = tl.minimum(tl.maximum(rope / scale, -fp8_max), fp8_max)
    row = cache_ptr + slot * stride_slot_row
    tl.store(row + offs_l, lat.to(cache_ptr.dtype.element_ty), mask=offs_l < L)
    tl.store(row + L + offs_r, rope.to(cache_ptr.dtype.element_ty), mask=offs_r < R)


def write_kv(call: WriteKVCall) -> None:
    """Write new latent + rope rows into ``kv_cache [blocks, block_size, L+R]`` at flat
    ``slot_mapping`` slots (the ``kv-write`` contract); an ``fp8_ds_mla`` cache (uint8 rows) goes
    to :func:`~mla.providers.triton.sparse.write_kv_ds_mla`."""
    if is_ds_mla(call.kv_cache.dtype):
        write_kv_ds_mla(call)
        return
    kv_c, k_pe, kv_cache, slot_mapping, kv_scale = (
        call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping, call.kv_scale
    )  # fmt: skip
    num_new, rank = kv_c.shape
    rope = k_pe.shape[1]
    if num_new == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if flat.stride(-1) != 1 or kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise InvalidInputError("kv_cache", "kv_cache, kv_c and k_pe need a contiguous last dim")
    quantize = kv_scale is not None
    fp8_max = float(torch.finfo(kv_cache.dtype).max) if quantize else 0.0
    _write_kv_kernel[(num_new,)](
        kv_c,
        k_pe,
        flat,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        flat.stride(0),
        slot_mapping if kv_scale is None else kv_scale,
        fp8_max,
        flat.shape[0],
        L=rank,
        R=rope,
        BLOCK_L=triton.next_power_of_2(rank),
        BLOCK_R=triton.next_power_of_2(rope),
        QUANTIZE=quantize,
        num_warps=4 if rank >= 256 else 1,
    )
