"""The ``triton`` kernel provider: every kernel contract as Triton kernels.

Runs on NVIDIA and AMD GPUs, and in Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by
the tests). Decode kernels live in :mod:`.decode` / :mod:`.small_head` with the launch heuristic
and the device-side planner in :mod:`.schedule`; prefill in :mod:`.prefill` / :mod:`.fp8_prefill`;
merge, page expansion and KV write in :mod:`.utils`; sparse attention, the indexer, index-key and
``fp8_ds_mla`` writes and the fused slot conversion in :mod:`.sparse`.

Capabilities: no head granularity (any head count runs natively, heads × qlen packed into the
MMA rows), any qlen, bf16/fp16/fp32 queries, bf16/fp16/fp32 caches and fp8 caches (widened to
the dot dtype in registers, so they work on any arch whose Triton converts that fp8 format;
e4m3 needs sm89+ on NVIDIA). The fp8 prefill needs fp8 tensor-core dots: NVIDIA sm89+, AMD
gfx942/gfx950 (and the interpreter). Sparse attention reads float caches, the fp8 formats the
decode widens, and ``fp8_ds_mla`` rows and fp8 index keys where e4m3 converts (NVIDIA sm89+,
AMD other than gfx942, the interpreter); any head count runs (head blocks are masked, not padded).
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
import triton

from mla.core.capabilities import ALL_CONTRACTS, Contract, ProviderCapabilities
from mla.core.config import DS_MLA_DTYPE
from mla.core.errors import PlanMismatchError
from mla.core.platform import Platform
from mla.core.support import Support
from mla.providers.base import KernelProvider
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    ExpandPagesCall,
    FillPagesCall,
    Fp8PrefillCall,
    Fp8PrefillPlanCall,
    GatherContextCall,
    IndexTopkCall,
    MergeStatesCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    SparseAttentionCall,
    SparseSlotsCall,
    VarlenPrefillCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton.context_gather import gather_context
from mla.providers.triton.decode import paged_decode
from mla.providers.triton.fp8_prefill import fp8_prefill_fwd, plan_fp8_prefill
from mla.providers.triton.indexer import index_topk
from mla.providers.triton.prefill import varlen_attention_fwd
from mla.providers.triton.schedule import allocate_schedule, plan_split_kv
from mla.providers.triton.small_head import small_head_decode
from mla.providers.triton.sparse import sparse_attention, sparse_slots, write_index_keys
from mla.providers.triton.utils import expand_page_indices, fill_page_indices, merge_states, write_kv

_FLOATS = frozenset({torch.bfloat16, torch.float16, torch.float32})


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _nvidia_sm(arch: str) -> int | None:
    """``sm90`` → 90; ``None`` for non-NVIDIA arch names."""
    if arch.startswith("sm") and arch[2:].isdigit():
        return int(arch[2:])
    return None


def fp8_kv_dtypes(platform: Platform) -> frozenset[torch.dtype]:
    """fp8 cache formats the decode kernels can widen on ``platform``."""
    sm = _nvidia_sm(platform.arch)
    if sm is not None:
        e4m3 = {torch.float8_e4m3fn} if sm >= 89 else set()
        return frozenset({torch.float8_e5m2, *e4m3})
    if platform.arch == "gfx942":
        return frozenset({torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
    if platform.arch.startswith("gfx"):
        return frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
    return frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def has_fp8_dots(platform: Platform) -> bool:
    """Whether fp8 × fp8 tensor-core dots exist (NVIDIA sm89+, AMD gfx942/gfx950, interpreter)."""
    sm = _nvidia_sm(platform.arch)
    if sm is not None:
        return sm >= 89
    return platform.arch in ("gfx942", "gfx950", "cpu")


class TritonProvider(KernelProvider):
    """Portable Triton kernels for every contract (decode, schedule, prefill, utilities)."""

    name: ClassVar[str] = "triton"

    def __init__(self) -> None:
        self._availability: Support | None = None

    def __repr__(self) -> str:
        return "TritonProvider()"

    def availability(self) -> Support:
        if self._availability is None:
            self._availability = self._probe_availability()
        return self._availability

    @staticmethod
    def _probe_availability() -> Support:
        # Importing this module imported triton; what remains is a device to run on.
        if torch.cuda.is_available() or _interpreting():
            return Support.yes()
        return Support.no(
            "no-device",
            "no CUDA/ROCm device is visible and TRITON_INTERPRET is not set (set TRITON_INTERPRET=1 "
            "to run the kernels in Triton's CPU interpreter)",
        )

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        fp8 = fp8_kv_dtypes(platform)
        contracts = set(ALL_CONTRACTS)
        if not has_fp8_dots(platform):
            contracts.discard(Contract.FP8_PREFILL)
        # fp8_ds_mla rows and fp8 index keys are e4m3 bytes, widened where e4m3 converts.
        e4m3 = frozenset({torch.float8_e4m3fn}) & fp8
        return ProviderCapabilities(
            provider=self.name,
            contracts=frozenset(contracts),
            archs=None,
            q_dtypes=_FLOATS,
            kv_dtypes=_FLOATS | fp8,
            head_granularity=1,
            small_head_max_heads=None,
            small_head_q_dtypes=_FLOATS,
            small_head_kv_dtypes=_FLOATS | fp8,
            fp8_dtype=torch.float8_e4m3fnuz if platform.arch == "gfx942" else torch.float8_e4m3fn,
            sparse_kv_dtypes=_FLOATS | fp8 | (frozenset({DS_MLA_DTYPE}) if e4m3 else frozenset()),
            index_key_dtypes=_FLOATS | e4m3,
            # Non-persistent measured as fast or faster on every case but one long request
            # (docs/performance.md, "Kernel choices").
            persistent_decode_preferred=False,
            # The decode kernel reads block ids from the engine's block table (one per page).
            decode_reads_block_table=True,
            varlen_clamps_indptrs=True,
            # k_pe and the prior state (VarlenPrefillCall): constexpr branches of the varlen kernel.
            varlen_context_operands=True,
        )

    def describe_probes(self) -> dict[str, object]:
        probes: dict[str, object] = {"interpreter": _interpreting(), "triton": triton.__version__}
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            probes["device"] = props.name
            probes["sm_count"] = props.multi_processor_count
            probes["compute_capability"] = f"{props.major}.{props.minor}"
        else:
            probes["device"] = "cpu (interpreter)" if _interpreting() else "none"
        return probes

    # -- decode -----------------------------------------------------------------------------

    # The contract method is the launcher itself (one frame less on the decode route).
    paged_mqa_decode = staticmethod(paged_decode)

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> SplitKVSchedule:
        return allocate_schedule(
            max_batch=call.max_batch,
            max_kernel_qlen=call.max_kernel_qlen,
            kernel_heads=call.kernel_heads,
            kv_lora_rank=call.kv_lora_rank,
            num_sms=call.platform.num_compute_units,
            device=call.device,
        )

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        if not isinstance(call.schedule, SplitKVSchedule):
            raise PlanMismatchError(
                f"the triton provider takes a SplitKVSchedule, got {type(call.schedule).__name__}"
            )
        plan_split_kv(call.schedule, call.kv_indptr, call.batch_size)

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        small_head_decode(call)

    # -- prefill ----------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        varlen_attention_fwd(call)

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> object:
        return plan_fp8_prefill(
            call.cu_seqlens_q_cpu,
            call.cu_seqlens_k_cpu,
            num_heads=call.num_heads,
            causal=call.causal,
            device=call.device,
        )

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        fp8_prefill_fwd(call)

    # -- utilities --------------------------------------------------------------------------

    def merge_states(self, call: MergeStatesCall) -> None:
        merge_states(call)

    def expand_page_indices(self, call: ExpandPagesCall) -> None:
        expand_page_indices(call)

    def fill_page_indices(self, call: FillPagesCall) -> None:
        fill_page_indices(call)

    def gather_context(self, call: GatherContextCall) -> None:
        gather_context(call)

    def write_kv(self, call: WriteKVCall) -> None:
        write_kv(call)

    # -- sparse (DeepSeek Sparse Attention) ----------------------------------------------------

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        sparse_attention(call)

    def write_index_keys(self, call: WriteIndexKeysCall) -> None:
        write_index_keys(call)

    def index_topk(self, call: IndexTopkCall) -> None:
        index_topk(call)

    def sparse_slots(self, call: SparseSlotsCall) -> None:
        sparse_slots(call)
