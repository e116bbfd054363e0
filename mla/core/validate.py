"""Input validation shared by the functional API and the metadata builder.

Every rule raises :class:`InvalidInputError` naming the argument and what was expected, before
any kernel runs and before anything is written to caller outputs.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Literal

import torch

from mla.core.config import FP8_DTYPES, dtype_name, is_fp8
from mla.core.errors import InvalidInputError

INDEX_DTYPES = (torch.int32, torch.int64)

SOFTMAX_SCALE_HINT = (
    "pass the model's softmax scale, e.g. 192**-0.5 for DeepSeek-V3's qk head dim 192 (times "
    "YaRN's mscale**2 when the model uses YaRN rope scaling); kernels' 1/sqrt(576) is never right"
)


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
            require_scale("kv_scale", float(value.detach().reshape(())))
        return
    require_scale("kv_scale", value)


def require_tensor(name: str, value: object, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(name, f"expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise InvalidInputError(name, f"expected {ndim} dims, got shape {tuple(value.shape)}")
    return value


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


def check_indptr(name: str, indptr_cpu: torch.Tensor, *, total: int | None = None) -> None:
    """``indptr`` starts at 0, never decreases and (if given) ends at most at ``total``."""
    if indptr_cpu.numel() == 0:
        raise InvalidInputError(name, "expected at least one entry ([B+1] with B >= 0)")
    if int(indptr_cpu[0]) != 0:
        raise InvalidInputError(name, f"must start at 0, got {int(indptr_cpu[0])}")
    steps = indptr_cpu[1:] - indptr_cpu[:-1]
    if bool((steps < 0).any()):
        bad = int(torch.nonzero(steps < 0)[0, 0])
        raise InvalidInputError(
            name,
            f"must be non-decreasing (monotonic); entry {bad + 1} ({int(indptr_cpu[bad + 1])}) "
            f"< entry {bad} ({int(indptr_cpu[bad])})",
        )
    if total is not None and int(indptr_cpu[-1]) > total:
        raise InvalidInputError(name, f"ends at {int(indptr_cpu[-1])} but there are only {total} rows")


ValidateMode = Literal["fast", "full"]
"""How much input checking the engine path does.

