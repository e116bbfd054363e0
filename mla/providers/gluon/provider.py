"""The ``gluon`` kernel provider: Hopper-native decode and prefill kernels, the Triton provider for the rest.

Decode (``paged-decode`` on both split-KV paths, ``decode-schedule``, ``small-head-decode``)
runs on the Gluon kernels of :mod:`.kernels` / :mod:`.transposed` wherever
:func:`~mla.providers.gluon.planner.decode_kernel` says they apply (16-bit queries with a cache
of the same dtype, 512 + 64 latent/rope dims); every other decode case runs on the Triton
provider's decode kernel, and the contracts the Gluon kernels do not implement (merge, page
expansion, KV write and the indexer's top-k) are the Triton provider's kernels.
Sparse attention runs on the Gluon decode kernels (each query row a qlen-1 decode over its
slots, :mod:`.sparse`) for 512 + 64 dims with a 16-bit, per-tensor fp8 or ``fp8_ds_mla``
cache, on the Triton sparse kernel otherwise. An engine builds one backend with one provider
for both phases, so composing the Triton provider is what lets ``provider="auto"`` pick
``gluon`` on Hopper without losing a contract; ``mla info`` lists the delegated contracts and
the routing rules under the provider's probes.

Varlen prefill (``varlen-prefill``) runs on the Gluon prefill kernel of :mod:`.prefill`
(TMA K/V ring, a 4-warp TMA producer and two consumer warpgroups of 64 query rows each, the
split layout, one program per SM up to 2048 queries a request (at any length up to 16 heads)
and one per query tile past it (:func:`~mla.providers.gluon.prefill_launch.default_kernel`);
``wgmma`` QKᵀ and PV over 128-row query tiles, causal masked only on diagonal tiles;
``PrefillKernel`` names the other warp splits a launch may ask for) where
:func:`~mla.providers.gluon.prefill_launch.prefill_call_route` takes the call: bf16/fp16
q/k/v of one dtype with 192/128 or 128/128 head dims, at least one key, and layouts TMA reads
(last dim contiguous, 16-byte-aligned base, token and head strides, each token's heads within
its row), the chunked-context forms too (a 64-lane ``k_pe`` read as each key tile's last box, a
prior state merged in the epilogue); every other call runs on the Triton provider's varlen
kernel. fp8 prefill (``fp8-prefill``)
runs on the Gluon fp8 kernel of :mod:`.prefill_fp8_split` where
:func:`~mla.providers.gluon.prefill_fp8_launch.fp8_prefill_route` takes the call (e4m3 q/k/v,
the same dims and layouts), on the Triton provider's fp8 kernels otherwise. The routes read
only dtypes, shapes and strides; ``mla explain`` shows the rules as the prefill kernel note.
``GluonProvider(prefill="triton", fp8_prefill="triton")`` keeps both on the Triton kernels.

Available on an NVIDIA sm_90 device where ``triton.experimental.gluon.language.nvidia.hopper``
imports (Triton >= 3.6); elsewhere :meth:`GluonProvider.availability` says why.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.errors import InvalidInputError
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
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    SparseAttentionCall,
    SparseSlotsCall,
    VarlenPrefillCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.providers.gluon.planner import (
    FEW_ROWS_MAX,
    MIN_SPLIT_TOKENS,
    SUPPORTED_ROPE,
    decode_kernel,
    schedule_units,
)
from mla.providers.gluon.prefill_fp8_launch import (
    GluonFp8PrefillPlan,
    plan_gluon_fp8_prefill,
    try_gluon_fp8_prefill,
)
from mla.providers.gluon.prefill_launch import PREFILL_DIMS, try_gluon_prefill
from mla.providers.gluon.sparse import sparse_on_gluon
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton import TritonProvider

HOPPER_MODULE = "triton.experimental.gluon.language.nvidia.hopper"
"""The Gluon module whose wgmma/TMA/mbarrier builtins the kernels use."""
GLUON_ARCH = "sm90"
"""The only arch the kernels are built for (wgmma needs sm_90a)."""
DELEGATED: tuple[Contract, ...] = (
    Contract.MERGE_STATES,
    Contract.EXPAND_PAGES,
    Contract.KV_WRITE,
)
"""Contracts served by the Triton provider's kernels (sparse attention, varlen and fp8 prefill
and the indexer's scores too, for the calls :func:`~mla.providers.gluon.sparse.sparse_on_gluon`,
:func:`~mla.providers.gluon.prefill_launch.prefill_route`,
:func:`~mla.providers.gluon.prefill_fp8_launch.fp8_prefill_route` and
:func:`~mla.providers.gluon.index_scores.gluon_scores_route` decline; the indexer's top-k always)."""
PREFILL_NOTE = (
    "varlen prefill runs on the Gluon prefill kernel for bf16/fp16 q/k/v with 192/128 or 128/128 "
    "head dims and TMA-readable layouts (16-byte-aligned base and strides, last dim contiguous), "
    "on the Triton provider's varlen kernel otherwise; chunked-context passes (k_pe of 64 lanes, a "
    "prior state) on the Gluon kernel too"
)
"""The varlen part of the prefill kernel note (``mla explain``), ``prefill="gluon"`` (the default)."""
TRITON_PREFILL_NOTE = "varlen prefill runs on the Triton provider's varlen kernel (prefill='triton')"
"""The varlen part of the prefill kernel note of a provider built with ``prefill="triton"``."""
FP8_PREFILL_NOTE = (
    "fp8 prefill runs on the Gluon fp8 prefill kernel for e4m3 q/k/v with 192/128 or 128/128 head "
    "dims and TMA-readable layouts (P quantized to e4m3 for the fp8 P·V), on the Triton provider's "
    "fp8 kernels otherwise"
)
"""The fp8 part of the prefill kernel note, ``fp8_prefill="gluon"`` (the default)."""
TRITON_FP8_PREFILL_NOTE = "fp8 prefill runs on the Triton provider's fp8 kernels (fp8_prefill='triton')"
"""The fp8 part of the prefill kernel note of a provider built with ``fp8_prefill="triton"``."""
PREFILL_KERNELS = ("triton", "gluon")
"""What ``GluonProvider(prefill=...)`` takes."""


