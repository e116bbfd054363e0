"""Feature probes of an imported AMD aiter: which MLA kernels this build ships.

aiter's MLA surface changes between builds (the PyPI wheel ``amd-aiter 0.1.7`` lacks the Gluon
and fp8-prefill kernels and ``mla_decode_fwd``'s ``return_lse``; native 24-head support needs
both the reducer and the metadata planner), so each kernel is probed on its own, the way vLLM's
ROCM_AITER_MLA backend does. The probes run once per provider
(:meth:`AiterProvider.describe_probes` shows them) and decide its capability record.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from mla.core.config import dtype_name

GLUON_MODULES: tuple[tuple[str, str], ...] = (
    ("aiter.ops.triton.gluon.mla_gluon", "mla_gluon"),
    ("aiter.ops.triton.gluon.mla_decode_gluon", "mla_decode_gluon"),
)
"""The small-head Gluon kernel: the current module first, then the legacy name."""
FP8_PREFILL_KERNELS = (
    "mla_prefill_ps_asm_fwd",
    "mla_reduce_v1",
    "get_ps_metadata_info_v1",
    "get_ps_metadata_v1",
)
METADATA_V1_KERNELS = ("get_mla_metadata_info_v1", "get_mla_metadata_v1")
H24_REDUCER = ("kernels/mla/reduce.cu", "MLA_REDUCE_CASE_EF(NUM_HEAD,24,HEAD_DIM,512,")
"""(source under ``aiter.jit.core.AITER_CSRC_DIR``, whitespace-free marker) of the 24-head reducer."""
H24_PLANNER = ("kernels/mla/metadata/v1_2_device.cuh", "num_heads==24")
"""The same for the persistent metadata planner (vLLM PR #51647: both must have 24 heads)."""
DECODE_PARAMETERS = ("q_scale", "kv_scale", "return_lse", "page_size", "nhead_kv")
"""``mla_decode_fwd`` parameters whose presence changes how the provider calls it."""

AnyCallable = Callable[..., Any]


@attrs.frozen
class Probe:
    """One probe's answer: ``ok`` and a readable detail (what was found, or what is missing)."""

    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'yes' if self.ok else 'no'}: {self.detail}"


def _callable_attrs(module: ModuleType, names: tuple[str, ...]) -> Probe:
    missing = [n for n in names if not callable(getattr(module, n, None))]
    if missing:
        return Probe(False, "aiter lacks " + ", ".join(f"aiter.{n}" for n in missing))
    return Probe(True, ", ".join(f"aiter.{n}" for n in names))


def _parameters(fn: object) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return frozenset()


def probe_arch() -> tuple[str, str]:
    """``(arch, where it came from)``: aiter's own ``get_gfx()``, else the ROCm device."""
    try:
        chip_info = importlib.import_module("aiter.jit.utils.chip_info")
        arch = str(chip_info.get_gfx())
    except Exception as exc:  # a probe reports failures instead of raising
        if torch.cuda.is_available() and torch.version.hip is not None:
            name = str(getattr(torch.cuda.get_device_properties(0), "gcnArchName", "unknown"))
            return name.split(":", maxsplit=1)[0], "torch.cuda.get_device_properties(0).gcnArchName"
        return "unknown", f"aiter.jit.utils.chip_info.get_gfx() failed: {type(exc).__name__}: {exc}"
    return arch, "aiter.jit.utils.chip_info.get_gfx()"


def probe_gluon() -> tuple[AnyCallable | None, Probe]:
    """The Gluon small-head kernel (current module, then legacy), as vLLM's ``_get_mla_gluon``."""
    failures = []
    for module_name, attr in GLUON_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                failures.append(f"{module_name} not found")
                continue
            failures.append(f"{module_name} imports the missing module {exc.name}")
            continue
        except Exception as exc:  # a probe reports failures instead of raising
            failures.append(f"{module_name} failed to import: {type(exc).__name__}: {exc}")
            continue
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn, Probe(True, f"{module_name}.{attr}")
        failures.append(f"{module_name} has no {attr}")
    return None, Probe(False, "; ".join(failures))


def probe_source_marker(relative: str, marker: str) -> Probe:
    """Whether aiter's shipped C++ source ``relative`` contains ``marker`` (whitespace ignored)."""
    try:
        core = importlib.import_module("aiter.jit.core")
        path = Path(str(core.AITER_CSRC_DIR)) / relative
        text = "".join(path.read_text().split())
    except (ImportError, AttributeError, OSError) as exc:
        return Probe(False, f"cannot read {relative}: {type(exc).__name__}: {exc}")
    if marker in text:
        return Probe(True, f"{relative} has {marker}")
    return Probe(False, f"{relative} lacks {marker}")


