"""The ``aiter`` provider: AMD aiter's MLA kernels behind the provider contract (ROCm only).

Nothing here imports aiter at module import or at construction: the library is detected and
probed on first use (:attr:`AiterProvider.library`, :attr:`AiterProvider.probes`), once per
provider object. Every kernel is called with the exact signature and argument order that
vLLM's ROCM_AITER_MLA backend makes them (ROCm/aiter e4048607):

* paged decode: ``aiter.mla.mla_decode_fwd`` over the flat cache viewed ``[N_tok, 1, 1, 576]``,
  ``page_size=1``, ``nhead_kv=1``, the softmax scale always explicit (aiter's default is
  ``1/sqrt(576)``), all six persistent buffers or none, per-tensor q/kv scale tensors with an
  fp8 cache (the query is quantized to ``aiter.dtypes.fp8`` on the device, so the bf16-q/fp8-kv
  "a16w8" kernels, which exist only persistent up to qlen 4, are never asked for);
* persistent metadata: ``get_mla_metadata_info_v1`` at allocation and ``get_mla_metadata_v1``
  per step, with the same kernel heads, kernel qlen and q/kv dtypes (``work_info_set`` before
  ``work_indptr`` in the positional order);
* small-head decode: the Gluon ``mla_gluon`` (or legacy ``mla_decode_gluon``) with the flat page
  table, ``use_2d_view=False`` and ``kv_scale=1.0`` (it takes a Python float; a device scale is
  folded into the query and the output instead, so no host sync);
* prefill: ``flash_attn_varlen_func`` (192/128 natively, LSE ``[H, T]`` transposed to ``[T, H]``)
  and the fp8 persistent prefill ``get_ps_metadata_info_v1``/``get_ps_metadata_v1`` (host
  indptrs) + ``mla_prefill_ps_asm_fwd`` + ``mla_reduce_v1`` (fp32 partials sized from the plan).

Where the LSE comes from when aiter cannot return it (and that a decode with ``lse=None`` skips
it), and which rows are cleared, is :mod:`mla.providers.aiter.lse`. aiter has no stable public
API for state merging, page-index expansion or KV writes (vLLM uses its own ops), so those
contracts are the torch reference provider's device-side implementations, by composition.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import attrs
import torch

from mla.core.capabilities import Contract, ProviderCapabilities
from mla.core.config import FP8_DTYPES, dtype_name, is_fp8
from mla.core.errors import InvalidInputError, PlanMismatchError, ProviderUnavailableError
from mla.core.platform import Platform
from mla.core.support import Support
from mla.providers.aiter.capabilities import (
    AITER_FP8_PREFILL_DIMS,
    AITER_FP8_PREFILL_HEADS,
    AITER_LATENT_DIMS,
    ARCH_FP8,
    aiter_capabilities,
    real_kernel_limits,
)
from mla.providers.aiter.detect import AiterLibrary, detect_aiter
from mla.providers.aiter.lse import (
    clear_empty_rows,
    empty_decode_rows,
    empty_indptr_rows,
    empty_varlen_rows,
    kernel_returns_decode_lse,
    prefill_lse,
    reference_decode_lse,
    reference_small_head_lse,
)
from mla.providers.aiter.probes import AiterProbes, probe_library
from mla.providers.aiter.schedule import (
    DECODE_KV_GRANULARITY,
    FP8_PREFILL_KV_GRANULARITY,
    FP8_PREFILL_TILE_Q,
    AiterDecodeSchedule,
    AiterPrefillSchedule,
    allocate,
)
from mla.providers.base import KernelProvider
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    ExpandPagesCall,
    Fp8PrefillCall,
    Fp8PrefillPlanCall,
    MergeStatesCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    VarlenPrefillCall,
    WriteKVCall,
)
from mla.providers.quant import dequantize, quantize_per_tensor
from mla.providers.torch_ref import TorchProvider
from mla.providers.transforms import HeadPadding


def _fp8_kernel_heads(heads: int) -> int:
    """Heads aiter runs for an fp8 cache: ``mla_decode_fwd`` has no 24-head fp8 path (it
    asserts), so a native-24 record runs as 32 here; every other count is unchanged."""
    return 32 if heads == 24 else heads


def _decode_schedule(schedule: object) -> AiterDecodeSchedule:
    if not isinstance(schedule, AiterDecodeSchedule):
        raise PlanMismatchError(
            f"the aiter provider needs its own decode schedule, got {type(schedule).__name__}"
        )
    return schedule


def _rocm_device_support() -> Support:
    if torch.version.hip is None:
        return Support.no(
            "not-rocm-torch",
            f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None); "
            "aiter's kernels need ROCm PyTorch on an AMD GPU",
        )
    if not torch.cuda.is_available():
        return Support.no("no-rocm-device", "no ROCm GPU is visible (torch.cuda.is_available() is False)")
    return Support.yes()


class AiterProvider(KernelProvider):
    """AMD aiter's MLA kernels (gfx942 / gfx950).

    The keyword overrides replace a probe's answer (``None``: probe), e.g. ``native_h24=True``
    to see what ``mla explain`` would choose on a build with 24-head kernels; arch gates still
    apply (Gluon and the fp8 prefill exist on gfx950 only). ``require_rocm_device=False`` skips
    the ROCm-torch/device requirement of :meth:`availability`: for running aiter's API on CPU
    tensors against a fake aiter in tests; the real kernels need the device regardless.
    """

    name: ClassVar[str] = "aiter"

    def __init__(
        self,
        *,
        gluon: bool | None = None,
        fp8_prefill: bool | None = None,
        native_h24: bool | None = None,
        require_rocm_device: bool = True,
    ) -> None:
        self._gluon = gluon
        self._fp8_prefill = fp8_prefill
        self._native_h24 = native_h24
        self._require_device = require_rocm_device
        self._reference = TorchProvider()
        self._page_lens: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"AiterProvider({', '.join(f'{k}={v}' for k, v in self._overrides().items())})"

    def _overrides(self) -> dict[str, bool]:
        pairs = (("gluon", self._gluon), ("fp8_prefill", self._fp8_prefill), ("native_h24", self._native_h24))
        return {k: v for k, v in pairs if v is not None}

    # -- detection, probes, capabilities ------------------------------------------------------

    @functools.cached_property
    def library(self) -> AiterLibrary:
        """AMD aiter as found here (imported on first access)."""
        return detect_aiter()

    @functools.cached_property
    def probes(self) -> AiterProbes | None:
        """The feature probes of the imported aiter (``None`` when it is not available)."""
        module = self.library.module
        return probe_library(module) if module is not None else None

    @functools.cached_property
    def _device_support(self) -> Support:
        return _rocm_device_support() if self._require_device else Support.yes()

    def availability(self) -> Support:
        return self.library.support + self._device_support

    @classmethod
    def static_capabilities(cls, platform: Platform) -> ProviderCapabilities:
        """aiter's kernels as shipped on ``platform.arch`` (:func:`aiter_capabilities`); no aiter
        needed, the same on every machine."""
        return aiter_capabilities(platform.arch)

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        """The record for ``platform.arch``: aiter's table narrowed by what this build ships.

        Without an importable aiter it is the simulated record (gfx950 ships Gluon and the fp8
        prefill, gfx942 neither, native 24 heads off), so ``mla explain`` shows what aiter would
        choose; :meth:`availability` says why it cannot run here.
        """
        arch = platform.arch
        gfx950 = arch == "gfx950"
        probes = self.probes
        if probes is None:
            base = aiter_capabilities(
                arch,
                gluon=None if self._gluon is None else self._gluon and gfx950,
                fp8_prefill=None if self._fp8_prefill is None else self._fp8_prefill and gfx950,
                native_h24=bool(self._native_h24),
            )
            return real_kernel_limits(base, arch, decode_fp8=True)
        gluon = probes.gluon_fn is not None if self._gluon is None else self._gluon
        fp8_prefill = probes.fp8_prefill.ok if self._fp8_prefill is None else self._fp8_prefill
        native_h24 = probes.native_h24 if self._native_h24 is None else self._native_h24
        base = aiter_capabilities(
            arch, gluon=gluon and gfx950, fp8_prefill=fp8_prefill and gfx950, native_h24=native_h24
        )
        contracts = set(base.contracts)
        if not (probes.metadata_v1.ok and probes.reduce_v1.ok):
            contracts.discard(Contract.DECODE_SCHEDULE)
        if not probes.varlen.ok:
            contracts.discard(Contract.VARLEN_PREFILL)
        base = attrs.evolve(base, contracts=frozenset(contracts))
        return real_kernel_limits(base, arch, decode_fp8=probes.decode_fp8 and probes.fp8_dtype in FP8_DTYPES)

    def describe_probes(self) -> dict[str, object]:
        rows: dict[str, object] = {"aiter": self.library.describe()}
        if not self._device_support:
            rows["device"] = str(self._device_support)
        probes = self.probes
        if probes is None:
            rows["capabilities"] = (
                "simulated for the platform arch: gfx950 ships the Gluon small-head and fp8 "
                "prefill kernels, gfx942 neither; native 24 heads off"
            )
        else:
            rows.update(probes.rows())
            lse = "kernel (return_lse) where aiter has an lse kernel variant, else a reference pass"
            rows["decode_lse"] = lse if probes.decode_returns_lse else "reference pass (no return_lse)"
        overrides = self._overrides()
        if overrides:
            rows["overrides"] = ", ".join(f"{k}={v}" for k, v in overrides.items())
        return rows

    def _loaded(self) -> tuple[Any, AiterProbes]:
        """The aiter module and its probes, or :class:`ProviderUnavailableError`."""
        module, probes = self.library.module, self.probes
        if module is None or probes is None:
            raise ProviderUnavailableError(f"provider 'aiter' cannot run here: {self.library.support}")
        return module, probes

    def _ones(self, count: int, device: torch.device) -> torch.Tensor:
        """int32 ones ``[count]`` (``kv_last_page_lens`` with page size 1), cached per device."""
        buffer = self._page_lens.get(device)
        if buffer is None or buffer.numel() < count:
            buffer = torch.ones(max(count, 64), dtype=torch.int32, device=device)
            self._page_lens[device] = buffer
        return buffer[:count]

    # -- decode ---------------------------------------------------------------------------------

    @staticmethod
    def _check_fp8_cache(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, probes: AiterProbes) -> None:
        if kv_scale is None:
            raise InvalidInputError(
                "kv_scale", f"an fp8 kv_cache ({dtype_name(kv_cache.dtype)}) needs kv_scale"
            )
        if kv_cache.dtype != probes.fp8_dtype:
            raise InvalidInputError(
                "kv_cache",
                f"aiter on {probes.arch} reads fp8 as {dtype_name(probes.fp8_dtype)}, the cache is "
                f"{dtype_name(kv_cache.dtype)}; allocate the cache in aiter.dtypes.fp8",
            )

    @staticmethod
    def _kernel_query(
        q: torch.Tensor, kernel_heads: int, fp8_dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The contiguous query aiter sees: heads padded (tile-and-slice) to ``kernel_heads``;
        with an fp8 cache quantized per tensor to ``fp8_dtype`` (device ops, no sync)."""
        if kernel_heads != q.shape[1]:
            padded = torch.empty(q.shape[0], kernel_heads, q.shape[2], dtype=q.dtype, device=q.device)
            q = HeadPadding(q.shape[1], kernel_heads).pad(q, padded)
        if fp8_dtype is None:
            return q.contiguous(), None
        q8, scale = quantize_per_tensor(q, fp8_dtype)
        return q8.contiguous(), scale.reshape(1)

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        q, kv_cache, out, lse, kv_scale = call.q, call.kv_cache, call.out, call.lse, call.kv_scale
        qo_indptr, kv_indptr, max_qlen = call.qo_indptr, call.kv_indptr, call.max_qlen
        aiter, probes = self._loaded()
        rows, heads, width = q.shape
        fp8 = is_fp8(kv_cache.dtype)
        if fp8:
            self._check_fp8_cache(kv_cache, kv_scale, probes)
        kernel_heads = _fp8_kernel_heads(heads) if fp8 else heads
        q_kernel, q_scale = self._kernel_query(q, kernel_heads, probes.fp8_dtype if fp8 else None)
        if fp8 != is_fp8(q_kernel.dtype):
            raise PlanMismatchError("aiter decode: an fp8 cache needs an fp8 query (no a16w8 kernel)")
        batch = qo_indptr.numel() - 1
        persistent = call.schedule is not None
        kwargs: dict[str, Any] = {"sm_scale": float(call.softmax_scale)}
        if "page_size" in probes.decode_params:
            kwargs["page_size"] = 1
        if "nhead_kv" in probes.decode_params:
            kwargs["nhead_kv"] = 1
        if fp8:
            assert kv_scale is not None
            assert q_scale is not None
            kwargs["q_scale"] = q_scale
            kwargs["kv_scale"] = kv_scale.reshape(1)
        if persistent:
            plan = _decode_schedule(call.schedule)
            plan.check(
                batch=batch,
                qlen=max_qlen,
                heads=kernel_heads,
                q_dtype=q_kernel.dtype,
                kv_dtype=kv_cache.dtype,
            )
            plan.check_planned(batch=batch, qlen=max_qlen)
            kwargs.update(plan.decode_kwargs(max_qlen))
            page_lens = plan.kv_last_page_lens[:batch]
        else:
            page_lens = self._ones(batch, q.device)
        kernel_lse = (
            lse is not None
            and probes.decode_returns_lse
            and kernel_returns_decode_lse(
                probes.arch, persistent=persistent, fp8=fp8, heads=kernel_heads, qlen=max_qlen
            )
        )
        if kernel_lse:
            kwargs["return_lse"] = True
        target = out
        if kernel_heads != heads or not out.is_contiguous():
            target = torch.empty(rows, kernel_heads, out.shape[-1], dtype=out.dtype, device=out.device)
        # aiter may rebind the storage of the tensor it is handed (folded heads at qlen > 1:
        # ``o.set_(...)``), so it gets a fresh view and the result is copied back if moved.
        o_arg = target.view(target.shape)
        result = aiter.mla.mla_decode_fwd(
            q_kernel,
            kv_cache.view(-1, 1, 1, width),
            o_arg,
            qo_indptr,
            kv_indptr,
            call.kv_indices,
            page_lens,
            max_qlen,
            **kwargs,
        )
        if o_arg.data_ptr() != target.data_ptr():
            target.copy_(o_arg)
        if target is not out:
            out.copy_(target[:, :heads])
        if lse is not None and kernel_lse:
            lse.copy_(result[1].reshape(rows, kernel_heads)[:, :heads])
        elif lse is not None:
            reference_decode_lse(
                call, q if q_scale is None else dequantize(q_kernel[:, :heads], q_scale), lse
            )
        clear_empty_rows(out, lse, empty_decode_rows(qo_indptr, kv_indptr, rows))

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> AiterDecodeSchedule:
        max_batch, kv_dtype = call.max_batch, call.kv_dtype
        aiter, probes = self._loaded()
        fp8 = is_fp8(kv_dtype)
        heads = _fp8_kernel_heads(call.kernel_heads) if fp8 else call.kernel_heads
        kernel_q = probes.fp8_dtype if fp8 else call.q_dtype

        def info(qlen: int) -> Any:
            return aiter.get_mla_metadata_info_v1(
                max_batch, qlen, heads, kernel_q, kv_dtype, False, fast_mode=True
            )

        return AiterDecodeSchedule.allocate(
            info,
            max_batch=max_batch,
            max_kernel_qlen=call.max_kernel_qlen,
            kernel_heads=heads,
            q_dtype=kernel_q,
            kv_dtype=kv_dtype,
            device=call.device,
        )

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        batch_size, kernel_qlen = call.batch_size, call.kernel_qlen
        aiter, _ = self._loaded()
        plan = _decode_schedule(call.schedule)
        plan.check(
            batch=batch_size,
            qlen=kernel_qlen,
            heads=plan.kernel_heads,
            q_dtype=plan.q_dtype,
            kv_dtype=plan.kv_dtype,
        )
        aiter.get_mla_metadata_v1(
            call.qo_indptr[: batch_size + 1],
            call.kv_indptr[: batch_size + 1],
            plan.kv_last_page_lens[:batch_size],
            plan.kernel_heads,
            1,
            True,
            *plan.buffers(kernel_qlen),
            page_size=1,
            kv_granularity=DECODE_KV_GRANULARITY,
            max_seqlen_qo=kernel_qlen,
            uni_seqlen_qo=kernel_qlen if call.uniform_qlen else -1,
            fast_mode=True,
            dtype_q=plan.q_dtype,
            dtype_kv=plan.kv_dtype,
        )
        plan.planned_qlen, plan.planned_batch = kernel_qlen, batch_size

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        q_nope, q_pe, out, lse, kv_scale = call.q_nope, call.q_pe, call.out, call.lse, call.kv_scale
        _, probes = self._loaded()
        gluon = probes.gluon_fn
        if gluon is None:
            raise ProviderUnavailableError(f"provider 'aiter' has no Gluon small-head kernel: {probes.gluon}")
        rows, heads, rank = q_nope.shape
        if kv_scale is not None:
            # mla_gluon takes kv_scale as a Python float (a tensor would be read as a pointer):
            # scale the query and the output by the device tensor instead (no host sync).
            q_nope, q_pe = q_nope * kv_scale.to(q_nope.dtype), q_pe * kv_scale.to(q_pe.dtype)
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        kernel_lse = lse is not None and "return_lse" in probes.gluon_params
        extra: dict[str, Any] = {"return_lse": True} if kernel_lse else {}
        result = gluon(
            q_nope=q_nope,
            q_pe=q_pe,
            kv_c=call.kv_cache,
            o=target,
            page_table=call.page_table,
            seq_info=call.seq_info,
            sm_scale=float(call.softmax_scale),
            k_pe=None,
            kv_pe_offset=rank,
            use_2d_view=False,
            kv_scale=1.0,
            min_kv_seq_len=1,
            **extra,
        )
        if kv_scale is not None:
            target.mul_(kv_scale.to(target.dtype))
        if target is not out:
            out.copy_(target)
        if lse is not None and kernel_lse:
            lse.copy_(result[1].reshape(rows, heads))
        elif lse is not None:
            reference_small_head_lse(call, lse)
        clear_empty_rows(out, lse, empty_indptr_rows(call.seq_info, rows))

    # -- prefill --------------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        q, k, v, out, lse, causal = call.q, call.k, call.v, call.out, call.lse, call.causal
        cu_seqlens_q, cu_seqlens_k = call.cu_seqlens_q, call.cu_seqlens_k
        aiter, _ = self._loaded()
        rows = q.shape[0]
        if rows == 0:
            return
        if k.shape[0] == 0 or call.max_seqlen_k == 0:
            out.zero_()
            lse.fill_(float("-inf"))
            return
        result = aiter.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            call.max_seqlen_q,
            call.max_seqlen_k,
            softmax_scale=float(call.softmax_scale),
            causal=causal,
            return_lse=True,
        )
        out.copy_(result[0])
        lse.copy_(result[1].transpose(0, 1))  # aiter's softmax_lse is [H, T]
        clear_empty_rows(out, lse, empty_varlen_rows(cu_seqlens_q, cu_seqlens_k, rows, causal=causal))

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> AiterPrefillSchedule:
        num_heads, causal, device = call.num_heads, call.causal, call.device
        aiter, _ = self._loaded()
        cu_q = call.cu_seqlens_q_cpu.to(device="cpu", dtype=torch.int32)
        cu_k = call.cu_seqlens_k_cpu.to(device="cpu", dtype=torch.int32)
        batch = cu_q.numel() - 1
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if batch else 0
        specs = aiter.get_ps_metadata_info_v1(
            max(batch, 1), num_heads, max(max_q, 1), qlen_granularity=FP8_PREFILL_TILE_Q
        )
        meta, work_indptr, work_info, reduce_indptr, final_map, partial_map = allocate(specs, device)
        aiter.get_ps_metadata_v1(
            cu_q,
            cu_k,
            (cu_k[1:] - cu_k[:-1]).to(torch.int32),
            1,
            num_heads,
            meta,
            work_indptr,
            work_info,
            reduce_indptr,
            final_map,
            partial_map,
            qhead_granularity=1,
            qlen_granularity=FP8_PREFILL_TILE_Q,
            kvlen_granularity=FP8_PREFILL_KV_GRANULARITY,
            block_size=1,
            is_causal=causal,
        )
        return AiterPrefillSchedule(
            work_metadata=meta,
            work_indptr=work_indptr,
            work_info=work_info,
            reduce_indptr=reduce_indptr,
            reduce_final_map=final_map,
            reduce_partial_map=partial_map,
            kv_indices=torch.arange(int(cu_k[-1]), dtype=torch.int32, device=device),
            num_partial_tiles=int(reduce_indptr[-1]),  # a build-time sync, never in the run
            max_seqlen_q=max_q,
            cu_seqlens_q=tuple(int(x) for x in cu_q.tolist()),
            cu_seqlens_k=tuple(int(x) for x in cu_k.tolist()),
            num_heads=num_heads,
            causal=causal,
        )

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        q, k, v, out, lse, causal = call.q, call.k, call.v, call.out, call.lse, call.causal
        cu_seqlens_q, cu_seqlens_k, schedule = call.cu_seqlens_q, call.cu_seqlens_k, call.schedule
        q_scale, k_scale, softmax_scale = call.q_scale, call.k_scale, call.softmax_scale
        aiter, probes = self._loaded()
        if not isinstance(schedule, AiterPrefillSchedule):
            raise PlanMismatchError(
                f"the aiter fp8 prefill needs its own plan, got {type(schedule).__name__}"
            )
        rows, heads = q.shape[0], q.shape[1]
        planned = (schedule.cu_seqlens_q[-1], schedule.num_heads, schedule.causal)
        if planned != (rows, heads, causal):
            raise PlanMismatchError(
                f"aiter fp8 prefill plan is for (tokens, heads, causal) {planned}, the run has "
                f"{(rows, heads, causal)}"
            )
        value_dim = v.shape[-1]
        partial_rows = max(schedule.num_partial_tiles, 1) * FP8_PREFILL_TILE_Q
        split_out = torch.empty(partial_rows, heads, value_dim, dtype=torch.float32, device=q.device)
        split_lse = torch.empty(partial_rows, heads, dtype=torch.float32, device=q.device)
        target = out
        if out.dtype != torch.bfloat16 or not out.is_contiguous():
            target = torch.empty(rows, heads, value_dim, dtype=torch.bfloat16, device=q.device)
        aiter.mla_prefill_ps_asm_fwd(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            schedule.kv_indices,
            schedule.work_indptr,
            schedule.work_info,
            schedule.max_seqlen_q,
            float(softmax_scale),
            causal,
            split_out,
            split_lse,
            target,
            q_scale,
            k_scale,
            call.v_scale,
        )
        splits: tuple[int, ...] = (0,) if probes.reduce_takes_num_kv_splits else ()
        aiter.mla_reduce_v1(
            split_out,
            split_lse,
            schedule.reduce_indptr,
            schedule.reduce_final_map,
            schedule.reduce_partial_map,
            FP8_PREFILL_TILE_Q,
            *splits,
            target,
            None,
        )
        if target is not out:
            out.copy_(target)
        prefill_lse(
            dequantize(q, q_scale),
            dequantize(k, k_scale),
            list(schedule.cu_seqlens_q),
            list(schedule.cu_seqlens_k),
            scale=softmax_scale,
            causal=causal,
            out=lse,
        )
        clear_empty_rows(out, lse, empty_varlen_rows(cu_seqlens_q, cu_seqlens_k, rows, causal=causal))

    # -- utilities: the torch reference provider's device-side implementations -----------------

    def merge_states(self, call: MergeStatesCall) -> None:
        self._reference.merge_states(call)

    def expand_page_indices(self, call: ExpandPagesCall) -> None:
        self._reference.expand_page_indices(call)

    def write_kv(self, call: WriteKVCall) -> None:
        self._reference.write_kv(call)


__all__ = [
    "AITER_FP8_PREFILL_DIMS",
    "AITER_FP8_PREFILL_HEADS",
    "AITER_LATENT_DIMS",
    "ARCH_FP8",
    "AiterProvider",
]
