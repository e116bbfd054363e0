"""One engine step's inputs (:class:`StepInputs`, or :class:`VarlenStep` for a prefill over given keys)
and the metadata planned for it (:class:`MLAMetadata`)."""

from __future__ import annotations

import attrs
import torch

from mla.decode.base import DecodePlan
from mla.engine.decision.resolver import Decision
from mla.prefill.base import PrefillPlan
from mla.sparse.base import SparsePlan


@attrs.frozen(eq=False)
class StepInputs:
    """One engine step, decode requests first (vLLM's reordered batch).

    ``num_decode_tokens`` may exceed ``query_start_loc[num_decodes]`` in a decode-only step: the
    extra rows are CUDA-graph padding. Requests with ``seq_len == 0`` are graph-padding requests.
    """

    query_start_loc_cpu: torch.Tensor
    """int ``[B+1]`` on the host."""
    query_start_loc: torch.Tensor
    """int32 ``[B+1]`` on the device."""
    seq_lens: torch.Tensor
    """int32 ``[B]`` on the device (KV length including the new tokens)."""
    block_table: torch.Tensor
    """int32 ``[B, max_blocks]`` on the device."""
    num_decodes: int
    num_decode_tokens: int
    seq_lens_cpu: torch.Tensor | None = None
    """Host copy of ``seq_lens``. When omitted, a decode-only step plans its page indices on the
    device (no copy, work sized by the block table); a step with prefills (or
    ``validate="full"``) copies ``seq_lens`` from the device."""


@attrs.frozen(eq=False)
class VarlenStep:
    """A prefill step over given keys and values, without a paged cache: the step of the
    functional :func:`mla.mla_prefill` (``q`` rows ``cu_seqlens_q``, ``k``/``v`` rows
    ``cu_seqlens_k`` per request), checked by its caller."""

    cu_seqlens_q_cpu: torch.Tensor | None
    """int32 ``[B+1]`` on the host, or ``None`` when the caller checks the values after the
    launch (see :attr:`~mla.core.capabilities.ProviderCapabilities.varlen_clamps_indptrs`)."""
    cu_seqlens_k_cpu: torch.Tensor | None
    """int32 ``[B+1]`` on the host, or ``None`` (as above)."""
    cu_seqlens_q: torch.Tensor
    """int32 ``[B+1]`` on the device."""
    cu_seqlens_k: torch.Tensor
    """int32 ``[B+1]`` on the device."""
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    num_tokens: int
    """Rows of q (the indptr's last value, checked by the caller)."""
    num_kv_tokens: int
    """Rows of k and v."""
    launch_checked: bool = False
    """The run's tensors have a signature whose launch already passed the provider's argument
    checks (:attr:`~mla.prefill.base.PrefillBatch.launch_checked`)."""


@attrs.frozen(eq=False)
class MLAMetadata:
    """Everything the impl needs for one step: each phase's decision and plan.

    A dense model's step has ``decode``/``prefill`` plans; a sparse model's (``MLADims.index_topk``)
    has ``sparse_decode``/``sparse_prefill`` plans and the ``index`` plan over all of its rows.
    """

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodePlan | None
    prefill: PrefillPlan | None
    decode_decision: Decision | None
    prefill_decision: Decision | None
    sparse_decode: SparsePlan | None = None
    sparse_prefill: SparsePlan | None = None
    index: SparsePlan | None = None
    """The indexer's plan: every row of the step (decode rows first)."""