``"fast"`` (default): shapes, dtypes and devices, plus the rules on the host copies the caller
already has (``query_start_loc_cpu``, ``seq_lens_cpu``); never a device-to-host copy. Block ids
are trusted; the kernels' own bounds decide what out-of-range ids do (the device-side index fill
used without host lengths clamps them to the cache). ``"full"``: a debug mode that also copies
``block_table`` (and ``seq_lens`` when no host copy was given) to the host and checks every
used block id against the cache.
"""

VALIDATE_MODES: tuple[str, ...] = ("fast", "full")


def require_validate_mode(value: object) -> ValidateMode:
    if value == "fast":
        return "fast"
    if value == "full":
        return "full"
    raise InvalidInputError("validate", f"expected 'fast' or 'full', got {value!r}")


def check_paged_requests(
    *,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table_shape: tuple[int, ...],
    block_size: int,
    max_model_len: int | None = None,
) -> None:
    """The paged-KV rules the host can check: seq_len covers the query, the block table has a
    row per request and enough columns for every seq_len. ``seq_len == 0`` marks a
    graph-padding request (any qlen, no keys)."""
    qlens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    lens = seq_lens_cpu.to(torch.int64)
    if lens.numel() != qlens.numel():
        raise InvalidInputError(
            "seq_lens", f"has {lens.numel()} entries but query_start_loc describes {qlens.numel()} requests"
        )
    if lens.numel() == 0:
        return
    needed = (lens + block_size - 1) // block_size
    width = block_table_shape[1]
    # One fused test on the fast path; the detailed rules below only name the failure.
    if (
        bool(((lens < 0) | ((lens > 0) & (lens < qlens)) | (needed > width)).any())
        or block_table_shape[0] < lens.numel()
        or (max_model_len is not None and int(lens.max()) > max_model_len)
    ):
        _explain_paged_requests(qlens, lens, needed, block_table_shape, block_size, max_model_len)


def _explain_paged_requests(
    qlens: torch.Tensor,
    lens: torch.Tensor,
    needed: torch.Tensor,
    block_table_shape: tuple[int, ...],
    block_size: int,
    max_model_len: int | None,
) -> None:
    if bool((lens < 0).any()):
        raise InvalidInputError("seq_lens", "must be >= 0")
    short = (lens > 0) & (lens < qlens)
    if bool(short.any()):
        b = int(torch.nonzero(short)[0, 0])
        raise InvalidInputError(
            "seq_lens",
            f"request {b} has seq_len {int(lens[b])} < its query length {int(qlens[b])}; seq_len "
            "counts the KV including the new tokens (0 marks a graph-padding request)",
        )
    if max_model_len is not None and int(lens.max()) > max_model_len:
        raise InvalidInputError(
            "seq_lens", f"max seq_len {int(lens.max())} exceeds the engine's max_model_len {max_model_len}"
        )
    if block_table_shape[0] < lens.numel():
        raise InvalidInputError("block_table", f"has {block_table_shape[0]} rows for {lens.numel()} requests")
    width = block_table_shape[1]
    b = int(torch.argmax(needed))
    raise InvalidInputError(
        "block_table",
        f"request {b} needs {int(needed[b])} blocks of {block_size} for seq_len {int(lens[b])} "
        f"but block_table has {width} columns",
    )


def check_block_ids(
    *, seq_lens_cpu: torch.Tensor, block_table_cpu: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """Every block id a request uses (the first ``ceil(seq_len / block_size)`` of its row) is
    inside the cache. Needs the block table on the host: ``validate="full"`` only."""
    lens = seq_lens_cpu.to(torch.int64)
    width = block_table_cpu.shape[1]
    if lens.numel() == 0 or width == 0:
        return
    needed = (lens + block_size - 1) // block_size
    cols = torch.arange(width)[None, :]
    used = cols < needed[:, None]
    table = block_table_cpu[: lens.numel()].to(torch.int64)
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, c = (int(x) for x in torch.nonzero(bad)[0])
        raise InvalidInputError(
            "block_table",
            f"block id {int(table[b, c])} (request {b}, column {c}) is outside the cache's "
            f"{num_blocks} blocks",
        )


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
    require_float("kv_cache", cache, allow_fp8=True)
    require_same_device(("kv_cache", cache), ("kv_c", latent), ("k_pe", rope), ("slot_mapping", slots))
    num_new = latent.shape[0]
    if rope.shape[0] != num_new:
        raise InvalidInputError("k_pe", f"has {rope.shape[0]} rows but kv_c has {num_new}")
    if slots.shape[0] != num_new:
        raise InvalidInputError("slot_mapping", f"has {slots.shape[0]} entries for {num_new} new rows")
    width = latent.shape[1] + rope.shape[1]
    if cache.shape[-1] != width:
        raise InvalidInputError(
            "kv_cache", f"last dim {cache.shape[-1]} must be kv_c + k_pe widths = {width}"
        )
    check_cache_scale(kv_scale, cache.dtype, device=cache.device)


def check_slots(slot_mapping_cpu: torch.Tensor, *, num_blocks: int, block_size: int) -> None:
    """Host rules of a KV write's ``slot_mapping`` (``validate="full"``): every non-negative
    slot is inside the cache and no two tokens share one (negative slots are skipped)."""
    slots = slot_mapping_cpu.to(torch.int64)
    capacity = num_blocks * block_size
    outside = slots >= capacity
    if bool(outside.any()):
        bad = int(torch.nonzero(outside)[0, 0])
        raise InvalidInputError(
            "slot_mapping",
            f"token {bad} has slot {int(slots[bad])} outside the cache's {capacity} slots ({num_blocks} "
            f"blocks x {block_size}); slots are block * block_size + offset",
        )
    live = slots[slots >= 0]
    values, counts = torch.unique(live, return_counts=True)
    if bool((counts > 1).any()):
        raise InvalidInputError(
            "slot_mapping",
            f"slot {int(values[counts > 1][0])} is written by more than one token; give each token "
            "its own slot",
        )


def used_cache_blocks(block_table_cpu: torch.Tensor, lens_cpu: torch.Tensor, block_size: int) -> int:
    """Blocks a cache needs for the first ``ceil(len / block_size)`` columns of each row of the
    host block table: the largest block id read, plus one (0 when nothing is read)."""
    lens = lens_cpu.to(torch.int64)
    if lens.numel() == 0 or block_table_cpu.shape[1] == 0:
        return 0
    needed = (lens + block_size - 1) // block_size
    used = torch.arange(block_table_cpu.shape[1])[None, :] < needed[:, None]
    if not bool(used.any()):
        return 0
    table = block_table_cpu[: lens.numel()].to(torch.int64)
    return int(table[used].max()) + 1
