"""Input validation shared by the functional API and the metadata builder.

Every rule raises :class:`InvalidInputError` naming the argument and what was expected, before
any kernel runs and before anything is written to caller outputs.
"""

from __future__ import annotations

import torch

from mla.config import FP8_DTYPES, dtype_name
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


def check_paged_requests(
    *,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table_cpu: torch.Tensor,
    block_size: int,
    num_blocks: int,
    max_model_len: int | None = None,
) -> None:
    """The paged-KV rules: seq_len covers the query, block_table covers seq_len, block ids are
    inside the cache. ``seq_len == 0`` marks a graph-padding request (any qlen, no keys)."""
    qlens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    lens = seq_lens_cpu.to(torch.int64)
    if lens.numel() != qlens.numel():
        raise InvalidInputError(
            "seq_lens", f"has {lens.numel()} entries but query_start_loc describes {qlens.numel()} requests"
        )
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
    if max_model_len is not None and lens.numel() and int(lens.max()) > max_model_len:
        raise InvalidInputError(
            "seq_lens", f"max seq_len {int(lens.max())} exceeds the engine's max_model_len {max_model_len}"
        )
    if block_table_cpu.shape[0] < lens.numel():
        raise InvalidInputError(
            "block_table", f"has {block_table_cpu.shape[0]} rows for {lens.numel()} requests"
        )
    needed = (lens + block_size - 1) // block_size
    width = block_table_cpu.shape[1]
    if needed.numel() and int(needed.max()) > width:
        b = int(torch.argmax(needed))
        raise InvalidInputError(
            "block_table",
            f"request {b} needs {int(needed[b])} blocks of {block_size} for seq_len {int(lens[b])} "
            f"but block_table has {width} columns",
        )
    if needed.numel() == 0 or width == 0:
        return
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
