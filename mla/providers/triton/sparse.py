# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Triton kernels of DeepSeek Sparse Attention: sparse MLA attention, index-key writes,
``fp8_ds_mla`` cache writes and the slot conversion (the indexer's scores and top-k are in
:mod:`mla.providers.triton.indexer`).

Sparse attention (:func:`sparse_attention`, contract ``sparse-attention``)
    A program owns one query row ``t``, a block of ``BLOCK_H`` of its heads (masked: any head
    count runs, nothing is padded) and one split of the row's slot list. It first finds where
    the split's walk ends: after the split's last valid slot (a scan of the int32 slot ids), and
    no later than the row's length when the call carries ``lengths`` (clamped to ``[0, K]``; no
    slot at or past it is read). The ``-1`` padding at the end of a short row costs no tile. It
    then walks the slots in tiles of ``BLOCK_N``: it gathers the cache
    rows by slot (masked loads: a ``-1`` slot, or one past the cache, is never read), computes
    ``S = q_nope·K_latᵀ + q_pe·K_ropeᵀ`` (two ``tl.dot``), an online softmax in fp32 (exp2
    domain) and ``O += P·K_lat`` (V is the latent part of the same tile). Rows do not share
    tiles (each row has its own slots), so the dot's M dimension is the head block alone
    (``BLOCK_H`` = 16, 32 or 64).

    Cache formats: float caches are widened as they are; per-tensor fp8 caches are widened to
    fp16 in registers with ``kv_scale`` (read on the device) folded into the score scale and the
    output; ``fp8_ds_mla`` byte rows are read as ``L`` e4m3 bytes, each 128-wide tile multiplied
    by its float32 scale (bytes ``L .. L + 4·L/128``), and the rope lanes are the bf16 tail.

    When the rows × head blocks do not fill the device, each row's slot list is cut into
    ``num_splits`` ranges whose fp32 partials (normalised ``o``, natural-log ``lse``) are merged
    by the decode's split reduce (:func:`~mla.providers.triton.merge.launch_merge`, each query row
    a qlen-1 request). A row with no valid slot gets ``o = 0``, ``lse = -inf``.

