"""The device a backend runs on: vendor, arch, compute units and selection knobs.

Detected once with :func:`detect_platform`, or built by hand (:func:`simulated_platform`) so any
platform's decisions can be reproduced and tested on a CPU.
"""

from __future__ import annotations

import os
import re
from typing import Literal

import attrs
import torch

from mla.core.errors import InvalidInputError, input_validator

SmallHeadMode = Literal["auto", "gluon", "asm"]
Fp8PrefillMode = Literal["auto", "on", "off"]

SMALL_HEAD_MODES: tuple[SmallHeadMode, ...] = ("auto", "gluon", "asm")
FP8_PREFILL_MODES: tuple[Fp8PrefillMode, ...] = ("auto", "on", "off")

SMALL_HEAD_MODE_ENV = ("MLA_SMALL_HEAD_MODE", "VLLM_ROCM_AITER_MLA_ASM_PADDING")
"""Environment variables read (first set wins) for the small-head mode; the second is the name
vLLM users know from the ROCm AITER MLA backend."""
FP8_PREFILL_ENV = "MLA_FP8_PREFILL"

# Compute-unit counts used when an arch is simulated without a device.
_SIMULATED_UNITS: dict[str, int] = {
    "gfx90a": 104,
    "gfx942": 304,
    "gfx950": 256,
    "sm80": 108,
    "sm86": 72,
    "sm89": 142,
    "sm90": 132,
    "sm100": 148,
    "sm120": 170,
    "cpu": 8,
}

KNOWN_ARCHS: tuple[str, ...] = tuple(_SIMULATED_UNITS)
"""Arch names :func:`simulated_platform` accepts, in their canonical spelling (what
:func:`detect_platform` reports: ``gfx`` + the ROCm target, ``sm`` + CUDA major and minor)."""

ARCH_ALIASES: dict[str, str] = {
    "mi250": "gfx90a",
    "mi250x": "gfx90a",
    "mi300a": "gfx942",
    "mi300x": "gfx942",
    "mi325x": "gfx942",
    "mi350x": "gfx950",
    "mi355x": "gfx950",
    "a100": "sm80",
    "a10": "sm86",
    "l40s": "sm89",
    "h100": "sm90",
    "h200": "sm90",
    "h20": "sm90",
    "h800": "sm90",
    "b200": "sm100",
    "gb200": "sm100",
}
"""Product names accepted for their arch."""

_CUDA_ARCH = re.compile(r"(?:sm|compute)_?(\d{2,3})[af]?")


def normalize_arch(name: object, *, argument: str = "arch") -> str:
    """The canonical spelling of an arch name, or :class:`InvalidInputError` naming ``argument``.

    Accepts the canonical names (:data:`KNOWN_ARCHS`), CUDA spellings (``sm_90``, ``sm_90a``,
    ``SM90`` -> ``sm90``), ROCm target strings with features (``gfx942:sramecc+:xnack-`` ->
    ``gfx942``) and product names (:data:`ARCH_ALIASES`, e.g. ``mi300x`` -> ``gfx942``).
    """
    if not isinstance(name, str):
        raise InvalidInputError(argument, f"expected an arch name (str), got {type(name).__name__}")
    key = name.strip().lower().split(":")[0]
    match = _CUDA_ARCH.fullmatch(key)
    canonical = ARCH_ALIASES.get(key) or (f"sm{match.group(1)}" if match else key)
    if canonical not in _SIMULATED_UNITS:
        raise InvalidInputError(
            argument,
            f"unknown arch {name!r}; expected one of {', '.join(KNOWN_ARCHS)} (CUDA spellings such as "
            "sm_90 and product names such as mi300x or h100 are accepted too)",
        )
    return canonical


