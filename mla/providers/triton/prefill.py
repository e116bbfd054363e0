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

The inner loop (:func:`attend_key_blocks`) and the epilogue helpers are shared with the fp8
prefill kernel (:mod:`mla.providers.triton.fp8_prefill`).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import triton
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.calls import VarlenPrefillCall
from mla.providers.triton.interpreter import interpreting

LOG2E = 1.4426950408889634
"""``log2(e)``: scores are scaled into the exp2 domain."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
):
    """Online-softmax attention of one q block over key blocks ``[start, end)``.

    ``acc [BLOCK_M, BLOCK_DV]`` fp32, ``l_i``/``m_i [BLOCK_M]`` fp32 (``m_i`` in the exp2 domain);
    ``k_ptrs_*``/``v_ptrs`` point at key ``start``; ``row_last_key [BLOCK_M]`` is the last
    key each row may see (already clamped to ``num_keys - 1``). ``MASKED`` blocks apply
    ``row_last_key`` and the key bound; unmasked blocks must be fully visible to every row.
    Scores are ``dot(q, k) * qk_scale`` with ``qk_scale > 0`` (softmax scale times log2(e)).

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
        k_a = load_tile(k_ptrs_a, keys_ok, offs_da < D_QK, MASKED, D_QK < BLOCK_DA)
        s = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
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
            k_ptrs_b += BLOCK_N * stride_kt
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
):
    """A q block against keys ``0 .. num_keys - 1`` of a range whose key 0 is at ``K``/``V``
    (per-head base pointers). Row ``r`` of the block sees key ``n`` iff ``n <= r + shift``
    (``shift = num_keys - 1`` for full attention). Returns the updated ``(acc, l_i, m_i)``."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_last_key = tl.minimum(offs_m + shift, num_keys - 1)
    # keys < shift + 1 are visible to row 0, hence to every row of the block
    full_end = (tl.minimum(tl.maximum(shift + 1, 0), num_keys) // BLOCK_N) * BLOCK_N
    masked_end = tl.minimum(tl.maximum(shift + BLOCK_M, 0), num_keys)
    k_ptrs_a = K + offs_n[:, None] * stride_kt + tl.arange(0, BLOCK_DA)[None, :]
    if BLOCK_DB > 0:
        k_ptrs_b = K + offs_n[:, None] * stride_kt + (BLOCK_DA + tl.arange(0, BLOCK_DB))[None, :]
    else:
        k_ptrs_b = k_ptrs_a
    v_ptrs = V + offs_n[:, None] * stride_vt + tl.arange(0, BLOCK_DV)[None, :]
    acc, l_i, m_i = attend_key_blocks(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a, k_ptrs_b, v_ptrs, stride_kt, stride_vt,
        0, full_end, row_last_key, num_keys, qk_scale,
        D_QK, D_V, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, False, PV_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    skip = full_end.to(tl.int64)
    acc, l_i, m_i = attend_key_blocks(
        acc, l_i, m_i, q_a, q_b, k_ptrs_a + skip * stride_kt, k_ptrs_b + skip * stride_kt,
        v_ptrs + skip * stride_vt, stride_kt, stride_vt,
        full_end, masked_end, row_last_key, num_keys, qk_scale,
        D_QK, D_V, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV, True, PV_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def load_q_block(
    Q, stride_qt, rows_ok, D_QK: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The two head-dim chunks of a q block whose row 0 is at ``Q`` (``[BLOCK_M, BLOCK_DA]`` and
    ``[BLOCK_M, max(BLOCK_DB, 16)]``; the second is unused when ``BLOCK_DB == 0``)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_da = tl.arange(0, BLOCK_DA)
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


@triton.jit
def finalize_rows(acc, l_i, m_i, extra_scale):
    """``(out, lse)`` of a finished online softmax: ``out = acc * extra_scale / l`` (0 where no key
    was seen) and the natural-log LSE (``-inf`` there)."""
    seen = l_i != 0.0  # a NaN sum (a key the row sees is NaN) stays NaN
    inv_l = tl.where(seen, extra_scale / tl.where(seen, l_i, 1.0), 0.0)
    out = tl.where(seen[:, None], acc * inv_l[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def store_rows(Out, Lse, out, lse, stride_ot, stride_lt, rows_ok, D_V: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """Write a ``[BLOCK_M, BLOCK_DV]`` output block (row 0 at ``Out``) and its LSE (at ``Lse``)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = Out + offs_m[:, None] * stride_ot + offs_dv[None, :]
    if D_V < BLOCK_DV:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_ok[:, None] & (offs_dv < D_V)[None, :])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rows_ok[:, None])
    tl.store(Lse + offs_m * stride_lt, lse, mask=rows_ok)


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
):
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
        Q + q_row0 * stride_qt + h64 * stride_qh, stride_qt, rows_ok, D_QK, BLOCK_DA, BLOCK_DB, BLOCK_M
    )
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
    )  # fmt: skip
    out, lse = finalize_rows(acc, l_i, m_i, 1.0)
    store_rows(
        Out + q_row0 * stride_ot + h64 * stride_oh, Lse + q_row0 * stride_lt + h64 * stride_lh,
        out, lse, stride_ot, stride_lt, rows_ok, D_V, BLOCK_DV, BLOCK_M,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@attrs.frozen
class HeadDimBlocks:
    """How a head dim maps onto power-of-two Triton blocks (see the module docstring)."""

    block_a: int
    block_b: int
    block_v: int

    @classmethod
    def for_dims(cls, qk_dim: int, v_dim: int, *, min_k: int = 16) -> HeadDimBlocks:
        """``min_k``: the smallest dot reduction width the kernel's operand dtype allows (16 for
        16-bit operands, 32 for fp8 on sm_90); narrower head-dim pieces are padded (masked)."""
        block_a = max(min_k, 1 << (qk_dim.bit_length() - 1))
        rest = qk_dim - block_a
        block_b = max(min_k, triton.next_power_of_2(rest)) if rest > 0 else 0
        return cls(block_a, block_b, max(16, triton.next_power_of_2(v_dim)))


@attrs.frozen
class AttentionLaunchConfig:
    """Tile sizes and compiler knobs of one attention kernel launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=16)
def _device_arch(device: torch.device) -> tuple[str, int]:
    """``(vendor, major capability)``: ``("cpu", 0)`` for the interpreter, ``("amd", 0)`` on ROCm."""
    if device.type != "cuda":
        return ("cpu", 0)
    if torch.version.hip is not None:
        return ("amd", 0)
    return ("nvidia", torch.cuda.get_device_capability(device)[0])


def choose_varlen_config(
    device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, max_seqlen_q: int
) -> AttentionLaunchConfig:
    """Launch heuristic for :func:`varlen_attention_fwd` (no autotuning in the hot path).

    * CPU (Triton interpreter): 32 x 32 tiles, so tiny test shapes still cross block boundaries.
    * 32-bit inputs: 64 x 32 tiles, 4 warps (fp32 tiles are twice the bytes).
    * NVIDIA sm80+ and 16-bit inputs with ``Dqk, Dv <= 256``: 128 x 64 tiles, 8 warps,
      3 pipeline stages on sm90+ (2 below: 164 KB of shared memory on sm80). For 192/128 this
      holds Q (48 KB) plus three K/V stages (40 KB each) in shared memory, 255 registers, no
      spills. The best swept on all four shapes (192/128 causal bf16, H 16/128, 4 x 4096 and
      16 x 1024): 2 stages -18%, 128 x 128 (spills) -8%, 64 x 64 with 4 warps -30%, 4 stages no
      gain (``docs/performance.md``).
    * AMD and older NVIDIA: 64 x 64, 4 warps, 1 stage.
    * ``max_seqlen_q <= 64`` halves ``block_m`` to 64 (a 128-row block would be half empty).
    """
    vendor, major = _device_arch(device)
    if vendor == "cpu":
        return AttentionLaunchConfig(32, 32, 4, 1)
    if dtype == torch.float32:
        return AttentionLaunchConfig(64, 32, 4, 2)
    if vendor == "nvidia" and major >= 8 and qk_dim <= 256 and v_dim <= 256:
        block_m = 64 if max_seqlen_q <= 64 else 128
        return AttentionLaunchConfig(block_m, 64, 8 if block_m == 128 else 4, 3 if major >= 9 else 2)
    return AttentionLaunchConfig(64, 64, 4, 1)


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _check(name: str, tensor: torch.Tensor, ndim: int, *, last_contiguous: bool = True) -> None:
    if tensor.dim() != ndim:
        raise InvalidInputError(name, f"expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if last_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise InvalidInputError(name, "the last dim must be contiguous (stride 1); pass .contiguous()")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
) -> None:
    """Shape/dtype/device checks shared by the varlen and fp8 launchers (no host sync)."""
    for name, tensor in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check(name, tensor, 3)
    _check("lse", lse, 2, last_contiguous=False)
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape[1:] != (num_heads, qk_dim):
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {qk_dim}], got {tuple(k.shape)}")
    if v.shape[:2] != k.shape[:2]:
        raise InvalidInputError("v", f"expected [{k.shape[0]}, {num_heads}, Dv], got {tuple(v.shape)}")
    if out.shape != (num_tokens, num_heads, v.shape[2]):
        raise InvalidInputError(
            "out", f"expected {(num_tokens, num_heads, v.shape[2])}, got {tuple(out.shape)}"
        )
    if lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise InvalidInputError("lse", f"expected float32 {(num_tokens, num_heads)}, got {lse.dtype} "
                                f"{tuple(lse.shape)}")  # fmt: skip
    for name, index in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if index.dim() != 1 or index.dtype != torch.int32:
            raise InvalidInputError(
                name, f"expected a 1-D int32 tensor, got {index.dtype} {tuple(index.shape)}"
            )
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_seqlens_k.numel()} entries, cu_seqlens_q {cu_seqlens_q.numel()}"
        )
    devices = {t.device for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) != 1:
        raise InvalidInputError("q", f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out.dtype not in _FLOAT_DTYPES:
        raise InvalidInputError("out", f"dtype {out.dtype} is not one of {_FLOAT_DTYPES}")
    if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise InvalidInputError("softmax_scale", f"must be a positive finite float, got {softmax_scale}")


def varlen_attention_fwd(call: VarlenPrefillCall, *, config: AttentionLaunchConfig | None = None) -> None:
    """Varlen attention forward (the ``varlen-prefill`` contract).

    q ``[T, H, Dqk]``, k ``[Tk, H, Dqk]``, v ``[Tk, H, Dv]`` (fp16/bf16/fp32, one dtype, last dim
    contiguous), cu_seqlens int32 ``[B+1]``; writes out ``[T, H, Dv]`` (its own dtype) and lse
    fp32 ``[T, H]`` (natural log). ``max_seqlen_q`` sizes the grid (a host int, no sync);
    ``max_seqlen_k`` is accepted for the contract and unused (key loops read cu_seqlens_k).
    ``config`` overrides :func:`choose_varlen_config` (benchmarks sweep it).
    """
    q, k, v, out, lse = call.q, call.k, call.v, call.out, call.lse
    if q.dtype == torch.bfloat16 and interpreting() and q.shape[0]:
        # Triton's CPU interpreter computes bf16 dots wrongly (errors ~1e9): run the same
        # kernel in fp32 on widened copies (exact for bf16 inputs) and round the output once.
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        varlen_attention_fwd(
            attrs.evolve(call, q=q.float(), k=k.float(), v=v.float(), out=wide), config=config
        )
        out.copy_(wide)
        return
    cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
    max_seqlen_q, softmax_scale, causal = call.max_seqlen_q, call.softmax_scale, call.causal
    check_attention_args(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, softmax_scale)
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("q", f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    num_heads, qk_dim, v_dim = q.shape[1], q.shape[2], v.shape[2]
    batch = cu_seqlens_q.numel() - 1
    if q.shape[0] == 0 or batch <= 0 or max_seqlen_q <= 0:
        return
    blocks = HeadDimBlocks.for_dims(qk_dim, v_dim)
    cfg = config or choose_varlen_config(q.device, q.dtype, qk_dim, v_dim, max_seqlen_q)
    num_m_blocks = triton.cdiv(max_seqlen_q, cfg.block_m)
    fp32 = q.dtype == torch.float32
    grid = (num_m_blocks * batch * num_heads,)
    _varlen_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_heads, num_m_blocks, q.shape[0], k.shape[0], softmax_scale * LOG2E,
        D_QK=qk_dim, D_V=v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_DA=blocks.block_a, BLOCK_DB=blocks.block_b, BLOCK_DV=blocks.block_v,
        CAUSAL=causal, PV_DTYPE=triton_dtype(q.dtype), DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