Writes (:func:`write_index_keys`, :func:`write_kv_ds_mla`)
    One program per new token; slots that are negative or past the cache are skipped. The fp8
    formats' power-of-two scales are computed exactly (the exponent of ``amax / 448`` rounded
    up, by bit arithmetic; :func:`mla.providers.formats.power_of_two_scale` takes ``log2`` in
    fp32, which can round down for a ratio within a few ulps above a power of two, so an fp32
    input may rarely get the next power of two here), values are scaled by the inverse power of
    two (exact) and encoded as e4m3 bytes by integer arithmetic (nearest, ties to even: the bytes
    torch's conversion gives, on any arch and in the interpreter). Float index keys are stored
    in the cache's dtype (bf16 rounded to nearest even by bit arithmetic, for the same reason).

Slot conversion (:func:`sparse_slots`)
    :class:`~mla.providers.calls.SparseSlotsCall` fused into one launch (the torch default is
    a dozen ops): a program per (row, 1024 entries), invalid entries counted with one atomic add
    per program that has any. With a ``lengths`` output, a program per row walks the row's
    chunks of 2048 (one for DeepSeek's top-k, on 8 warps) and writes its length (``1 +`` its last
    valid column) itself: no zeroing launch, no atomics on the lengths.

Every launcher is graph-capturable: grids and workspaces are sized by shapes and Python ints,
never by tensor values; nothing here synchronises with the host.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from mla.core.config import DS_MLA_TILE, ds_mla_row_bytes, is_ds_mla
from mla.core.errors import InvalidInputError
from mla.providers.calls import (
    SparseAttentionCall,
    SparseSlotsCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.providers.formats import E4M3
from mla.providers.sparse_calls import check_lengths
from mla.providers.triton.decode import LOG2E, _dot_dtype, num_sms
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.merge import launch_merge
from mla.providers.triton.pdl import pdl_options, wait_for_previous

MIN_SPLIT_SLOTS = 128
"""Fewest slots a split of the sparse attention is given (two 64-slot tiles)."""
MAX_SPLITS = 64
"""Most splits of one row's slot list (bounds the partial buffers)."""
SCAN_BLOCK = 1024
"""Slot ids per step of the scan that trims a split's trailing ``-1`` padding."""

_KV_FLOAT, _KV_FP8, _KV_DS_MLA = 0, 1, 2
"""Cache formats of the sparse attention kernel (``KV_FORMAT``)."""


# -- sparse attention ---------------------------------------------------------------------------


@triton.jit
def _gather_kv_tile(
    kv_ptr, tok, valid, stride_kv, offs_l, offs_r,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """The latent ``[BLOCK_N, BLOCK_L]`` and rope ``[BLOCK_N, BLOCK_R]`` parts of cache rows
    ``tok`` in ``DOT_DTYPE`` (rows not ``valid`` and padded lanes are 0 and never read);
    ``fp8_ds_mla`` rows are dequantized by their tile scales, other fp8 rows are only widened."""
    row = kv_ptr + tok[:, None] * stride_kv
    lat_mask = valid[:, None] & (offs_l[None, :] < L)
    rope_mask = valid[:, None] & (offs_r[None, :] < R)
    if KV_FORMAT == 2:
        lat = tl.load(row + offs_l[None, :], mask=lat_mask, other=0)
        lat = lat.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        offs_tiles = tl.arange(0, BLOCK_L // TILE)
        scale_ptr = (row + L).to(tl.pointer_type(tl.float32))
        scales = tl.load(
            scale_ptr + offs_tiles[None, :],
            mask=valid[:, None] & (offs_tiles[None, :] < L // TILE),
            other=0.0,
        )
        lat = tl.reshape(lat, (BLOCK_N, BLOCK_L // TILE, TILE)) * scales[:, :, None]
        lat = tl.reshape(lat, (BLOCK_N, BLOCK_L))
        rope_ptr = (row + L + 4 * (L // TILE)).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr + offs_r[None, :], mask=rope_mask, other=0.0)
    else:
        lat = tl.load(row + offs_l[None, :], mask=lat_mask, other=0.0)
        rope = tl.load(row + L + offs_r[None, :], mask=rope_mask, other=0.0)
    return lat.to(DOT_DTYPE), rope.to(DOT_DTYPE)


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    out_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    kv_scale_ptr,
    lengths_ptr,
    H,
    K,
    num_rows,
    chunk,
    stride_q_t,
    stride_q_h,
    stride_kv,
    stride_s_t,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    stride_po_w,
    stride_po_h,
    stride_pl_w,
    qk_scale,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TILE: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
):
    """Program (row ``t``, head block, split): online softmax over the split's slots (those
    before ``lengths[t]`` with ``HAS_LENGTHS``)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = heads < H
    if KV_FORMAT == 1:
        v_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * v_scale
    else:
        v_scale = 1.0

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = q_ptr + t * stride_q_t + heads[:, None] * stride_q_h
    q_nope = tl.load(q_row + offs_l[None, :], mask=h_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    q_pe = tl.load(q_row + L + offs_r[None, :], mask=h_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_nope = q_nope.to(DOT_DTYPE)
    q_pe = q_pe.to(DOT_DTYPE)

    # The split's slot range, cut at the row's length or trimmed after its last valid slot
    # (rows shorter than the top-k are padded with -1 at the end: those tiles are not walked).
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    slot_row = slots_ptr + t * stride_s_t
    stop = hi
    if HAS_LENGTHS:  # no slot id at or past the row's length is read
        stop = tl.minimum(hi, tl.load(lengths_ptr + t))
    # The scan also brings the split's slot ids into the cache before the walk reads them (with
    # lengths it stops there rather than go: docs/performance.md, "Kernel choices").
    offs_scan = tl.arange(0, SCAN_BLOCK)
    end = lo
    for s0 in range(lo, stop, SCAN_BLOCK):
        n = s0 + offs_scan
        ids = tl.load(slot_row + n, mask=n < stop, other=-1)
        end = tl.maximum(end, tl.max(tl.where((ids >= 0) & (ids < num_rows), n + 1, 0), 0))

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + offs_n
        ids = tl.load(slot_row + n, mask=n < end, other=-1)
        valid = (ids >= 0) & (ids < num_rows)
        tok = tl.where(valid, ids, 0).to(tl.int64)
        k_lat, k_rope = _gather_kv_tile(
            kv_ptr, tok, valid, stride_kv, offs_l, offs_r,
            L, R, BLOCK_L, BLOCK_R, BLOCK_N, KV_FORMAT, DOT_DTYPE, TILE,
        )  # fmt: skip
        scores = tl.dot(q_nope, tl.trans(k_lat), input_precision=INPUT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_rope), scores, input_precision=INPUT_PRECISION)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), k_lat, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    has_keys = l_i != 0.0  # a NaN sum (a selected row holds a NaN) stays NaN
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, (m_i + tl.math.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    o = tl.where(has_keys[:, None], acc * (v_scale / safe_l)[:, None], 0.0)
    o_mask = h_ok[:, None] & (offs_l[None, :] < L)
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + offs_l[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + t * stride_lse_t + heads * stride_lse_h, lse, mask=h_ok)
    else:
        work = t * NUM_SPLITS + split
        po_ptrs = part_o_ptr + work * stride_po_w + heads[:, None] * stride_po_h + offs_l[None, :]
        tl.store(po_ptrs, o, mask=o_mask)
        tl.store(part_lse_ptr + work * stride_pl_w + heads, lse, mask=h_ok)


SPARSE_LAUNCH = LaunchCache(_sparse_mla_kernel)


@attrs.frozen
class SparseLaunchConfig:
    """Shape of one sparse-attention launch."""

    block_h: int
    """Heads per program (the dots' M dimension): 16, 32 or 64."""
    block_n: int
    """Slots per tile."""
    num_warps: int
    num_stages: int
    num_splits: int = 1
    """Ranges each row's slot list is cut into (1 writes the output directly)."""


def sparse_launch_config(
    *, rows: int, heads: int, topk: int, kv_elem_size: int, num_sms: int, q_elem_size: int = 2
) -> SparseLaunchConfig:
    """The launch shape for ``rows`` query rows of ``heads`` heads over ``topk`` slots.

    Heads fill the dots' M dimension (``BLOCK_H`` the next power of two, 16 to 64; more heads
    run as several head blocks), 8 warps above 16 rows. 16-bit caches stream 64-slot tiles two
    deep; 1-byte caches (per-tensor fp8, ``fp8_ds_mla``; widened and scaled in registers) 32-slot
    tiles two deep, or 64-slot tiles three deep for a 64-head block (the fastest of a sweep of
    tile, warp, stage and split counts on the H200, docs/performance.md). fp32 queries or
    caches (a correctness path) take 32-slot tiles without pipelining: a 64 × 576 fp32 tile,
    twice for two stages, would not fit in an sm_90 SM's shared memory. The slot list is split
    while ``rows × head blocks`` programs are fewer than two per SM (the loop is latency-bound:
    at 64 rows of 16 heads, 4 splits ran 58.7 µs against 74.3 for 2, bf16, H200), at least
    :data:`MIN_SPLIT_SLOTS` a split.
    """
    block_h = min(64, max(16, triton.next_power_of_2(max(1, heads))))
    one_byte = kv_elem_size == 1
    wide = kv_elem_size == 4 or q_elem_size == 4
    if wide:
        block_n, num_stages = 32, 1
    elif one_byte:
        # A 64-head block streams 64-slot tiles three deep; smaller blocks 32-slot tiles two deep.
        block_n, num_stages = (64, 3) if block_h == 64 else (32, 2)
    else:
        block_n, num_stages = 64, 2
    num_warps = 4 if block_h == 16 else 8
    programs = rows * triton.cdiv(max(1, heads), block_h)
    splits = 1
    if 0 < programs < 2 * num_sms:
        splits = max(1, min(2 * num_sms // programs, triton.cdiv(topk, MIN_SPLIT_SLOTS), MAX_SPLITS))
    return SparseLaunchConfig(
        block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=splits
    )


def check_ds_mla_rows(kv_cache: torch.Tensor, rank: int, rope: int) -> None:
    """Raise :class:`InvalidInputError` unless ``kv_cache`` holds ``fp8_ds_mla`` rows of
    ``rank``/``rope`` (whole 128-wide tiles, the row's byte count, 4-byte aligned rows)."""
    if rank % DS_MLA_TILE:
        raise InvalidInputError("kv_lora_rank", f"fp8_ds_mla needs a multiple of {DS_MLA_TILE}, got {rank}")
    width = ds_mla_row_bytes(rank, rope)
    if kv_cache.shape[-1] != width:
        raise InvalidInputError(
            "kv_cache", f"fp8_ds_mla rows of {rank}/{rope} are {width} bytes, got {kv_cache.shape[-1]}"
        )
    if any(stride % 4 for stride in kv_cache.stride()[:-1]):
        raise InvalidInputError("kv_cache", "fp8_ds_mla rows must start 4-byte aligned (float32 scales)")


def _sparse_dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The decode's dot dtype (:func:`~mla.providers.triton.decode._dot_dtype`), except that an
    ``fp8_ds_mla`` cache runs in the query's dtype: its dequantized values (e4m3 times a power of
    two, down to 2^-31) are exact in bf16, not in fp16."""
    if is_ds_mla(kv_dtype):
        return _dot_dtype(q_dtype, q_dtype)
    return _dot_dtype(q_dtype, kv_dtype)


def sparse_attention(call: SparseAttentionCall, *, config: SparseLaunchConfig | None = None) -> None:
    """Sparse MLA over each row's slot list (the ``sparse-attention`` contract); ``config``
    overrides :func:`sparse_launch_config` (tests, benchmarks). With ``call.lengths`` (int32
    ``[T]``, stride 1) row ``t`` walks only its first ``clamp(lengths[t], 0, K)`` slots, in
    every split; each split is trimmed after its last valid slot by a scan."""
    q, kv_cache, slots, out, lse = call.q, call.kv_cache, call.slots, call.out, call.lse
    rank, rope = call.kv_lora_rank, call.rope_dim
    rows, heads = q.shape[0], q.shape[1]
    topk = slots.shape[1]
    if rows == 0 or heads == 0:
        return
    ds_mla = is_ds_mla(kv_cache.dtype)
    fp8 = kv_cache.dtype.itemsize == 1 and not ds_mla
    if ds_mla:
        check_ds_mla_rows(kv_cache, rank, rope)
    if fp8 and call.kv_scale is None:
        raise InvalidInputError("kv_scale", "an fp8 cache needs its kv_scale tensor")
    for name, tensor in (("q", q), ("kv_cache", kv_cache), ("slots", slots), ("out", out)):
        if tensor.stride(-1) != 1:
            raise InvalidInputError(
                name, f"last dim must be contiguous (stride 1); strides {tensor.stride()}"
            )
    check_lengths(call.lengths, rows, call.q.device)
    if topk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    if config is None:
        config = sparse_launch_config(
            rows=rows,
            heads=heads,
            topk=topk,
            kv_elem_size=kv_cache.element_size(),
            num_sms=num_sms(q.device),
            q_elem_size=q.element_size(),
        )
    chunk = triton.cdiv(triton.cdiv(topk, config.num_splits), config.block_n) * config.block_n
    splits = triton.cdiv(topk, chunk)
    if splits > 1:
        part_o = torch.empty(rows * splits, 1, heads, rank, dtype=torch.float32, device=out.device)
        part_lse = torch.empty(rows * splits, 1, heads, dtype=torch.float32, device=out.device)
    else:
        part_o = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
        part_lse = out.new_empty(1, 1, 1, dtype=torch.float32)
    lse_arg = lse if lse is not None else out.new_empty(1, 1, dtype=torch.float32)
    kv_format = _KV_DS_MLA if ds_mla else _KV_FP8 if fp8 else _KV_FLOAT
    dot_dtype, precision = _sparse_dot_dtype(q.dtype, kv_cache.dtype)
    SPARSE_LAUNCH.launch(
        (rows, triton.cdiv(heads, config.block_h), splits),
        q,
        kv_cache,
        slots,
        out,
        lse_arg,
        part_o,
        part_lse,
        call.kv_scale if fp8 else lse_arg,
        call.lengths if call.lengths is not None else slots,  # unused without HAS_LENGTHS
        heads,
        topk,
        kv_cache.shape[0],
        chunk,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        lse_arg.stride(0),
        lse_arg.stride(1),
        part_o.stride(0),
        part_o.stride(2),
        part_lse.stride(0),
        call.softmax_scale * LOG2E,
        L=rank,
        R=rope,
        BLOCK_L=max(DS_MLA_TILE if ds_mla else 16, triton.next_power_of_2(rank)),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        NUM_SPLITS=splits,
        KV_FORMAT=kv_format,
        WRITE_LSE=lse is not None,
        DOT_DTYPE=dot_dtype,
        INPUT_PRECISION=precision,
        TILE=DS_MLA_TILE,
        SCAN_BLOCK=SCAN_BLOCK,
        HAS_LENGTHS=call.lengths is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        launch_merge(
            part_o=part_o,
            part_lse=part_lse,
            out=out,
            lse=lse,
            qo_indptr=None,
            split_indptr=slots,  # unused: every row is its own qlen-1 request with `splits` items
            num_requests=rows,
            max_qlen=1,
            num_splits=splits,
            num_sms=num_sms(out.device),
        )


# -- writes -------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bytes(x):
    """The e4m3 (fn) bytes of fp32 ``x`` (``|x| <= 448``), rounded to nearest, ties to even.

    Encoded by integer arithmetic rather than converted, so the bytes do not depend on the
    converter (Triton's interpreter drops the carry into the exponent when it rounds up, and the
    sign of a negative zero) and any arch writes them: a normal value (``>= 2^-6``) keeps 3
    mantissa bits of its fp32 pattern (rounded), a subnormal becomes its multiple of 2^-9
    (rounded by adding and subtracting 2^14, whose fp32 ulp is 2^-9)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0x7FF00000
    normal = ((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)).to(tl.int32)
    magnitude = tl.abs(x)
    tiny = ((magnitude + 16384.0) - 16384.0) * 512.0
    code = tl.where(magnitude >= 0.015625, normal, tiny.to(tl.int32))
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to bf16 (ties to even) by bit arithmetic (Triton's interpreter
    truncates the fp32 → bf16 conversion; on a GPU the result is the same)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _pow2_scale(amax):
    """``(scale, 1 / scale)``: ``scale`` = ``max(amax, 1e-4) / 448`` rounded up to a power of two
    (exactly: the float's exponent, plus one unless the mantissa is zero), the scale of
    :func:`mla.providers.formats.power_of_two_scale`."""
    ratio = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    bits = ratio.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + tl.where((bits & 0x7FFFFF) != 0, 1, 0)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def _write_index_keys_kernel(
    keys_ptr,
    cache_ptr,
    slot_ptr,
    stride_k,
    stride_c_blk,
    stride_c_tok,
    capacity,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    BF16_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program per new token: its key at ``slot`` (skipped outside ``[0, capacity)``); fp8 keys
    as e4m3 values and a power-of-two float32 scale in the block layout."""
    wait_for_previous(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0 or slot >= capacity:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    x = tl.load(keys_ptr + n * stride_k + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if FP8:
        scale, inverse = _pow2_scale(tl.max(tl.abs(x), 0))
        values = _e4m3_bytes(tl.minimum(tl.maximum(x * inverse, -448.0), 448.0))
        base = cache_ptr + block * (BLOCK_SIZE * (D + 4))
        tl.store(base + offset * D + offs_d, values, mask=d_ok)
        tl.store((base + BLOCK_SIZE * D + offset * 4).to(tl.pointer_type(tl.float32)), scale)
    else:
        row = cache_ptr + block * stride_c_blk + offset * stride_c_tok
        if BF16_CACHE:
            tl.store(row + offs_d, _round_bf16(x), mask=d_ok)
        else:
            tl.store(row + offs_d, x.to(cache_ptr.dtype.element_ty), mask=d_ok)


WRITE_INDEX_KEYS_LAUNCH = LaunchCache(_write_index_keys_kernel)


def write_index_keys(call: WriteIndexKeysCall) -> None:
    """Write new tokens' index keys (the ``indexer`` contract's write): one program per token."""
    keys, cache, slot_mapping = call.keys, call.index_cache, call.slot_mapping
    count, head_dim = keys.shape
    if count == 0:
        return
    fp8 = call.key_dtype == E4M3
    if fp8 and not cache.is_contiguous():
        raise InvalidInputError("index_cache", "an fp8 index-key cache must be contiguous (its block layout)")
    if keys.stride(-1) != 1 or cache.stride(-1) != 1:
        raise InvalidInputError("keys", "keys and index_cache need a contiguous last dim")
    WRITE_INDEX_KEYS_LAUNCH.launch(
        (count,),
        keys,
        cache,
        slot_mapping,
        keys.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.shape[0] * cache.shape[1],
        D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=cache.shape[1],
        FP8=fp8,
        BF16_CACHE=cache.dtype == torch.bfloat16,
        **pdl_options(keys.device),
        num_warps=1 if head_dim <= 256 else 4,
    )


@triton.jit
def _write_kv_ds_mla_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_ptr,
    stride_c,
    stride_pe,
    stride_row,
    num_slots,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TILE: tl.constexpr,
):
    """Program per new token: its ``fp8_ds_mla`` row at ``slot`` (skipped outside the cache):
    e4m3 latent tiles, their power-of-two float32 scales, the bf16 rope."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0 or slot >= num_slots:
        return
    tiles = tl.arange(0, BLOCK_T)
    lanes = tl.arange(0, TILE)
    offs = tiles[:, None] * TILE + lanes[None, :]
    t_ok = tiles < L // TILE
    x = tl.load(kv_c_ptr + n * stride_c + offs, mask=t_ok[:, None], other=0.0).to(tl.float32)
    scale, inverse = _pow2_scale(tl.max(tl.abs(x), 1))
    values = _e4m3_bytes(tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0))
    row = cache_ptr + slot * stride_row
    tl.store(row + offs, values, mask=t_ok[:, None])
    tl.store((row + L).to(tl.pointer_type(tl.float32)) + tiles, scale, mask=t_ok)
    offs_r = tl.arange(0, BLOCK_R)
    rope = tl.load(k_pe_ptr + n * stride_pe + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
    rope_ptr = (row + L + 4 * (L // TILE)).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr + offs_r, _round_bf16(rope), mask=offs_r < R)


WRITE_DS_MLA_LAUNCH = LaunchCache(_write_kv_ds_mla_kernel)


def write_kv_ds_mla(call: WriteKVCall) -> None:
    """Write new tokens' ``[kv_c | k_pe]`` into an ``fp8_ds_mla`` cache ``uint8 [blocks,
    block_size, L + 4 L/128 + 2 R]`` (the ``kv-write`` contract for that format)."""
    kv_c, k_pe, kv_cache, slot_mapping = call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping
    count, rank = kv_c.shape
    rope = k_pe.shape[1]
    if count == 0:
        return
    check_ds_mla_rows(kv_cache, rank, rope)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if flat.stride(-1) != 1 or kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise InvalidInputError("kv_cache", "kv_cache, kv_c and k_pe need a contiguous last dim")
    WRITE_DS_MLA_LAUNCH.launch(
        (count,),
        kv_c,
        k_pe,
        flat,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        flat.stride(0),
        flat.shape[0],
        L=rank,
        R=rope,
        BLOCK_T=triton.next_power_of_2(rank // DS_MLA_TILE),
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        TILE=DS_MLA_TILE,
        num_warps=4 if rank >= 256 else 1,
    )


# -- slot conversion ----------------------------------------------------------------------------


@triton.jit
def _convert_slots(
    indices_ptr, block_table_ptr, slots_ptr, t, j, K, stride_i_t, stride_s_t, stride_bt, row_keys, req,
    max_blocks, num_blocks, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Entries ``j`` of row ``t`` (request ``req``, ``row_keys`` visible positions) to slots:
    ``(valid, invalid)`` masks of ``j`` (invalid: neither valid nor ``-1``, to be counted)."""
    ok = j < K
    pos = tl.load(indices_ptr + t * stride_i_t + j, mask=ok, other=-1).to(tl.int64)
    in_range = ok & (pos >= 0) & (pos < row_keys) & (pos < max_blocks * BLOCK_SIZE)
    block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=in_range, other=-1).to(
        tl.int64
    )
    valid = in_range & (block >= 0) & (block < num_blocks)
    slot = tl.where(valid, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(slots_ptr + t * stride_s_t + j, slot.to(tl.int32), mask=ok)
    return valid, ok & (pos != -1) & ~valid


@triton.jit
def _sparse_slots_kernel(
    indices_ptr,
    block_table_ptr,
    row_request_ptr,
    row_keys_ptr,
    slots_ptr,
    count_ptr,
    lengths_ptr,
    K,
    stride_i_t,
    stride_s_t,
    stride_bt,
    last_request,
    max_blocks,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row ``t``, ``BLOCK`` entries), or with ``HAS_LENGTHS`` program (row ``t``) over
    all its entries: positions to slots, counting invalid entries (one atomic add per program
    that has any); with ``HAS_LENGTHS`` also ``lengths[t]``, ``1 +`` the last valid column."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    row_keys = tl.load(row_keys_ptr + t)
    # The request is clamped into the block table (memory safety, as the torch versions do).
    req = tl.minimum(tl.maximum(tl.load(row_request_ptr + t), 0), last_request).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if HAS_LENGTHS:
        # Per lane: 1 + the last valid column it saw, and its invalid entries.
        ends = tl.zeros([BLOCK], tl.int32)
        bad = tl.zeros([BLOCK], tl.int32)
        for j0 in range(0, K, BLOCK):
            j = j0 + offs
            valid, invalid = _convert_slots(
                indices_ptr, block_table_ptr, slots_ptr, t, j, K, stride_i_t, stride_s_t, stride_bt,
                row_keys, req, max_blocks, num_blocks, BLOCK_SIZE,
            )  # fmt: skip
            ends = tl.maximum(ends, tl.where(valid, j + 1, 0))
            bad += invalid.to(tl.int32)
        tl.store(lengths_ptr + t, tl.max(ends, 0))
    else:
        _, invalid = _convert_slots(
            indices_ptr, block_table_ptr, slots_ptr, t, tl.program_id(1) * BLOCK + offs, K, stride_i_t,
            stride_s_t, stride_bt, row_keys, req, max_blocks, num_blocks, BLOCK_SIZE,
        )  # fmt: skip
        bad = invalid.to(tl.int32)
    row_bad = tl.sum(bad, 0)
    if row_bad > 0:
        tl.atomic_add(count_ptr, row_bad)


SPARSE_SLOTS_LAUNCH = LaunchCache(_sparse_slots_kernel)


def sparse_slots(call: SparseSlotsCall) -> None:
    """:class:`~mla.providers.calls.SparseSlotsCall` as one launch: a program per (row, 1024
    entries), or per row (chunks of 2048) with a ``lengths`` output (int32 ``[T]``, stride 1;
    written for every row, 0 when ``K == 0``). Each entry is read and written by the same
    program, so ``slots`` may alias ``indices``."""
    indices, slots, table, lengths = call.indices, call.slots, call.block_table, call.lengths
    rows, topk = indices.shape
    if rows == 0:
        return
    check_lengths(lengths, rows, indices.device)
    if topk == 0:
        if lengths is not None:
            lengths.zero_()
        return
    if indices.stride(-1) != 1 or slots.stride(-1) != 1 or table.stride(-1) != 1:
        raise InvalidInputError("indices", "indices, slots and block_table need a contiguous last dim")
    # With lengths one program walks its row: up to 2048 entries (DeepSeek's top-k) in one step,
    # on 8 warps, as many entries per thread as the (row, 1024 entries) grid without lengths.
    block = min(1024 if lengths is None else 2048, max(16, triton.next_power_of_2(topk)))
    SPARSE_SLOTS_LAUNCH.launch(
        (rows, 1 if lengths is not None else triton.cdiv(topk, block)),
        indices,
        table,
        call.row_request,
        call.row_keys,
        slots,
        call.invalid_count,
        lengths if lengths is not None else slots,  # unused without HAS_LENGTHS
        topk,
        indices.stride(0),
        slots.stride(0),
        table.stride(0),
        max(table.shape[0] - 1, 0),
        table.shape[1] if table.shape[0] else 0,  # an empty table: no position is in range
        call.num_blocks,
        BLOCK_SIZE=call.block_size,
        BLOCK=block,
        HAS_LENGTHS=lengths is not None,
        **pdl_options(indices.device),
        num_warps=8 if block > 1024 else 4,
    )


__all__ = [
    "SparseLaunchConfig",
    "sparse_attention",
    "sparse_launch_config",
    "sparse_slots",
    "write_index_keys",
    "write_kv_ds_mla",
]