@attrs.frozen(eq=False)
class AiterProbes:
    """Every probe of one imported aiter."""

    arch: str
    arch_source: str
    fp8_dtype: torch.dtype
    """``aiter.dtypes.fp8``: the fp8 format aiter's kernels read on this arch."""
    gluon_fn: AnyCallable | None
    gluon: Probe
    gluon_params: frozenset[str]
    fp8_prefill: Probe
    metadata_v1: Probe
    reduce_v1: Probe
    reduce_params: frozenset[str]
    h24_reducer: Probe
    h24_planner: Probe
    decode_params: frozenset[str]
    varlen: Probe

    @property
    def native_h24(self) -> bool:
        return self.h24_reducer.ok and self.h24_planner.ok

    @property
    def decode_fp8(self) -> bool:
        """``mla_decode_fwd`` takes the per-tensor q/kv scales an fp8 cache needs."""
        return {"q_scale", "kv_scale"} <= self.decode_params

    @property
    def decode_returns_lse(self) -> bool:
        return "return_lse" in self.decode_params

    @property
    def reduce_takes_num_kv_splits(self) -> bool:
        """``mla_reduce_v1`` has ``num_kv_splits`` between ``max_seqlen_q`` and the output
        (ROCm/aiter#3391); builds before it take the output there. An unreadable signature is
        taken as the current one."""
        return "num_kv_splits" in self.reduce_params or "final_output" not in self.reduce_params

    def rows(self) -> dict[str, str]:
        """Readable probe results for ``mla info``."""
        present = [p for p in DECODE_PARAMETERS if p in self.decode_params]
        absent = [p for p in DECODE_PARAMETERS if p not in self.decode_params]
        signature = "takes " + ", ".join(present) + (f"; lacks {', '.join(absent)}" if absent else "")
        return {
            "arch": f"{self.arch} (from {self.arch_source})",
            "fp8_dtype": dtype_name(self.fp8_dtype),
            "gluon_small_head": str(self.gluon),
            "fp8_prefill": str(self.fp8_prefill),
            "persistent_metadata_v1": str(self.metadata_v1),
            "reduce_v1": str(self.reduce_v1),
            "native_h24": f"{'yes' if self.native_h24 else 'no'} (reducer {self.h24_reducer}; "
            f"planner {self.h24_planner})",
            "mla_decode_fwd": signature,
            "flash_attn_varlen_func": str(self.varlen),
        }


def probe_library(module: ModuleType) -> AiterProbes:
    """Run every probe against the imported AMD aiter ``module``."""
    arch, arch_source = probe_arch()
    gluon_fn, gluon = probe_gluon()
    mla_module = importlib.import_module("aiter.mla")
    reduce_fn = getattr(module, "mla_reduce_v1", None)
    varlen_fn = getattr(module, "flash_attn_varlen_func", None)
    varlen_params = _parameters(varlen_fn) if callable(varlen_fn) else frozenset()
    if not callable(varlen_fn):
        varlen = Probe(False, "aiter lacks aiter.flash_attn_varlen_func")
    elif "return_lse" not in varlen_params:
        varlen = Probe(False, "aiter.flash_attn_varlen_func has no return_lse parameter")
    else:
        varlen = Probe(True, "aiter.flash_attn_varlen_func(return_lse=True)")
    fp8 = getattr(module.dtypes, "fp8", None)
    return AiterProbes(
        arch=arch,
        arch_source=arch_source,
        fp8_dtype=fp8 if isinstance(fp8, torch.dtype) else torch.uint8,
        gluon_fn=gluon_fn,
        gluon=gluon,
        gluon_params=_parameters(gluon_fn) if gluon_fn is not None else frozenset(),
        fp8_prefill=_callable_attrs(module, FP8_PREFILL_KERNELS),
        metadata_v1=_callable_attrs(module, METADATA_V1_KERNELS),
        reduce_v1=_callable_attrs(module, ("mla_reduce_v1",)),
        reduce_params=_parameters(reduce_fn) if callable(reduce_fn) else frozenset(),
        h24_reducer=probe_source_marker(*H24_REDUCER),
        h24_planner=probe_source_marker(*H24_PLANNER),
        decode_params=_parameters(mla_module.mla_decode_fwd),
        varlen=varlen,
    )
