"""The kernel-provider contract (DESIGN §4).

A provider implements the kernel contracts as methods that write into caller-provided outputs.
Conventions shared by every method:

* ``T`` query tokens, ``B`` requests, ``H`` heads, ``L`` = kv_lora_rank, ``R`` = rope dim.
* LSE tensors are float32 ``[T, H]`` in natural log. A row with no keys gets ``o = 0`` and
  ``lse = -inf``.
* The decode methods (``paged_mqa_decode``, ``small_head_decode``) take ``lse=None`` when the
  caller needs no LSE (plain decode; engines need it only to merge states, e.g. decode context
  parallelism): the provider writes ``out`` only and may skip every LSE-only computation.
  Split-KV partial LSEs that the provider needs internally to reduce ``out`` are unaffected.
* Indptr/index tensors are int32 on the device of the data.
* Device-side methods (``paged_mqa_decode``, ``small_head_decode``, ``plan_decode_schedule``,
  ``varlen_attention``, ``fp8_prefill``, ``merge_states``, ``expand_page_indices``, ``write_kv``)
  perform no host-device synchronisation and no allocation whose size depends on tensor
  values; the sizes they need arrive as Python ints from the plan. ``plan_fp8_prefill`` runs on
  the host at build time.
* ``kv_scale`` is the per-tensor dequant scale of an fp8 cache as a Python float (``None`` for a
  float cache): the cache value is ``stored * kv_scale``.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from mla.capabilities import ProviderCapabilities
from mla.platform import Platform
from mla.support import Support


class KernelProvider(abc.ABC):
    """One implementation of the kernel contracts.

    Subclasses set ``name``, implement :meth:`availability` (cached; "can it run here") and
    :meth:`capabilities` (what it computes, as data), and the contract methods they list in
    their capability record.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def availability(self) -> Support:
        """Empty when the provider's library and a device it runs on are present here."""

    @abc.abstractmethod
    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        """The capability record for ``platform`` (real or simulated)."""

    def describe_probes(self) -> dict[str, object]:
        """Feature probes shown by ``mla info`` (library versions, optional kernels)."""
        return {}

    # -- decode -----------------------------------------------------------------------------

    @abc.abstractmethod
    def paged_mqa_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        qo_indptr: torch.Tensor,
        *,
        max_qlen: int,
        max_seqlen_k: int,
        softmax_scale: float,
        kv_scale: float | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        schedule: object | None = None,
    ) -> None:
        """Asm-style paged MQA decode.

        q ``[Tk, Hk, L+R]`` (contiguous), kv_cache flat ``[N_tok, L+R]``, kv_indptr ``[B+1]``,
        kv_indices flat token ids, qo_indptr ``[B+1]`` with ``max_qlen`` the largest
        ``qo_indptr`` step and ``max_seqlen_k`` a static bound on any request's KV length (the
        engine's ``max_model_len``, so a captured graph stays valid as sequences grow);
        out ``[Tk, Hk, L]`` (q's dtype), lse ``[Tk, Hk]`` float32 or ``None`` (no LSE wanted: the
        provider may skip computing it). Query row ``i`` of request ``b``
        attends keys ``0 .. s_b - q_b + i``. With ``schedule`` (from
        :meth:`decode_schedule_buffers`, planned by :meth:`plan_decode_schedule`) the provider
        runs its persistent split-KV path.
        """

    @abc.abstractmethod
    def decode_schedule_buffers(
        self,
        *,
        max_batch: int,
        max_kernel_qlen: int,
        kernel_heads: int,
        kv_lora_rank: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        platform: Platform,
        device: torch.device,
    ) -> object:
        """Allocate the fixed buffers of a persistent decode schedule (once, at init).

        The same ``kernel_heads``, ``max_kernel_qlen`` and dtypes must reach
        :meth:`plan_decode_schedule` and :meth:`paged_mqa_decode`.
        """

    @abc.abstractmethod
    def plan_decode_schedule(
        self,
        schedule: object,
        *,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        batch_size: int,
        kernel_qlen: int,
        uniform_qlen: bool,
    ) -> None:
        """Fill ``schedule`` on the device for this step's indptrs (no host sync).

        ``uniform_qlen``: every request of ``qo_indptr`` (graph padding included) has exactly
        ``kernel_qlen`` rows, so a planner may take the row count as a constant.
        """

    @abc.abstractmethod
    def small_head_decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_info: torch.Tensor,
        *,
        max_seqlen_k: int,
        softmax_scale: float,
        kv_scale: float | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        """Gluon-style decode: each of the ``T`` rows is an independent qlen-1 decode.

        q_nope ``[T, H, L]``, q_pe ``[T, H, R]``, kv_cache flat ``[N_tok, L+R]``, page_table flat
        token ids, seq_info ``[T+1]`` indptr into page_table (rows at most ``max_seqlen_k``
        long); out ``[T, H, L]``, lse ``[T, H]`` float32 or ``None`` (no LSE wanted: the
        provider may skip computing it).
        """

    # -- prefill ----------------------------------------------------------------------------

    @abc.abstractmethod
    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        causal: bool,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Flash-style varlen attention. q ``[T, H, Dqk]``, k ``[Tk, H, Dqk]``, v ``[Tk, H, Dv]``;
        causal is bottom-right aligned (row ``i`` of a request sees keys ``<= i + Sk - Sq``);
        out ``[T, H, Dv]``, lse ``[T, H]``."""

    @abc.abstractmethod
    def plan_fp8_prefill(
        self,
        cu_seqlens_q_cpu: torch.Tensor,
        cu_seqlens_k_cpu: torch.Tensor,
        *,
        num_heads: int,
        causal: bool,
        platform: Platform,
        device: torch.device,
    ) -> object:
        """Host-side tile schedule for :meth:`fp8_prefill` (build time; may read host tensors)."""

    @abc.abstractmethod
    def fp8_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        schedule: object,
        softmax_scale: float,
        q_scale: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        causal: bool,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """FP8 persistent prefill: q/k/v fp8 (values ``stored * scale``; scales fp32 0-dim
        tensors), otherwise the :meth:`varlen_attention` math; out in ``out.dtype``."""

    # -- utilities --------------------------------------------------------------------------

    @abc.abstractmethod
    def merge_states(
        self,
        o_a: torch.Tensor,
        lse_a: torch.Tensor,
        o_b: torch.Tensor,
        lse_b: torch.Tensor,
        *,
        out: torch.Tensor,
        lse_out: torch.Tensor | None = None,
    ) -> None:
        """``lse* = logaddexp(lse_a, lse_b)``, ``o = e^(lse_a-lse*) o_a + e^(lse_b-lse*) o_b``.

        o ``[T, H, D]``, lse ``[T, H]``; rows where both are ``-inf`` give ``o = 0``,
        ``lse = -inf``. ``out`` may alias ``o_a`` or ``o_b``.
        """

    @abc.abstractmethod
    def expand_page_indices(
        self,
        block_table: torch.Tensor,
        kv_indptr: torch.Tensor,
        *,
        block_size: int,
        num_tokens: int,
        out: torch.Tensor,
    ) -> None:
        """Write ``out[kv_indptr[r] + t] = block_table[r, t // bs] * bs + t % bs`` for every
        request ``r`` and ``t < kv_indptr[r+1] - kv_indptr[r]``; ``num_tokens`` =
        ``kv_indptr[-1]`` (a host int known at build time)."""

    @abc.abstractmethod
    def write_kv(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        kv_scale: float | None,
    ) -> None:
        """Write ``[kv_c | k_pe]`` rows (``[N, L]``, ``[N, R]``) into the paged cache
        ``[blocks, block_size, L+R]`` at flat slots ``slot_mapping`` ``[N]`` (negative = skip);
        fp8 caches store ``value / kv_scale``."""
