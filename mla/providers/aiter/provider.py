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

The decode calls live in :mod:`mla.providers.aiter.decode_calls`, the prefill calls in
:mod:`mla.providers.aiter.prefill_calls`; this module is the provider class over them.

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
from mla.core.config import FP8_DTYPES
from mla.core.errors import InvalidInputError, ProviderUnavailableError
from mla.core.platform import Platform
from mla.core.support import Support
from mla.providers.aiter import decode_calls, prefill_calls
from mla.providers.aiter.capabilities import (
    AITER_FP8_PREFILL_DIMS,
    AITER_FP8_PREFILL_HEADS,
    AITER_LATENT_DIMS,
    ARCH_FP8,
    aiter_capabilities,
    real_kernel_limits,
    with_native_h24,
)
from mla.providers.aiter.detect import AiterLibrary, detect_aiter
from mla.providers.aiter.probes import AiterProbes, probe_library
from mla.providers.aiter.schedule import AiterDecodeSchedule, AiterPrefillSchedule
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
from mla.providers.torch_ref import TorchProvider


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


AITER_FEATURES = frozenset({"native_h24"})
"""aiter's optional kernels that emulation and ``mla explain`` may assume present
(:meth:`AiterProvider.assume`)."""


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

    @classmethod
    def assume(
        cls, caps: ProviderCapabilities, platform: Platform, features: frozenset[str]
    ) -> ProviderCapabilities:
        """``caps`` with aiter's optional kernels in ``features`` assumed present: ``native_h24``
        (the native-H24 reducer and planner, :func:`with_native_h24`: 24 heads unpadded on
        gfx950). :class:`InvalidInputError` naming ``assume`` for any other feature."""
        unknown = features - AITER_FEATURES
        if unknown:
            raise InvalidInputError(
                "assume",
                f"aiter has no optional feature {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(AITER_FEATURES))}",
            )
        return with_native_h24(caps, platform.arch) if "native_h24" in features else caps

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

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        aiter, probes = self._loaded()
        decode_calls.paged_decode(aiter, probes, call, self._ones)

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> AiterDecodeSchedule:
        aiter, probes = self._loaded()
        return decode_calls.schedule_buffers(aiter, probes, call)

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        aiter, _ = self._loaded()
        decode_calls.plan_schedule(aiter, call)

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        _, probes = self._loaded()
        decode_calls.small_head_decode(probes, call)

    # -- prefill --------------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        aiter, _ = self._loaded()
        prefill_calls.varlen_attention(aiter, call)

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> AiterPrefillSchedule:
        aiter, _ = self._loaded()
        return prefill_calls.plan_fp8_prefill(aiter, call)

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        aiter, probes = self._loaded()
        prefill_calls.fp8_prefill(aiter, probes, call)

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
