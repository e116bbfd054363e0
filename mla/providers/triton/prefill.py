# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Varlen flash-attention forward in Triton: q/k head dim ``Dqk``, v head dim ``Dv`` natively.

The MLA prefill shape is ``Dqk = 192`` (128 nope + 64 rope) and ``Dv = 128``. Triton blocks are
powers of two, so the q/k head dim is covered by two dot chunks: ``BLOCK_DA`` (the largest power
of two <= Dqk, 128 for 192) and ``BLOCK_DB`` (the rest rounded up to a power of two, 64 for 192);
neither is padded for 192/128. Any other head dims run with masked columns.

Kernel shape (FA2-style forward, one program per (q block, request, head)):

* online softmax in the exp2 domain (``softmax_scale * log2(e)`` folded into one FMA),
  normalisation deferred to the epilogue;
* key blocks fully visible to every row of the q block run without masks; only the blocks
  that straddle the causal diagonal or the end of the key range run the masked loop;
* causal is bottom-right aligned: row ``i`` of a request sees keys ``<= i + Sk - Sq``;
  rows that see no key get ``out = 0`` and ``lse = -inf``;
* the grid is flat with the q block index fastest and reversed, so the programs of one
  (request, head) run together (its K/V stays in L2) and the longest causal blocks start first.

The inner loop (:func:`attend_key_blocks`) and the epilogue helpers
(:mod:`.attention_epilogue`) are shared with the fp8 prefill kernel
(:mod:`mla.providers.triton.fp8_prefill`).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from mla.providers.calls import VarlenPrefillCall, appended_passes
from mla.providers.triton.attention_epilogue import finalize_rows, merge_prior_rows, store_rows
from mla.providers.triton.attention_host import (
    AttentionLaunchConfig,
    HeadDimBlocks,
    check_attention_args,
    check_varlen_call,
    choose_varlen_config,
    head_dim_blocks,
    split_key_blocks,
    triton_dtype,
)
from mla.providers.triton.host_math import cdiv
from mla.providers.triton.interpreter import interpreting
from mla.providers.triton.launch_cache import LaunchCache

LOG2E = 1.4426950408889634
"""``log2(e)``: scores are scaled into the exp2 domain."""

__all__ = [
    "LOG2E",
    "VARLEN_LAUNCH",
    "AttentionLaunchConfig",
    "HeadDimBlocks",
    "check_attention_args",
    "choose_varlen_config",
    "varlen_attention_fwd",
]