def hopper_support(capability: tuple[int, int] | None, import_error: str | None) -> Support:
    """Availability from the device's compute capability (``None``: no CUDA device) and the
    failure to import the Gluon Hopper module (``None``: it imports)."""
    if capability is None:
        return Support.no(
            "no-device", "no CUDA device is visible; the Gluon kernels need an NVIDIA sm_90 GPU"
        )
    if capability != (9, 0):
        return Support.no(
            "not-hopper",
            f"the device has compute capability {capability[0]}.{capability[1]}; the Gluon kernels "
            "use wgmma and need sm_90 (H100/H200): use provider='triton'",
        )
    if import_error is not None:
        return Support.no(
            "no-gluon",
            f"{HOPPER_MODULE} does not import ({import_error}); the Gluon kernels need Triton >= 3.6",
        )
    return Support.yes()


class GluonProvider(KernelProvider):
    """Gluon (Hopper) decode kernels, composed with the Triton provider for everything else."""

    name: ClassVar[str] = "gluon"

    def __init__(self, *, prefill: str = "gluon", fp8_prefill: str = "gluon") -> None:
        """``prefill``: ``"gluon"`` (the default: the Gluon prefill kernel, split layouts, where
        :func:`.prefill_launch.prefill_call_route` takes the call, the Triton provider's varlen
        kernel otherwise) or ``"triton"`` (always the Triton varlen kernel).

        ``fp8_prefill``: ``"gluon"`` (the default: the Gluon fp8 prefill kernel of
        :mod:`.prefill_fp8_split` where :func:`.prefill_fp8_launch.fp8_prefill_route` takes the
        call; ``plan_fp8_prefill`` returns a :class:`.prefill_fp8_launch.GluonFp8PrefillPlan`
        around the Triton plan) or ``"triton"`` (the Triton fp8 kernels). The Gluon fp8 kernel
        quantizes P to e4m3 for its fp8 ``P·V``, as FP8 attention kernels on Hopper do: about
        2% relative output error against the dequantized inputs, where the Triton kernel's fp16
        P gives 0.2%. ``fp8_prefill="triton"`` is the choice for that accuracy
        (``docs/performance.md`` has both kernels' speed)."""
        if prefill not in PREFILL_KERNELS:
            raise InvalidInputError("prefill", f"one of {'/'.join(PREFILL_KERNELS)}, got {prefill!r}")
        if fp8_prefill not in PREFILL_KERNELS:
            raise InvalidInputError("fp8_prefill", f"one of {'/'.join(PREFILL_KERNELS)}, got {fp8_prefill!r}")
        self._triton = TritonProvider()
        self._availability: Support | None = None
        self._prefill = prefill
        self._fp8_prefill = fp8_prefill

    def __repr__(self) -> str:
        options = [
            f"{name}={value!r}"
            for name, value in (("prefill", self._prefill), ("fp8_prefill", self._fp8_prefill))
            if value != "gluon"
        ]
        return f"GluonProvider({', '.join(options)})"

    def availability(self) -> Support:
        if self._availability is None:
            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            import_error: str | None = None
            if capability == (9, 0):
                try:
                    importlib.import_module(HOPPER_MODULE)
                except ImportError as exc:
                    import_error = str(exc)
            self._availability = hopper_support(capability, import_error)
        return self._availability

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        # The Triton provider's record (every case it runs, which the Gluon kernels' fallback
        # keeps), restricted to Hopper.
        return attrs.evolve(
            self._triton.capabilities(platform),
            provider=self.name,
            archs=frozenset({GLUON_ARCH}),
            # Non-persistent measured as fast or faster on every case but one long request
            # (docs/performance.md, "Kernel choices").
            persistent_decode_preferred=False,
            decode_float32_out=False,
        )

    def describe_probes(self) -> dict[str, object]:
        probes = self._triton.describe_probes()
        probes["gluon_hopper_module"] = HOPPER_MODULE
        probes["decode_kernels"] = (
            f"Gluon 64-row tiles above {FEW_ROWS_MAX} heads x qlen rows (ping-pong kernel: loader "
            "and two MMA warpgroups, 16-bit caches; 64-row kernel: fp8 caches), transposed few-rows "
            f"kernel up to {FEW_ROWS_MAX} (16-bit or fp8; 16 rows of fp8 on the dual-chain kernel: "
            "loader and two MMA warpgroups); Triton decode kernel for other latent/rope "
            "dims than 512+64, fp32 queries, mixed 16-bit dtypes"
        )
        probes["sparse_attention"] = (
            "Gluon decode kernels, each query row a qlen-1 decode over its slots (512+64 dims; "
            "16-bit, per-tensor fp8 or fp8_ds_mla rows with a bf16 query); Triton sparse kernel otherwise"
        )
        probes["index_topk"] = (
            "Gluon scores kernel (TMA key tiles, fp8 wgmma) for e4m3 queries and keys, 128-dim index "
            "heads (up to 128), cache blocks of a multiple of 64 keys and decode-sized row counts; "
            "Triton scores kernel otherwise; the top-k on the Triton kernels"
        )
        probes["varlen_prefill"] = (
            "Gluon prefill kernel (TMA ring, a TMA producer warpgroup and two consumer warpgroups, wgmma, "
            "128-row query tiles; one program per SM up to 2048 queries a request or 16 heads) for "
            f"bf16/fp16 {' and '.join(f'{a}/{b}' for a, b in sorted(PREFILL_DIMS, reverse=True))} "
            "head dims and TMA-readable layouts; Triton varlen kernel otherwise"
            + ("" if self._prefill == "gluon" else " (off: GluonProvider(prefill='triton'); now: Triton)")
        )
        probes["fp8_prefill"] = (
            "Gluon fp8 prefill kernel (e4m3 wgmma QKᵀ and PV; a producer warpgroup transposes V in shared "
            "memory for two consumer warpgroups) for e4m3 "
            "192/128 and 128/128; Triton fp8 kernels otherwise"
            if self._fp8_prefill == "gluon"
            else "Triton fp8 kernels (GluonProvider(fp8_prefill='triton'))"
        )
        delegated = DELEGATED + ((Contract.FP8_PREFILL,) if self._fp8_prefill == "triton" else ())
        probes["delegated_to_triton"] = sorted(c.value for c in delegated)
        return probes

    def kernel_note(
        self,
        *,
        phase: str,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        kv_lora_rank: int,
        rope_dim: int,
    ) -> str | None:
        if phase == "prefill":
            varlen = PREFILL_NOTE if self._prefill == "gluon" else TRITON_PREFILL_NOTE
            fp8 = FP8_PREFILL_NOTE if self._fp8_prefill == "gluon" else TRITON_FP8_PREFILL_NOTE
            return f"{varlen}; {fp8}"
        if phase != "decode":
            return f"{phase} runs on the Triton provider's kernels (the gluon provider delegates it)"
        kernel, why = decode_kernel(
            q_dtype=q_dtype, kv_dtype=kv_dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim
        )
        where = "the Gluon kernels" if kernel == "gluon" else "the Triton provider's decode kernel"
        return f"decode runs on {where}: {why}"

    # -- decode -----------------------------------------------------------------------------

    def _on_gluon(self, q: torch.Tensor, kv_cache: torch.Tensor, rank: int, rope: int) -> bool:
        kernel, _why = decode_kernel(
            q_dtype=q.dtype, kv_dtype=kv_cache.dtype, kv_lora_rank=rank, rope_dim=rope
        )
        return kernel == "gluon"

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        rank = call.out.shape[-1]
        if self._on_gluon(call.q, call.kv_cache, rank, call.q.shape[-1] - rank):
            from mla.providers.gluon.decode import paged_decode  # noqa: PLC0415 (kernels load lazily)

            paged_decode(call)
        else:
            self._triton.paged_mqa_decode(call)

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> SplitKVSchedule:
        kernel, _why = decode_kernel(
            q_dtype=call.q_dtype,
            kv_dtype=call.kv_dtype,
            kv_lora_rank=call.kv_lora_rank,
            rope_dim=SUPPORTED_ROPE,
        )
        if kernel == "triton":
            # Sized for the Triton kernel that will run it (same schedule type).
            return self._triton.decode_schedule_buffers(call)
        return SplitKVSchedule.allocate(
            max_batch=call.max_batch,
            max_kernel_qlen=call.max_kernel_qlen,
            kernel_heads=call.kernel_heads,
            kv_lora_rank=call.kv_lora_rank,
            num_units=schedule_units(
                num_sms=call.platform.num_compute_units,
                rows=call.kernel_heads * call.max_kernel_qlen,
            ),
            device=call.device,
            min_chunk=MIN_SPLIT_TOKENS,
        )

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        # Same schedule type and planner as the Triton provider (its device-side kernel).
        self._triton.plan_decode_schedule(call)

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        rank = call.out.shape[-1]
        if self._on_gluon(call.q_nope, call.kv_cache, rank, call.q_pe.shape[-1]):
            from mla.providers.gluon.decode import small_head_decode  # noqa: PLC0415 (kernels load lazily)

            small_head_decode(call)
        else:
            self._triton.small_head_decode(call)

    # -- prefill ----------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        # The Gluon prefill kernel where prefill_call_route takes the call; else Triton's.
        if self._prefill != "gluon" or not try_gluon_prefill(call):
            self._triton.varlen_attention(call)

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> object:
        plan = self._triton.plan_fp8_prefill(call)
        if self._fp8_prefill != "gluon":
            return plan
        # The Triton plan (for the calls the route declines) and the batch's sizes.
        return plan_gluon_fp8_prefill(call, plan)

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        # A GluonFp8PrefillPlan: the Gluon fp8 kernel where fp8_prefill_route takes
        # the call, else the Triton kernels on the plan's Triton schedule.
        plan = call.schedule
        if isinstance(plan, GluonFp8PrefillPlan):
            if try_gluon_fp8_prefill(call):
                return
            call = attrs.evolve(call, schedule=plan.triton)
        self._triton.fp8_prefill(call)

    # -- delegated to the Triton provider ---------------------------------------------------

    def merge_states(self, call: MergeStatesCall) -> None:
        self._triton.merge_states(call)

    def expand_page_indices(self, call: ExpandPagesCall) -> None:
        self._triton.expand_page_indices(call)

    def fill_page_indices(self, call: FillPagesCall) -> None:
        self._triton.fill_page_indices(call)

    def gather_context(self, call: GatherContextCall) -> None:
        self._triton.gather_context(call)

    def write_kv(self, call: WriteKVCall) -> None:
        self._triton.write_kv(call)

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        # Where the Gluon decode kernels take the call (sparse_on_gluon), each query row runs as
        # a qlen-1 decode over its slots; elsewhere on the Triton sparse kernel.
        if sparse_on_gluon(call)[0]:
            from mla.providers.gluon.decode import sparse_decode  # noqa: PLC0415 (kernels load lazily)

            sparse_decode(call)
        else:
            self._triton.sparse_attention(call)

    def write_index_keys(self, call: WriteIndexKeysCall) -> None:
        self._triton.write_index_keys(call)

    def index_topk(self, call: IndexTopkCall) -> None:
        # The scores on the Gluon kernel where gluon_scores_route takes the call, the top-k on
        # the Triton kernels.
        from mla.providers.gluon.index_scores import gluon_index_scores  # noqa: PLC0415 (kernels load lazily)
        from mla.providers.triton.indexer import index_topk  # noqa: PLC0415

        index_topk(call, scores_kernel=gluon_index_scores)

    def sparse_slots(self, call: SparseSlotsCall) -> None:
        self._triton.sparse_slots(call)
