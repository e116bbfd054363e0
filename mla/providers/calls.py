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
from mla.providers.sparse_calls import (
    IndexTopkCall,
    SparseAttentionCall,
    SparseSlotsCall,
    WriteIndexKeysCall,
)


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
    aligned: row ``i`` of a request sees keys ``<= i + Sk - Sq``.

    Three optional forms serve a chunked-context step, only on providers whose record says
    :attr:`~mla.core.capabilities.ProviderCapabilities.varlen_context_operands`:

    * ``k_pe`` given: the keys' last ``R`` lanes come from ``k_pe [Tk, R]``, shared by every
      head, and ``k`` holds only the first ``Dqk - R`` lanes (``[Tk, H, Dqk - R]``, e.g. a strided
      view of an up-projection's output), so no ``[Tk, H, Dqk]`` key tensor is assembled;
    * ``prior_out``/``prior_lse`` given: the attention of this call is merged by LSE into that
      earlier state of the same rows (the :class:`MergeStatesCall` rule, a state with
      ``lse = -inf`` contributing nothing whatever its rows hold) and the merged state is written
      to ``out``/``lse``; they may be the very tensors ``out``/``lse`` (merged in place: each
      row is read before it is written), so no separate merge pass is needed;
    * ``appended`` given (:class:`AppendedKeys`): each request's keys continue with its rows of
      a second key range (the new tokens' own keys, in the pass of a context chunk), so the
      chunk and the new tokens are one pass. Every row then sees all of its request's ``k``
      keys, and the appended keys by the call's ``causal`` rule over the appended range alone
      (row ``i`` sees appended key ``j <= i + Sa - Sq``): the context keys precede every new
      token. :func:`appended_passes` gives the same result as two calls.
    """

    q: torch.Tensor
    """``[T, H, Dqk]``."""
    k: torch.Tensor
    """``[Tk, H, Dqk]`` in q's dtype (``[Tk, H, Dqk - R]`` with ``k_pe``); any token and head
    strides with a contiguous last dim."""
    v: torch.Tensor
    """``[Tk, H, Dv]`` in q's dtype; any token and head strides with a contiguous last dim."""
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
    k_pe: torch.Tensor | None = None
    """``[Tk, R]`` in q's dtype (contiguous last dim, any token stride): the rope lanes of every
    head's key (``k`` then holds the other ``Dqk - R``), or ``None``: ``k`` is whole."""
    prior_out: torch.Tensor | None = None
    """``[T, H, Dv]`` (a float dtype, contiguous last dim): the state this call merges into,
    with ``prior_lse``; ``None`` (with ``prior_lse``): no merge, ``out`` is this call's result."""
    prior_lse: torch.Tensor | None = None
    """``[T, H]`` float32: the LSE of ``prior_out`` (``-inf``: the row has no state yet)."""
    appended: AppendedKeys | None = None
    """A second key range after each request's ``k``/``v`` rows, or ``None``."""


@attrs.frozen(kw_only=True, eq=False)
class AppendedKeys:
    """The keys a :class:`VarlenPrefillCall` attends after each request's ``k``/``v`` rows (its
    ``appended``): in a chunked-context step, the new tokens' own keys, attended in the pass of a
    context chunk (causal over them when the call is)."""

    k: torch.Tensor
    """``[Ta, H, Dqk]`` whole keys (the rope lanes included) in q's dtype; any token and head
    strides with a contiguous last dim."""
    v: torch.Tensor
    """``[Ta, H, Dv]`` in q's dtype; any token and head strides with a contiguous last dim."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[B+1]``: request ``b``'s appended keys are rows ``[cu[b], cu[b+1])``."""
    max_seqlen_k: int


def appended_passes(call: VarlenPrefillCall) -> tuple[VarlenPrefillCall, VarlenPrefillCall]:
    """Two calls that compute ``call`` (which has ``appended``) in turn, for a kernel without the
    form: the appended keys' pass (``call.causal``, merged into ``call``'s prior state if it has
    one) into ``out``/``lse``, then ``call``'s own keys, non-causal, merged into them in place."""
    appended = call.appended
    if appended is None:
        raise ValueError("appended_passes needs a call with appended keys")
    first = attrs.evolve(
        call, k=appended.k, v=appended.v, k_pe=None, cu_seqlens_k=appended.cu_seqlens_k,
        max_seqlen_k=appended.max_seqlen_k, appended=None,
    )  # fmt: skip
    second = attrs.evolve(call, causal=False, prior_out=call.out, prior_lse=call.lse, appended=None)
    return first, second


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
class GatherContextCall:
    """A chunk of cached context's latent rows, gathered for its up-projection (part of the
    chunked-context prefill; :meth:`KernelProvider.gather_context` has a torch default, a
    provider may fuse it into a few kernels). With ``n = token_ids.numel()``:

    * token ``p`` is *inside* when ``0 <= token_ids[p] < cache.shape[0]`` and
      ``p < cu_seqlens_k[-1]`` (a token past the last request, a negative id such as the fill's
      -1 mark, or an id past the cache counts as no key and is never read);
    * ``out`` holds each request's inside tokens in order, request after request, then the
      outside tokens' rows as +0.0 (a stable inside-first partition), every row in ``out``'s
      dtype: the cache row as is, or (an fp8 cache) dequantized in float32 by ``kv_scale``;
    * ``cu_seqlens_out[r]`` = the inside tokens before request ``r``'s first (clamped to
      ``[0, n]``), so request ``r``'s keys are ``out[cu_seqlens_out[r]:cu_seqlens_out[r+1]]``.

    No host sync.
    """

    cache: torch.Tensor
    """``[rows, D]``, the latent cache's token rows (any float dtype, e4m3 too), last dim
    contiguous."""
    token_ids: torch.Tensor
    """int32 ``[n]``, a cache row per token."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[B+1]``, the chunk's token offsets per request (non-decreasing)."""
    kv_scale: torch.Tensor | None
    """float32 (one element) dequantization scale of an fp8 cache, or ``None`` (1)."""
    out: torch.Tensor
    """``[n, D]`` contiguous, a 16- or 32-bit float dtype (written)."""
    cu_seqlens_out: torch.Tensor
    """int32 ``[B+1]`` (written)."""


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
      outside the cache as above (the keys the kernels mask);
    * ``length_count`` (when given) grows by the number of requests whose length is bad:
      ``seq_lens[b] < 0``, ``seq_lens[b] > max_len`` (clamped above) or
      ``0 < seq_lens[b] < qlen_b``, with ``qlen_b = query_start_loc[b+1] - query_start_loc[b]``
      (1 without ``query_start_loc``; a ``seq_len`` of 0 marks a graph-padding request).

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
    """int ``[B+1]`` on the device: copied into ``qo_indptr`` by the same launch when that is
    given (a strategy's own copy of the query indptr), read for the query lengths when
    ``length_count`` is given; or ``None``."""
    qo_indptr: torch.Tensor | None = None
    """int32 ``[B+1]`` (written when ``query_start_loc`` is given)."""
    invalid_count: torch.Tensor | None = None
    """int32 ``[1]`` device counter the masked tokens are added to (the backend's
    ``invalid_index_count``), or ``None``."""
    length_count: torch.Tensor | None = None
    """int32 ``[1]`` device counter the requests with a bad length are added to (the functional
    ``mla_decode``'s check, read after its launch), or ``None``: not counted."""


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


__all__ = [
    "AppendedKeys",
    "DecodeSchedule",
    "DecodeScheduleBuffersCall",
    "ExpandPagesCall",
    "FillPagesCall",
    "Fp8PrefillCall",
    "Fp8PrefillPlanCall",
    "GatherContextCall",
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
    "appended_passes",
]