# --------------------------------------------------------------------------------------------
# Shared Triton helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """``tl.load`` of a 2-D tile, masked only along the dimensions that need it (0 elsewhere)."""
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def attend_key_blocks(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    k_ptrs_a,
    k_ptrs_b,
    v_ptrs,
    stride_kt,
    stride_kbt,
    stride_vt,
    start,
    end,
    row_last_key,
    num_keys,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE_DIM: tl.constexpr,
):
    """Online-softmax attention of one q block over key blocks ``[start, end)``.

    ``acc [BLOCK_M, BLOCK_DV]`` fp32, ``l_i``/``m_i [BLOCK_M]`` fp32 (``m_i`` in the exp2 domain);
    ``k_ptrs_*``/``v_ptrs`` point at key ``start``; ``row_last_key [BLOCK_M]`` is the last
    key each row may see (already clamped to ``num_keys - 1``). ``MASKED`` blocks apply
    ``row_last_key`` and the key bound; unmasked blocks must be fully visible to every row.
    Scores are ``dot(q, k) * qk_scale`` with ``qk_scale > 0`` (softmax scale times log2(e)).
    ``k_ptrs_b`` steps by ``stride_kbt`` (``stride_kt`` when both chunks are lanes of one key
    row). ``ROPE_DIM > 0``: chunk ``a`` is the ``D_QK - ROPE_DIM`` lanes of ``k`` and chunk
    ``b`` the ``ROPE_DIM`` lanes of the shared rope operand (:func:`attend_range`).

    In ``MASKED`` blocks one value tile serves rows that see different keys, so a value a row
    must not see could reach it as ``0 * NaN``: non-finite value lanes are multiplied as 0 and
    a row that does see such a value gets NaN added to its accumulator instead.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, BLOCK_DA)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + offs_n
        keys_ok = keys < num_keys
        if ROPE_DIM > 0:
            k_a = load_tile(k_ptrs_a, keys_ok, offs_da < D_QK - ROPE_DIM, MASKED, D_QK - ROPE_DIM < BLOCK_DA)
        else:
            k_a = load_tile(k_ptrs_a, keys_ok, offs_da < D_QK, MASKED, D_QK < BLOCK_DA)
        s = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
        if ROPE_DIM > 0:
            offs_pe = tl.arange(0, BLOCK_DB)
            k_b = load_tile(k_ptrs_b, keys_ok, offs_pe < ROPE_DIM, MASKED, ROPE_DIM != BLOCK_DB)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=DOT_PRECISION)
        elif BLOCK_DB > 0:
            offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
            k_b = load_tile(k_ptrs_b, keys_ok, offs_db < D_QK, MASKED, D_QK != BLOCK_DA + BLOCK_DB)
            s = tl.dot(q_b, tl.trans(k_b), s, input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(keys[None, :] <= row_last_key[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            # rows that have seen no key yet keep m = -inf; subtract 0 so exp2 gives 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s * qk_scale - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(v_ptrs, keys_ok, offs_dv < D_V, MASKED, D_V < BLOCK_DV)
        if MASKED:
            v32 = v.to(tl.float32)
            finite = v32 - v32 == 0.0
            key_bad = tl.max(tl.where(finite, 0.0, 1.0), 1)
            seen_bad = tl.where(keys[None, :] <= row_last_key[:, None], key_bad[None, :], 0.0)
            acc = acc + tl.where(tl.max(seen_bad, 1) > 0.0, float("nan"), 0.0)[:, None]
            v = tl.where(finite, v32, 0.0)
        acc = tl.dot(p.to(PV_DTYPE), v.to(PV_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs_a += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
        if BLOCK_DB > 0:
            k_ptrs_b += BLOCK_N * stride_kbt
    return acc, l_i, m_i


@triton.jit
def attend_range(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    K,
    V,
    stride_kt,
    stride_vt,
    num_keys,
    shift,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KPe,
    stride_pet,
    ROPE_DIM: tl.constexpr,
):
    """A q block against keys ``0 .. num_keys - 1`` of a range whose key 0 is at ``K``/``V``
    (per-head base pointers). Row ``r`` of the block sees key ``n`` iff ``n <= r + shift``
    (``shift = num_keys - 1`` for full attention). Returns the updated ``(acc, l_i, m_i)``.

    ``ROPE_DIM > 0``: ``K`` holds each key's first ``D_QK - ROPE_DIM`` lanes and its last
    ``ROPE_DIM`` lanes are read from ``KPe`` (key 0's rope row, shared by every head; rows
    ``stride_pet`` apart); ``0``: ``K`` holds whole keys (``KPe``/``stride_pet`` unused)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_last_key = tl.minimum(offs_m + shift, num_keys - 1)
    # keys < shift + 1 are visible to row 0, hence to every row of the block
    full_end = (tl.minimum(tl.maximum(shift + 1, 0), num_keys) // BLOCK_N) * BLOCK_N
    masked_end = tl.minimum(tl.maximum(shift + BLOCK_M, 0), num_keys)
    k_ptrs_a = K + offs_n[:, None] * stride_kt + tl.arange(0, BLOCK_DA)[None, :]
    if ROPE_DIM > 0:
        k_ptrs_b = KPe + offs_n[:, None] * stride_pet + tl.arange(0, BLOCK_DB)[None, :]
        stride_kbt = stride_pet
    elif BLOCK_DB > 0:
        k_ptrs_b = K + offs_n[:, None] * stride_kt + (BLOCK_DA + tl.arange(0, BLOCK_DB))[None, :]
        stride_kbt = stride_kt
    else:
        k_ptrs_b = k_ptrs_a
        stride_kbt = stride_kt
    v_ptrs = V + offs_n[:, None] * stride_vt + tl.arange(0, BLOCK_DV)[None, :]
    acc, l_i, m_i = attend_key_blocks(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs, stride_kt, stride_kbt, stride_vt,
        0, full_end, row_last_key, num_keys, qk_scale,
        D_QK, D_V, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, False, PV_DTYPE, DOT_PRECISION, ROPE_DIM,
    )  # fmt: skip
    skip = full_end.to(tl.int64)
    acc, l_i, m_i = attend_key_blocks(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a + skip * stride_kt, k_ptrs_b + skip * stride_kbt,
        v_ptrs + skip * stride_vt, stride_kt, stride_kbt, stride_vt,
        full_end, masked_end, row_last_key, num_keys, qk_scale,
        D_QK, D_V, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, True, PV_DTYPE, DOT_PRECISION, ROPE_DIM,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def load_q_block(
    Q, stride_qt, rows_ok, D_QK: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, ROPE_DIM: tl.constexpr,
):  # fmt: skip
    """The two head-dim chunks of a q block whose row 0 is at ``Q`` (``[BLOCK_M, BLOCK_DA]`` and
    ``[BLOCK_M, max(BLOCK_DB, 16)]``; the second is unused when ``BLOCK_DB == 0``).
    ``ROPE_DIM > 0``: the first ``D_QK - ROPE_DIM`` lanes, then the last ``ROPE_DIM`` (the keys'
    two operands, :func:`attend_range`)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_da = tl.arange(0, BLOCK_DA)
    if ROPE_DIM > 0:
        NOPE: tl.constexpr = D_QK - ROPE_DIM
        offs_pe = tl.arange(0, BLOCK_DB)
        q_a = load_tile(
            Q + offs_m[:, None] * stride_qt + offs_da[None, :], rows_ok, offs_da < NOPE, True, NOPE < BLOCK_DA
        )
        q_b = load_tile(
            Q + offs_m[:, None] * stride_qt + (NOPE + offs_pe)[None, :],
            rows_ok,
            offs_pe < ROPE_DIM,
            True,
            ROPE_DIM != BLOCK_DB,
        )
        return q_a, q_b
    q_a = load_tile(
        Q + offs_m[:, None] * stride_qt + offs_da[None, :], rows_ok, offs_da < D_QK, True, D_QK < BLOCK_DA
    )
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        q_b = load_tile(
            Q + offs_m[:, None] * stride_qt + offs_db[None, :],
            rows_ok,
            offs_db < D_QK,
            True,
            D_QK != BLOCK_DA + BLOCK_DB,
        )
    else:
        q_b = q_a
    return q_a, q_b


# --------------------------------------------------------------------------------------------
# The varlen kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def indptr_range(cu_seqlens, b, num_rows):
    """Request ``b``'s rows ``[begin, begin + length)`` from an indptr, clamped into
    ``[0, num_rows]`` (a bad indptr reads and writes no row outside the tensor: the call that
    launched the kernel checks the values and raises)."""
    begin = tl.minimum(tl.maximum(tl.load(cu_seqlens + b), 0), num_rows)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens + b + 1), begin), num_rows)
    return begin, end - begin


@triton.jit
def _varlen_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    CuSeqlensQ,
    CuSeqlensK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    num_heads,
    num_m_blocks,
    num_q_rows,
    num_k_rows,
    qk_scale,
    KPe,
    stride_pet,
    PriorOut,
    PriorLse,
    stride_pot,
    stride_poh,
    stride_plt,
    stride_plh,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    PV_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    MERGE: tl.constexpr,
):
    # ROPE_DIM > 0: K is [Tk, H, D_QK - ROPE_DIM] and every head's rope lanes are KPe's rows;
    # MERGE: the result is merged into PriorOut/PriorLse's rows (merge_prior_rows). Both off
    # (None pointers, 0 strides), the kernel is the plain varlen attention.
    pid = tl.program_id(0)
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    batch_head = pid // num_m_blocks
    b = batch_head // num_heads
    h = batch_head % num_heads
    q_begin, seq_q = indptr_range(CuSeqlensQ, b, num_q_rows)
    m0 = m_block * BLOCK_M
    if m0 >= seq_q:
        return
    k_begin, seq_k = indptr_range(CuSeqlensK, b, num_k_rows)
    rows_ok = m0 + tl.arange(0, BLOCK_M) < seq_q
    q_row0 = (q_begin + m0).to(tl.int64)
    h64 = h.to(tl.int64)
    q_a, q_b = load_q_block(
        Q + q_row0 * stride_qt + h64 * stride_qh, stride_qt, rows_ok, D_QK, BLOCK_DA, BLOCK_DB, BLOCK_M,
        ROPE_DIM,
    )  # fmt: skip
    shift = m0 + seq_k - seq_q if CAUSAL else seq_k - 1
    k_row0 = k_begin.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = attend_range(
        acc, l_i, m_i, q_a, q_b,
        K + k_row0 * stride_kt + h64 * stride_kh, V + k_row0 * stride_vt + h64 * stride_vh,
        stride_kt, stride_vt, seq_k, shift, qk_scale,
        D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, PV_DTYPE, DOT_PRECISION,
        KPe + k_row0 * stride_pet if ROPE_DIM > 0 else KPe, stride_pet, ROPE_DIM,
    )  # fmt: skip
    if MERGE:
        out, lse = merge_prior_rows(
            acc, l_i, m_i, PriorOut + q_row0 * stride_pot + h64 * stride_poh,
            PriorLse + q_row0 * stride_plt + h64 * stride_plh, stride_pot, stride_plt, rows_ok,
            D_V, BLOCK_DV, BLOCK_M,
        )  # fmt: skip
    else:
        out, lse = finalize_rows(acc, l_i, m_i, 1.0)
    store_rows(
        Out + q_row0 * stride_ot + h64 * stride_oh, Lse + q_row0 * stride_lt + h64 * stride_lh,
        out, lse, stride_ot, stride_lt, rows_ok, D_V, BLOCK_DV, BLOCK_M,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side (the shared helpers: :mod:`.attention_host`)
# --------------------------------------------------------------------------------------------

VARLEN_LAUNCH = LaunchCache(_varlen_fwd_kernel)
"""The varlen kernel's launches: through the compiled kernel after the first of each
specialization (:mod:`.launch_cache`; a prefill call is this one launch)."""
_INTERPRETED = interpreting()
"""Whether the kernels above run in the interpreter (decided when they were decorated, at
import: read once here instead of the environment on every launch)."""


def varlen_attention_fwd(call: VarlenPrefillCall, *, config: AttentionLaunchConfig | None = None) -> None:
    """Varlen attention forward (the ``varlen-prefill`` contract).

    q ``[T, H, Dqk]``, k ``[Tk, H, Dqk]``, v ``[Tk, H, Dv]`` (fp16/bf16/fp32, one dtype, last dim
    contiguous), cu_seqlens int32 ``[B+1]``; writes out ``[T, H, Dv]`` (its own dtype) and lse
    fp32 ``[T, H]`` (natural log). ``max_seqlen_q`` sizes the grid (a host int, no sync);
    ``max_seqlen_k`` is accepted for the contract and unused (key loops read cu_seqlens_k).
    ``config`` overrides :func:`choose_varlen_config` (benchmarks sweep it). The argument checks
    are skipped for a ``call.checked`` call; the launch goes through :data:`VARLEN_LAUNCH`.

    The call's chunked-context forms are constexpr branches of the same kernel (a plain call
    compiles to the plain kernel): ``k_pe`` (``k`` then ``[Tk, H, Dqk - R]``, any token/head
    strides) is read as the keys' last ``R`` lanes by every head (the q/k dot runs as a
    ``Dqk - R`` chunk over ``k`` and an ``R`` chunk over ``k_pe``); ``prior_out``/``prior_lse``
    are merged into in the epilogue (:func:`merge_prior_rows`), in place when they are
    ``out``/``lse``. ``appended`` keys run as the two passes of
    :func:`~mla.providers.calls.appended_passes`.
    """
    if call.appended is not None:
        # (no appended form in the kernel) its two passes, both checked before either runs
        if not call.checked:
            check_varlen_call(call)
        for part in appended_passes(call):
            varlen_attention_fwd(attrs.evolve(part, checked=True), config=config)
        return
    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    k_pe, prior_out, prior_lse = call.k_pe, call.prior_out, call.prior_lse
    if q.dtype == torch.bfloat16 and _INTERPRETED and q.shape[0]:
        # Triton's CPU interpreter computes bf16 dots wrongly (errors ~1e9): run the same
        # kernel in fp32 on widened copies (exact for bf16 inputs) and round the output once.
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        widened = attrs.evolve(
            call, q=q.float(), k=k.float(), v=v.float(), out=wide,
            k_pe=None if k_pe is None else k_pe.float(),
            prior_out=None if prior_out is None else prior_out.float(),
        )  # fmt: skip
        varlen_attention_fwd(widened, config=config)
        out.copy_(wide)
        return
    cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
    max_seqlen_q, softmax_scale, causal = call.max_seqlen_q, call.softmax_scale, call.causal
    if not call.checked:  # (a call of this signature passed them before: VarlenPrefillCall.checked)
        check_varlen_call(call)
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[2]
    batch = cu_seqlens_q.numel() - 1
    if num_tokens == 0 or batch <= 0 or max_seqlen_q <= 0:
        return
    if k_pe is None:
        blocks, rope, pe_st = head_dim_blocks(qk_dim, v_dim), 0, 0
    else:
        rope, pe_st = k_pe.shape[1], k_pe.stride(0)
        blocks = split_key_blocks(qk_dim - rope, rope, v_dim)
    merge = prior_out is not None and prior_lse is not None
    po_st = prior_out.stride() if merge and prior_out is not None else (0, 0, 0)
    pl_st = prior_lse.stride() if merge and prior_lse is not None else (0, 0)
    cfg = config or choose_varlen_config(q.device, q.dtype, qk_dim, v_dim, max_seqlen_q)
    num_m_blocks = cdiv(max_seqlen_q, cfg.block_m)
    fp32 = q.dtype == torch.float32
    q_st, k_st, v_st, o_st, l_st = q.stride(), k.stride(), v.stride(), out.stride(), lse.stride()
    VARLEN_LAUNCH.launch(
        (num_m_blocks * batch * num_heads,),
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        q_st[0], q_st[1], k_st[0], k_st[1], v_st[0], v_st[1], o_st[0], o_st[1], l_st[0], l_st[1],
        num_heads, num_m_blocks, num_tokens, k.shape[0], softmax_scale * LOG2E,
        k_pe, pe_st, prior_out, prior_lse, po_st[0], po_st[1], pl_st[0], pl_st[1],
        D_QK=qk_dim, D_V=v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_DA=blocks.block_a, BLOCK_DB=blocks.block_b, BLOCK_DV=blocks.block_v,
        CAUSAL=causal, PV_DTYPE=triton_dtype(q.dtype), DOT_PRECISION="ieee" if fp32 else "tf32",
        ROPE_DIM=rope, MERGE=merge, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