@attrs.frozen
class Knobs:
    """User preferences that steer selection (never correctness).

    ``small_head_mode``: ``auto`` (Gluon-style kernels for head counts that divide the provider's
    head granularity), ``gluon`` (always prefer them), ``asm`` (never prefer them).
    ``fp8_prefill``: ``auto`` (fp8 prefill when the KV cache is fp8), ``on``, ``off``.
    """

    small_head_mode: SmallHeadMode = attrs.field(
        default="auto",
        validator=input_validator(
            attrs.validators.in_(SMALL_HEAD_MODES), "one of " + "/".join(SMALL_HEAD_MODES)
        ),
    )
    fp8_prefill: Fp8PrefillMode = attrs.field(
        default="auto",
        validator=input_validator(
            attrs.validators.in_(FP8_PREFILL_MODES), "one of " + "/".join(FP8_PREFILL_MODES)
        ),
    )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Knobs:
        """Read the knobs from the environment (case-insensitive values; unset means auto)."""
        env = dict(os.environ) if environ is None else environ
        mode, mode_source = "auto", SMALL_HEAD_MODE_ENV[0]
        for name in SMALL_HEAD_MODE_ENV:
            if env.get(name):
                mode, mode_source = env[name].strip().lower(), name
                break
        fp8 = env.get(FP8_PREFILL_ENV, "auto").strip().lower() or "auto"
        checks = ((mode_source, mode, SMALL_HEAD_MODES), (FP8_PREFILL_ENV, fp8, FP8_PREFILL_MODES))
        for source, value, allowed in checks:
            if value not in allowed:
                choices = "/".join(allowed)
                raise InvalidInputError(source, f"environment value {value!r} is not one of {choices}")
        return cls(small_head_mode=mode, fp8_prefill=fp8)  # type: ignore[arg-type]


@attrs.frozen
class Platform:
    """Where kernels run. ``arch`` is ``gfx942``/``gfx950`` (AMD), ``sm90`` (NVIDIA), ``cpu``..."""

    vendor: Literal["amd", "nvidia", "cpu"]
    arch: str
    num_compute_units: int = attrs.field(validator=input_validator(attrs.validators.gt(0), "> 0"))
    knobs: Knobs = Knobs()
    device_type: str = "cpu"
    """The torch device type tensors live on (``cuda`` for both NVIDIA and ROCm)."""

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "cuda"

    def with_knobs(
        self,
        *,
        small_head_mode: SmallHeadMode | None = None,
        fp8_prefill: Fp8PrefillMode | None = None,
    ) -> Platform:
        """A copy with the given knobs changed (``None`` keeps the current value)."""
        knobs = Knobs(
            small_head_mode=small_head_mode or self.knobs.small_head_mode,
            fp8_prefill=fp8_prefill or self.knobs.fp8_prefill,
        )
        return attrs.evolve(self, knobs=knobs)


def simulated_platform(arch: str, *, knobs: Knobs | None = None) -> Platform:
    """A platform for ``arch`` without its device (for explain, tests and emulation on a CPU).

    ``arch`` is normalized by :func:`normalize_arch` (``sm_90`` -> ``sm90``); an unknown name
    raises :class:`InvalidInputError`."""
    arch = normalize_arch(arch)
    if arch.startswith("gfx"):
        vendor: Literal["amd", "nvidia", "cpu"] = "amd"
    elif arch.startswith("sm"):
        vendor = "nvidia"
    else:
        vendor = "cpu"
    units = _SIMULATED_UNITS[arch]
    return Platform(vendor=vendor, arch=arch, num_compute_units=units, knobs=knobs or Knobs())


def detect_platform(device: torch.device | str | None = None, *, knobs: Knobs | None = None) -> Platform:
    """The platform of ``device`` (default: the current CUDA/ROCm device, else the CPU)."""
    knobs = knobs if knobs is not None else Knobs.from_env()
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if torch.version.hip is not None:
            arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
            return Platform("amd", arch, props.multi_processor_count, knobs, "cuda")
        arch = f"sm{props.major}{props.minor}"
        return Platform("nvidia", arch, props.multi_processor_count, knobs, "cuda")
    return Platform("cpu", "cpu", max(1, os.cpu_count() or 1), knobs, "cpu")


def resolve_platform(
    spec: Platform | str | None, device: torch.device | str | None = None, *, argument: str = "platform"
) -> Platform:
    """``spec`` as a :class:`Platform`: a platform as is, an arch name simulated
    (:func:`simulated_platform`), or ``None`` for the platform of ``device`` (detected).
    Anything else raises :class:`InvalidInputError` naming ``argument``."""
    if isinstance(spec, Platform):
        return spec
    if isinstance(spec, str):
        return simulated_platform(normalize_arch(spec, argument=argument))
    if spec is None:
        return detect_platform(device)
    raise InvalidInputError(
        argument, f"expected a Platform, an arch name such as 'gfx950', or None; got {type(spec).__name__}"
    )
