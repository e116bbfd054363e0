"""Input validation shared by the engine's doors (the functional API, the backend's impl and
step checker): kinds, dtypes, devices, scales and options of what a caller passes (the host
rules of a paged step's values are in :mod:`mla.core.step_rules`).

Every rule raises :class:`InvalidInputError` naming the argument and what was expected, before
any kernel runs and before anything is written to caller outputs.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Literal

import torch

from mla.core.config import (
    DS_MLA_TILE,
    FP8_DTYPES,
    SOFTMAX_SCALE_HINT,
    ds_mla_row_bytes,
    dtype_name,
    is_ds_mla,
    is_fp8,
)
from mla.core.errors import InvalidInputError

INDEX_DTYPES = (torch.int32, torch.int64)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def require_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (ints and numpy-style integers; never a bool, float or str)."""
    if isinstance(value, bool | torch.Tensor) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(name, f"expected an int, got {_describe(value)}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise InvalidInputError(name, f"must be >= {minimum}, got {number}")
    return number


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(name, f"expected True or False, got {_describe(value)}")
    return value


def require_scale(name: str, value: object, *, hint: str = "") -> float:
    """``value`` as a finite positive Python float (a real number; never a bool, str or tensor)."""
    if isinstance(value, bool | torch.Tensor) or not isinstance(value, numbers.Real):
        raise InvalidInputError(
            name, f"expected a finite positive float, got {_describe(value)}" + (f"; {hint}" if hint else "")
        )
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise InvalidInputError(
            name, f"must be a finite positive float, got {number}" + (f"; {hint}" if hint else "")
        )
    return number


def require_softmax_scale(value: object) -> float:
    """The softmax scale of a functional call: required (no silent default), finite, > 0."""
    if value is None:
        raise InvalidInputError("softmax_scale", f"is required; {SOFTMAX_SCALE_HINT}")
    return require_scale("softmax_scale", value, hint=SOFTMAX_SCALE_HINT)


def check_cache_scale(
    value: object,
    kv_dtype: torch.dtype,
    *,
    device: torch.device | None = None,
    required: bool = True,
) -> None:
    """``kv_scale`` for a cache of ``kv_dtype``: for an fp8 cache a finite float > 0 or a
    one-element float tensor (on ``device`` when given; its value is checked only on the host,
    reading an accelerator's would be a sync), needed unless ``required`` is false; ``None``
    for a float cache (a scale there would be applied to values that are not scaled)."""
    fp8 = is_fp8(kv_dtype)
    if value is None:
        if fp8 and required:
            raise InvalidInputError(
                "kv_scale",
                f"an fp8 kv_cache ({dtype_name(kv_dtype)}) needs kv_scale, its per-tensor dequant "
                "scale (value = stored * kv_scale)",
            )
        return
    if not fp8:
        raise InvalidInputError(
            "kv_scale",
            f"{value!r} was given for a {dtype_name(kv_dtype)} kv_cache; only fp8 caches take a "
            "scale (it dequantizes them): pass kv_scale=None for a float cache",
        )
    if isinstance(value, torch.Tensor):
        check_kv_scale(value, device if device is not None else value.device)
        if value.device.type == "cpu":
            require_dequant_range(require_scale("kv_scale", float(value.detach().reshape(()))), kv_dtype)
        return
    require_dequant_range(require_scale("kv_scale", value), kv_dtype)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def require_dequant_range(scale: float, kv_dtype: torch.dtype) -> None:
    """The fp8 cache's largest value times ``scale`` stays finite in float32 (the kernels
    dequantize in float32: a larger scale made every output NaN)."""
    largest = torch.finfo(kv_dtype).max
    if scale * largest > _FLOAT32_MAX:
        raise InvalidInputError(
            "kv_scale",
            f"{scale:g} times the largest {dtype_name(kv_dtype)} value ({largest:g}) overflows "
            f"float32 (max {_FLOAT32_MAX:.3g}): the dequantized cache would be inf; use a scale "
            f"<= {_FLOAT32_MAX / largest:.3g}",
        )


def require_cache_dtype(kv_cache: object, dtype: torch.dtype) -> None:
    """A backend's ``kv_cache`` has the dtype of its ``KVCacheSpec`` (checked before
    ``kv_scale``, whose rule depends on the dtype: an fp8 cache handed to a bf16 backend is a
    cache problem, not a scale problem). ``None`` and non-tensors are left to other checks."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype != dtype:
        raise InvalidInputError(
            "kv_cache",
            f"is {dtype_name(kv_cache.dtype)} but the backend was built for a {dtype_name(dtype)} "
            f"cache (KVCacheSpec.dtype); pass the cache the backend was built for, or build a "
            f"backend with KVCacheSpec(dtype={dtype_name(kv_cache.dtype)})",
        )


def require_tensor(name: str, value: object, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(name, f"expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise InvalidInputError(name, f"expected {ndim} dims, got shape {tuple(value.shape)}")
    return value


def require_paged_cache(name: str, cache: torch.Tensor) -> None:
    """A paged cache ``[blocks, block_size, width]`` the kernels can read as flat rows
    ``[blocks * block_size, width]``: a contiguous last dim, and blocks laid out one after the
    other (``stride(0) == block_size * stride(1)``; a padded row stride is fine). A cache with
    permuted or sliced-block strides is refused naming ``name`` (``.contiguous()`` makes it
    readable)."""
    blocks, block_size, width = cache.shape
    strides = cache.stride()
    last_ok = width <= 1 or strides[2] == 1
    rows_ok = blocks <= 1 or block_size <= 1 or strides[0] == block_size * strides[1]
    if not (last_ok and rows_ok and (block_size <= 1 or strides[1] >= width)):
        raise InvalidInputError(
            name,
            f"strides {tuple(strides)} of shape {tuple(cache.shape)} cannot be read as flat rows "
            f"[{blocks * block_size}, {width}]: the cache needs a contiguous last dim and its "
            "blocks' rows one after the other (allocate it contiguous, or pass .contiguous())",
        )


def _byte_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``[first, last)`` bytes a tensor's elements can touch (``None``: no storage to share)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def require_no_overlap(
    name: str, tensor: torch.Tensor | None, *others: tuple[str, torch.Tensor | None]
) -> None:
    """The output ``tensor`` shares no memory with any of ``others`` (the inputs, the cache, the
    other output): an output written over an input or the KV cache gives a silently wrong
    result and corrupts the cache. Host metadata only (no sync)."""
    if tensor is None:
        return
    span = _byte_span(tensor)
    if span is None:
        return
    for other_name, other in others:
        if other is None or other.device != tensor.device:
            continue
        other_span = _byte_span(other)
        if other_span is not None and span[0] < other_span[1] and other_span[0] < span[1]:
            raise InvalidInputError(
                name,
                f"overlaps {other_name} in memory; the output is written while {other_name} is "
                f"read: pass a separate {name} tensor (or none)",
            )


def require_index(name: str, value: object, *, ndim: int) -> torch.Tensor:
    tensor = require_tensor(name, value, ndim=ndim)
    if tensor.dtype not in INDEX_DTYPES:
        raise InvalidInputError(name, f"expected int32 or int64, got {dtype_name(tensor.dtype)}")
    return tensor


def require_float(name: str, tensor: torch.Tensor, *, allow_fp8: bool = False) -> None:
    allowed = {torch.bfloat16, torch.float16, torch.float32} | (set(FP8_DTYPES) if allow_fp8 else set())
    if tensor.dtype not in allowed:
        names = sorted(dtype_name(d) for d in allowed)
        raise InvalidInputError(name, f"expected one of {names}, got {dtype_name(tensor.dtype)}")


def require_same_device(reference: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor]) -> None:
    ref_name, ref = reference
    for name, tensor in others:
        if tensor.device != ref.device:
            raise InvalidInputError(
                name, f"is on {tensor.device} but {ref_name} is on {ref.device}; move it to {ref.device}"
            )


ValidateMode = Literal["fast", "full"]
"""How much input checking the engine path does.

``"fast"`` (default): shapes, dtypes and devices, plus the rules on the host copies the caller
already has (``query_start_loc_cpu``, ``seq_lens_cpu``); never a device-to-host copy. Block ids
are not read on the host: an id outside the cache the run is handed (negative, past
``KVCacheSpec.num_blocks`` or past the cache tensor's own blocks) is masked by the kernels of
the torch and Triton providers: it reads no memory and counts as no key (never clamped into
another block). ``"full"``: a debug mode that also copies
``block_table`` (and ``seq_lens`` when no host copy was given) to the host and checks every
used block id against the cache.
"""

VALIDATE_MODES: tuple[str, ...] = ("fast", "full")


def require_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``; :class:`InvalidInputError` naming ``name`` otherwise."""
    if isinstance(value, str) and value in choices:
        return value
    expected = " or ".join(repr(choice) for choice in choices)
    raise InvalidInputError(name, f"expected {expected}, got {value!r}")


def require_validate_mode(value: object) -> ValidateMode:
    return "full" if require_choice("validate", value, VALIDATE_MODES) == "full" else "fast"


CallValidateMode = Literal["checked", "fast", "full"]
"""How much a functional call (``mla_decode``, ``mla_prefill``, ``write_kv``) checks.

``"checked"`` (default): the shapes, dtypes and devices, and the index values too, without
holding the launch back: the values are found bad on the device (by the work that reads them:
the decode's page-index fill, a max over ``slot_mapping``) or copied to the host, and read in
one small device-to-host copy after the launch; a bad value raises
:class:`~mla.core.errors.InvalidInputError` naming the argument (the outputs of that call are
unspecified). ``"fast"``: trusts the values (no read back; the kernels stay memory-safe: they
mask, skip or clamp what is outside). ``"full"``: the debug mode, the values read on the host
before any kernel runs."""

CALL_VALIDATE_MODES: tuple[str, ...] = ("checked", "fast", "full")


def require_call_validate_mode(value: object) -> CallValidateMode:
    """A functional call's ``validate`` (:data:`CallValidateMode`)."""
    mode = require_choice("validate", value, CALL_VALIDATE_MODES)
    return "checked" if mode == "checked" else "full" if mode == "full" else "fast"


def check_kv_scale(kv_scale: torch.Tensor, device: torch.device) -> None:
    """A device ``kv_scale``: one float element on ``device`` (its value is read by kernels)."""
    if kv_scale.numel() != 1 or kv_scale.dim() > 1:
        raise InvalidInputError(
            "kv_scale", f"expected a float, a 0-d or a one-element tensor, got shape {tuple(kv_scale.shape)}"
        )
    if not kv_scale.dtype.is_floating_point:
        raise InvalidInputError("kv_scale", f"expected a float tensor, got {dtype_name(kv_scale.dtype)}")
    if kv_scale.device.type != device.type:
        raise InvalidInputError(
            "kv_scale", f"is on {kv_scale.device} but the data is on {device}; keep it on {device}"
        )


def check_write_kv(
    kv_c: object,
    k_pe: object,
    kv_cache: object,
    slot_mapping: object,
    kv_scale: float | torch.Tensor | None,
) -> None:
    """Shapes, dtypes and devices of a KV write (``concat_and_cache_mla`` order)."""
    latent = require_tensor("kv_c", kv_c, ndim=2)
    rope = require_tensor("k_pe", k_pe, ndim=2)
    cache = require_tensor("kv_cache", kv_cache, ndim=3)
    slots = require_index("slot_mapping", slot_mapping, ndim=1)
    require_float("kv_c", latent)
    require_float("k_pe", rope)
    ds_mla = is_ds_mla(cache.dtype)
    if not ds_mla:
        require_float("kv_cache", cache, allow_fp8=True)
    require_paged_cache("kv_cache", cache)
    require_same_device(("kv_cache", cache), ("kv_c", latent), ("k_pe", rope), ("slot_mapping", slots))
    num_new = latent.shape[0]
    if rope.shape[0] != num_new:
        raise InvalidInputError("k_pe", f"has {rope.shape[0]} rows but kv_c has {num_new}")
    if slots.shape[0] != num_new:
        raise InvalidInputError("slot_mapping", f"has {slots.shape[0]} entries for {num_new} new rows")
    width = latent.shape[1] + rope.shape[1]
    if ds_mla:
        width = ds_mla_row_bytes(latent.shape[1], rope.shape[1])
        if latent.shape[1] % DS_MLA_TILE:
            raise InvalidInputError(
                "kv_c",
                f"an fp8_ds_mla cache needs kv_lora_rank a multiple of {DS_MLA_TILE}, got {latent.shape[1]}",
            )
    if cache.shape[-1] != width:
        what = "fp8_ds_mla row bytes of kv_c and k_pe" if ds_mla else "kv_c + k_pe widths"
        raise InvalidInputError("kv_cache", f"last dim {cache.shape[-1]} must be the {what} = {width}")
    check_cache_scale(kv_scale, cache.dtype, device=cache.device)


def require_slots_inside(slot_mapping_cpu: torch.Tensor, *, num_blocks: int, block_size: int) -> None:
    """Every slot of a KV write's ``slot_mapping`` (host values) is below the cache's
    ``num_blocks * block_size`` slots; a negative slot marks a token not to write (padding)."""
    capacity = num_blocks * block_size
    outside = slot_mapping_cpu >= capacity
    if bool(outside.any()):
        bad = int(torch.nonzero(outside)[0, 0])
        raise InvalidInputError(
            "slot_mapping",
            f"token {bad} has slot {int(slot_mapping_cpu[bad])} outside the cache's {capacity} slots "
            f"({num_blocks} blocks x {block_size}); slots are block * block_size + offset (-1: skip "
            "the token)",
        )


def check_slots(slot_mapping_cpu: torch.Tensor, *, num_blocks: int, block_size: int) -> None:
    """Host rules of a KV write's ``slot_mapping`` (``validate="full"``): every non-negative
    slot is inside the cache (:func:`require_slots_inside`) and no two tokens share one."""
    slots = slot_mapping_cpu.to(torch.int64)
    require_slots_inside(slots, num_blocks=num_blocks, block_size=block_size)
    live = slots[slots >= 0]
    values, counts = torch.unique(live, return_counts=True)
    if bool((counts > 1).any()):
        raise InvalidInputError(
            "slot_mapping",
            f"slot {int(values[counts > 1][0])} is written by more than one token; give each token "
            "its own slot",
        )
