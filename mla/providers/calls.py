"""The kernel contracts as call records: one frozen record per provider method.

A strategy builds the record (once per step where its tensors are plan buffers, otherwise per
run) and hands it to the provider method of the same contract, e.g.
``provider.paged_mqa_decode(PagedDecodeCall(...))``. Records hold tensors and the Python ints and
floats a kernel needs; they never hold values a kernel would have to read back to the host.
(The pattern of one ``Inputs`` record per operator comes from xformers' memory-efficient
attention.)

Conventions shared by every record:

* ``T`` query tokens, ``B`` requests, ``H`` heads, ``L`` = kv_lora_rank, ``R`` = rope dim.
* LSE tensors are float32 ``[T, H]`` in natural log. A row with no keys gets ``o = 0`` and
  ``lse = -inf``.
* Indptr/index tensors are int32 on the device of the data.
* ``kv_scale`` is the per-tensor dequant scale of an fp8 cache as a float32 one-element tensor
  on the data's device (``None`` for a float cache): the cache value is ``stored * kv_scale``.
  Kernels read it on the device, so a captured CUDA graph replays with the current value.
* Device-side calls (everything but :class:`DecodeScheduleBuffersCall` and
  :class:`Fp8PrefillPlanCall`) perform no host-device synchronisation and no allocation whose
  size depends on tensor values; the sizes they need arrive as Python ints from the plan.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from mla.core.platform import Platform


class DecodeSchedule(Protocol):
    """A provider's persistent decode schedule: fixed buffers allocated once by
    ``decode_schedule_buffers`` and re-planned in place by ``plan_decode_schedule`` each step.

    Each provider takes only its own schedule type and raises
    :class:`~mla.core.errors.PlanMismatchError` for another one, or for a step that does not fit.
    """

    @property
    def max_batch(self) -> int:
        """Most requests a step planned into these buffers may have."""
        ...


# -- decode -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class PagedDecodeCall:
    """Asm-style paged MQA decode (contract ``paged-decode``).

    Query row ``i`` of request ``b`` (``q_b`` rows, ``s_b = kv_indptr[b+1] - kv_indptr[b]``
    keys) attends keys ``0 .. s_b - q_b + i`` of its request. Key position ``p`` of request
    ``b`` is a cache row given one of two ways (exactly one of ``kv_indices`` and
    ``block_table`` is set):

    * ``block_table`` (providers whose record says ``decode_reads_block_table``): cache row
      ``block_table[b, p // page_size] * page_size + p % page_size``; a block id outside
      ``[0, N_tok // page_size)`` is masked (no memory read, no key), never clamped;
    * ``kv_indices``: the flat per-token view, cache row ``kv_indices[kv_indptr[b] + p]``.
    """

    q: torch.Tensor
    """``[Tk, Hk, L+R]`` in the model dtype, contiguous."""
    kv_cache: torch.Tensor
    """Flat cache ``[N_tok, L+R]`` (a float dtype, or fp8 with ``kv_scale``)."""
    kv_indptr: torch.Tensor
    """int32 ``[B+1]``: request ``b`` has ``kv_indptr[b+1] - kv_indptr[b]`` keys (with
    ``kv_indices``: it reads ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``)."""
    kv_indices: torch.Tensor | None
    """int32 flat cache row ids (a persistent buffer; entries past ``kv_indptr[B]`` are unused),
    or ``None`` when ``block_table`` is given. Each request's ids come in runs of ``page_size``
    consecutive rows starting at request positions that are multiples of ``page_size`` (one run
    per cache block; the last may be partial)."""
    qo_indptr: torch.Tensor
    """int32 ``[B+1]``: query rows per request."""
    out: torch.Tensor
    """``[Tk, Hk, L]`` in q's dtype."""
    lse: torch.Tensor | None
    """``[Tk, Hk]`` float32, or ``None``: no LSE wanted, the provider may skip every LSE-only
    computation (split-KV partial LSEs it needs to reduce ``out`` are unaffected)."""
    max_qlen: int
    """The largest ``qo_indptr`` step (the kernel qlen)."""
    max_seqlen_k: int
    """Static bound on any request's KV length (the engine's ``max_model_len``, so a captured
    graph stays valid as sequences grow)."""
    page_size: int
    """Cache block size in tokens: the run length of ``kv_indices``."""
    softmax_scale: float
    kv_scale: torch.Tensor | None
    """float32 ``[1]`` dequant scale of an fp8 cache, or ``None``."""
    schedule: DecodeSchedule | None = None
    """The provider's persistent schedule planned for this step (its split-KV path), or
    ``None`` (non-persistent)."""
    block_table: torch.Tensor | None = None
    """int32 ``[B, max_blocks]`` (last dim contiguous): the engine's block table, read by the
    kernel (one block id per page of keys), or ``None`` (``kv_indices`` is given). Every
    request's key count is at most ``max_blocks * page_size``."""


@attrs.frozen(kw_only=True, eq=False)
class DecodeScheduleBuffersCall:
    """Allocate a persistent decode schedule, once at init (contract ``decode-schedule``).

    The same kernel heads, kernel qlen bound and dtypes must reach every
    :class:`PlanDecodeScheduleCall` and :class:`PagedDecodeCall` using the schedule.
    """

    max_batch: int
    max_kernel_qlen: int
    kernel_heads: int
    kv_lora_rank: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    platform: Platform
    device: torch.device


@attrs.frozen(kw_only=True, eq=False)
class PlanDecodeScheduleCall:
    """Fill ``schedule`` on the device for this step's indptrs, no host sync (contract
    ``decode-schedule``)."""

    schedule: DecodeSchedule
    qo_indptr: torch.Tensor
    """int32 ``[B+1]`` kernel rows per request."""
    kv_indptr: torch.Tensor
    """int32 ``[B+1]``."""
    batch_size: int
    """``B``."""
    kernel_qlen: int
    uniform_qlen: bool
    """Every request (graph padding included) has exactly ``kernel_qlen`` rows, so a planner
    may take the row count as a constant."""


@attrs.frozen(kw_only=True, eq=False)
class SmallHeadDecodeCall:
    """Gluon-style decode (contract ``small-head-decode``): each of the ``T`` rows is an
    independent qlen-1 decode over its own keys: row ``t`` has ``seq_info[t+1] - seq_info[t]``
    keys, given one of two ways (exactly one of ``page_table`` and ``block_table`` is set):

    * ``block_table``: key ``j`` of row ``t`` is cache row ``block_table[r, j // page_size] *
      page_size + j % page_size`` with ``r = row_request[t]`` (``r = t`` without
      ``row_request``): the rows of one request read its block-table row, each its own prefix
      (a verify row's causal window), with no per-token list; a block id outside the cache is
      masked;
    * ``page_table``: key ``j`` of row ``t`` is ``page_table[seq_info[t] + j]``.
    """

    q_nope: torch.Tensor
    """``[T, H, L]`` (a strided view of the ``[T, H, L+R]`` query; last dim contiguous)."""
    q_pe: torch.Tensor
    """``[T, H, R]`` (likewise a view)."""
    kv_cache: torch.Tensor
    """Flat cache ``[N_tok, L+R]``."""
    page_table: torch.Tensor | None
    """int32 flat cache row ids, or ``None`` when ``block_table`` is given. Each row's ids are a
    prefix of its request's page list, so they come in runs of ``page_size`` consecutive rows
    starting at row positions that are multiples of ``page_size``."""
    seq_info: torch.Tensor
    """int32 ``[T+1]`` indptr of the rows' key counts (into ``page_table`` when given; rows at
    most ``max_seqlen_k`` long)."""
    out: torch.Tensor
    """``[T, H, L]`` in q's dtype."""
    lse: torch.Tensor | None
    """``[T, H]`` float32, or ``None`` (no LSE wanted: the provider may skip computing it)."""
    max_seqlen_k: int
    page_size: int
    """Cache block size in tokens: the run length of ``page_table``."""
    softmax_scale: float
    kv_scale: torch.Tensor | None
    """float32 ``[1]`` dequant scale of an fp8 cache, or ``None``."""
    block_table: torch.Tensor | None = None
    """int32 ``[B, max_blocks]`` (last dim contiguous), or ``None`` (``page_table`` is given).
    A row's key count is at most ``max_blocks * page_size``."""
    row_request: torch.Tensor | None = None
    """int32 ``[T]``: the block-table row of each query row (in ``[0, B)``), or ``None``: row
    ``t`` reads block-table row ``t`` (one row per request). Only with ``block_table``."""


# -- prefill ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class VarlenPrefillCall:
    """Flash-style varlen attention (contract ``varlen-prefill``). Causal is bottom-right
    aligned: row ``i`` of a request sees keys ``<= i + Sk - Sq``."""

    q: torch.Tensor
    """``[T, H, Dqk]``."""
    k: torch.Tensor
    """``[Tk, H, Dqk]`` in q's dtype."""
    v: torch.Tensor
    """``[Tk, H, Dv]`` in q's dtype."""
    cu_seqlens_q: torch.Tensor
    """int32 ``[B+1]``."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[B+1]``."""
    out: torch.Tensor
    """``[T, H, Dv]``."""
    lse: torch.Tensor
    """``[T, H]`` float32."""
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool
    checked: bool = False
    """``True``: the caller vouches that a call of the same signature (every tensor's shape,
    strides, dtype and device, and ``softmax_scale``) passed this provider's argument checks
    before, so the provider may skip them (:func:`mla.mla_prefill` sets it from the second
    call of a signature on a plan: its door checks the rest). Direct callers leave it
    ``False``."""


@attrs.frozen(kw_only=True, eq=False)
class Fp8PrefillPlanCall:
    """Host-side tile schedule of the fp8 prefill, at build time; may read the host tensors
    (contract ``fp8-prefill``)."""

    cu_seqlens_q_cpu: torch.Tensor
    """int ``[B+1]`` on the host."""
    cu_seqlens_k_cpu: torch.Tensor
    """int ``[B+1]`` on the host."""
    num_heads: int
    causal: bool
    platform: Platform
    device: torch.device


@attrs.frozen(kw_only=True, eq=False)
class Fp8PrefillCall:
    """FP8 persistent prefill (contract ``fp8-prefill``): the :class:`VarlenPrefillCall` math
    over fp8 q/k/v whose values are ``stored * scale``."""

    q: torch.Tensor
    """``[T, H, Dqk]`` fp8."""
    k: torch.Tensor
    """``[Tk, H, Dqk]`` fp8."""
    v: torch.Tensor
    """``[Tk, H, Dv]`` fp8."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    out: torch.Tensor
    """``[T, H, Dv]`` (its own dtype)."""
    lse: torch.Tensor
    """``[T, H]`` float32."""
    schedule: object
    """The provider's plan from ``plan_fp8_prefill`` for these cu_seqlens."""
    softmax_scale: float
    q_scale: torch.Tensor
    """float32 one-element tensors (the per-tensor dequant scales)."""
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    causal: bool


# -- utilities --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class MergeStatesCall:
    """``lse* = logaddexp(lse_a, lse_b)``, ``o = e^(lse_a-lse*) o_a + e^(lse_b-lse*) o_b``
    (contract ``merge-states``). Rows where both are ``-inf`` give ``o = 0``, ``lse = -inf``;
    ``out`` may alias ``o_a`` or ``o_b``."""

    o_a: torch.Tensor
    """``[T, H, D]``."""
    lse_a: torch.Tensor
    """``[T, H]`` float32."""
    o_b: torch.Tensor
    lse_b: torch.Tensor
    out: torch.Tensor
    """``[T, H, D]``."""
    lse_out: torch.Tensor | None = None
    """``[T, H]`` float32, or ``None`` (merged LSE not wanted)."""


@attrs.frozen(kw_only=True, eq=False)
class ExpandPagesCall:
    """Block table to flat token ids (contract ``expand-pages``):
    ``out[kv_indptr[r] + t] = block_table[r, t // bs] * bs + t % bs`` for every request ``r``
    and ``t < kv_indptr[r+1] - kv_indptr[r]``."""

    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``."""
    kv_indptr: torch.Tensor
    """int32 ``[B+1]``."""
    out: torch.Tensor
    """int32 flat ids (at least ``num_tokens`` long)."""
    block_size: int
    """``bs``, the cache block size in tokens."""
    num_tokens: int
    """``kv_indptr[-1]`` (a host int known at build time)."""


@attrs.frozen(kw_only=True, eq=False)
class FillPagesCall:
    """A step's page indices planned from the device lengths (part of contract
    ``expand-pages``; :meth:`KernelProvider.fill_page_indices` has a torch default, a provider
    may fuse it into one kernel). With ``len_b = clamp(seq_lens[b], 0, max_len)``:

    * ``kv_indptr[0] = 0``, ``kv_indptr[b+1] = len_0 + ... + len_b``;
    * ``kv_indices[kv_indptr[b] + t] = blk * bs + t % bs`` for ``t < len_b``, where ``blk`` is
      ``block_table[b, t // bs]``; -1 for a block outside ``[0, num_blocks)`` (when given),
      a negative one or an id past int32 (readers mask it: never clamped into another block).
      With ``kv_indices=None`` (kernels that read the block table) only ``kv_indptr`` (and
      ``qo_indptr``, ``invalid_count``) are written: the work is per page, not per token;
    * ``invalid_count`` (when given) grows by the number of tokens ``t < len_b`` whose block is
      outside the cache as above (the keys the kernels mask).

    Entries of ``kv_indices`` past ``kv_indptr[B]`` are unspecified (the last entry of the
    buffer may be written as scratch). No host sync; the work is sized by ``max_len``.
    """

    seq_lens: torch.Tensor
    """int32/int64 ``[B]`` on the device."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``, last dim contiguous."""
    kv_indptr: torch.Tensor
    """int32 ``[B+1]`` (written)."""
    kv_indices: torch.Tensor | None
    """int32, at least ``B * max_len + 1`` long (written), or ``None``: no per-token ids."""
    block_size: int
    """``bs``, the cache block size in tokens."""
    max_len: int
    """Bound on each request's length, ``<= max_blocks * bs``: a static bound (the block
    table's capacity, the engine's ``max_model_len``) or the step's longest length when the
    host knows it."""
    num_blocks: int | None
    """Blocks in the cache, when known (ids of blocks past it are written as -1)."""
    compact: bool = False
    """Leave tokens outside the cache out of their request's range instead of marking them:
    ``kv_indptr`` counts each request's tokens inside the cache and ``kv_indices`` holds only
    those, in order (for kernels that read every id they are given, such as aiter's: a token
    left out is no key, as a masked one is; only with ``kv_indices``). Only tokens the
    fill can tell are outside (a negative block id, or one past ``num_blocks``) are left out."""
    query_start_loc: torch.Tensor | None = None
    """int ``[B+1]`` on the device, copied into ``qo_indptr`` by the same launch (a strategy's
    own copy of the query indptr), or ``None``."""
    qo_indptr: torch.Tensor | None = None
    """int32 ``[B+1]`` (written when ``query_start_loc`` is given)."""
    invalid_count: torch.Tensor | None = None
    """int32 ``[1]`` device counter the masked tokens are added to (the backend's
    ``invalid_index_count``), or ``None``."""


@attrs.frozen(kw_only=True, eq=False)
class WriteKVCall:
    """Write new tokens' ``[kv_c | k_pe]`` rows into the paged cache (contract ``kv-write``);
    an fp8 cache stores ``value / kv_scale``."""

    kv_c: torch.Tensor
    """``[N, L]``."""
    k_pe: torch.Tensor
    """``[N, R]``."""
    kv_cache: torch.Tensor
    """``[blocks, block_size, L+R]``, or ``[blocks, block_size, 656]`` uint8 for an
    ``fp8_ds_mla`` cache (:func:`mla.providers.formats.pack_ds_mla`: per-tile power-of-two
    scales computed from the row itself; ``kv_scale`` is ``None`` then)."""
    slot_mapping: torch.Tensor
    """``[N]`` flat slots (negative or past the cache = skip, so a bad slot cannot write outside
    the cache)."""
    kv_scale: torch.Tensor | None
    """float32 ``[1]`` quantization scale of an fp8 cache, or ``None``."""


# -- sparse (DeepSeek Sparse Attention) ----------------------------------------------------------


@attrs.frozen(kw_only=True, eq=False)
class SparseAttentionCall:
    """Sparse MLA in the absorbed MQA form (contract ``sparse-attention``).

    Query row ``t`` attends exactly the cache rows ``slots[t, :]`` that are ``>= 0`` (a row's
    slots are distinct; ``-1`` pads): ``s = (q_t . k) * softmax_scale`` over those rows,
    ``o_t = softmax(s) @ v`` with ``v`` the first ``L`` lanes of each row, ``lse_t =
    logsumexp(s)``. A row with no slot gets ``o = 0`` and ``lse = -inf``. Which tokens a row
    sees (causality, the indexer's choice) is entirely in ``slots``.
    """

    q: torch.Tensor
    """``[T, H, L+R]`` in the model dtype, contiguous."""
    kv_cache: torch.Tensor
    """Flat cache ``[N_tok, W]``: a float dtype (``W = L+R``), fp8 e4m3 with ``kv_scale``
    (``W = L+R``), or uint8 ``fp8_ds_mla`` rows (``W = L + 4 L/128 + 2 R``)."""
    slots: torch.Tensor
    """int32 ``[T, K]`` flat cache row ids, ``-1`` for none (a slot past the cache is invalid
    too and never read); may be a view with a contiguous last dim."""
    out: torch.Tensor
    """``[T, H, L]`` in q's dtype."""
    lse: torch.Tensor | None
    """``[T, H]`` float32, or ``None`` (not wanted)."""
    kv_lora_rank: int
    rope_dim: int
    softmax_scale: float
    kv_scale: torch.Tensor | None
    """float32 ``[1]`` dequant scale of a per-tensor fp8 cache, else ``None``."""


@attrs.frozen(kw_only=True, eq=False)
class SparseSlotsCall:
    """Request-local token positions to cache slots, on the device (no host sync).

    ``slots[t, j] = block_table[row_request[t], p // block_size] * block_size + p % block_size``
    for ``p = indices[t, j]`` with ``0 <= p < row_keys[t]`` and a block id inside the cache;
    ``-1`` otherwise. Entries that are neither ``-1`` nor valid (a position the row may not see,
    a block id outside the cache) become ``-1`` too and are added to ``invalid_count``: a bad
    index never reads another request's rows.
    """

    indices: torch.Tensor
    """int32 ``[T, K]`` request-local positions, ``-1`` pads."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]``."""
    row_request: torch.Tensor
    """int32 ``[T]``: the request (block-table row) of each query row (clamped to the table)."""
    row_keys: torch.Tensor
    """int32 ``[T]``: positions ``0 .. row_keys[t] - 1`` are visible to row ``t`` (causal);
    0 for graph-padding rows."""
    block_size: int
    num_blocks: int
    """Blocks in the cache the slots index (the run's cache tensor)."""
    slots: torch.Tensor
    """int32 ``[T, K]`` output (may be ``indices`` itself, converted in place)."""
    invalid_count: torch.Tensor
    """int32 ``[1]`` device counter, incremented by the number of invalid entries."""


@attrs.frozen(kw_only=True, eq=False)
class IndexTopkCall:
    """The lightning indexer's scores and top-k over a paged index-key cache (contract ``indexer``).

    ``score[t, p] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . key(p))`` for the
    positions ``p < row_keys[t]`` of row ``t``'s request (``key(p)`` read through
    ``block_table[row_request[t]]``, fp8 keys dequantized by their per-token scale);
    ``indices[t]`` gets the ``min(topk, row_keys[t], max_keys)`` positions of highest score in
    descending score order, then ``-1`` (a position whose block id is outside the cache or past
    the block table is not scored, so such a row keeps fewer). Ties may break either way.
    """

    q: torch.Tensor
    """``[T, Hi, D]`` index queries (after their rope), float dtype."""
    weights: torch.Tensor
    """``[T, Hi]`` float32 per-head weights (the model's, e.g. ``weights_proj(x) * Hi ** -0.5``)."""
    index_cache: torch.Tensor
    """``[blocks, block_size, D]`` of a float dtype, or uint8 ``[blocks, block_size, D + 4]``
    fp8 keys with per-token scales (:class:`mla.core.config.IndexerSpec`)."""
    key_dtype: torch.dtype
    """The keys' dtype (``float8_e4m3fn`` for the byte layout)."""
    block_table: torch.Tensor
    row_request: torch.Tensor
    """int32 ``[T]``."""
    row_keys: torch.Tensor
    """int32 ``[T]`` visible positions per row (0: none, e.g. graph padding)."""
    max_keys: int
    """Static bound on ``row_keys`` (sizes the work; no host read of ``row_keys``)."""
    softmax_scale: float
    topk: int
    indices: torch.Tensor
    """int32 ``[T, topk]`` output: request-local positions, ``-1`` pads."""


@attrs.frozen(kw_only=True, eq=False)
class WriteIndexKeysCall:
    """Write new tokens' index keys into the index-key cache (contract ``indexer``); fp8 keys
    are quantized per token with a power-of-two scale (:func:`mla.providers.formats.quantize_index_keys`)."""

    keys: torch.Tensor
    """``[N, D]`` float (after the key norm and rope)."""
    index_cache: torch.Tensor
    key_dtype: torch.dtype
    slot_mapping: torch.Tensor
    """``[N]`` flat slots (negative or past the cache = skip)."""


__all__ = [
    "DecodeSchedule",
    "DecodeScheduleBuffersCall",
    "ExpandPagesCall",
    "FillPagesCall",
    "Fp8PrefillCall",
    "Fp8PrefillPlanCall",
    "IndexTopkCall",
    "MergeStatesCall",
    "PagedDecodeCall",
    "PlanDecodeScheduleCall",
    "SmallHeadDecodeCall",
    "SparseAttentionCall",
    "SparseSlotsCall",
    "VarlenPrefillCall",
    "WriteIndexKeysCall",
    "WriteKVCall",
]
