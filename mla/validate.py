"""Input validation shared by the functional API and the metadata builder.

Every rule raises :class:`InvalidInputError` naming the argument and what was expected, before
any kernel runs and before anything is written to caller outputs.
"""

from __future__ import annotations

from typing import Literal

import torch

from mla.config import FP8_DTYPES, dtype_name, is_fp8
from mla.errors import InvalidInputError

INDEX_DTYPES = (torch.int32, torch.int64)


def require_tensor(name: str, value: object, *, ndim: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(name, f"expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
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
    if is_fp8(cache.dtype) and kv_scale is None:
        raise InvalidInputError("kv_scale", f"an fp8 kv_cache ({dtype_name(cache.dtype)}) needs kv_scale")
    if not is_fp8(cache.dtype) and kv_scale is not None:
        raise InvalidInputError(
            "kv_scale", f"given for a {dtype_name(cache.dtype)} cache; only fp8 caches take a scale"
        )
    if isinstance(kv_scale, torch.Tensor):
        check_kv_scale(kv_scale, cache.device)
