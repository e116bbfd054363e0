"""The host rules of a paged step: an indptr's values, each request's query length and
seq_len against the block table and the engine limits, the block ids it reads. They run on
Python ints read once per step (:class:`HostLengths`), by the engine's step checker
(:mod:`mla.engine.backend.step_check`) and the functional API's doors; each raises
:class:`InvalidInputError` naming the argument and what was expected.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import torch

from mla.core.errors import InvalidInputError


def check_indptr_values(name: str, values: Sequence[int], *, total: int | None = None) -> list[int]:
    """``values`` (an indptr's host values, one ``.tolist()`` of the tensor) start at 0, never
    decrease and (if given) end at most at ``total``; returns the steps ``values[i+1] -
    values[i]`` (the per-request counts)."""
    if not values:
        raise InvalidInputError(name, "expected at least one entry ([B+1] with B >= 0)")
    if values[0] != 0:
        raise InvalidInputError(name, f"must start at 0, got {values[0]}")
    steps = list(map(operator.sub, values[1:], values[:-1]))
    if steps and min(steps) < 0:
        bad = next(i for i, step in enumerate(steps) if step < 0)
        raise InvalidInputError(
            name,
            f"must be non-decreasing (monotonic); entry {bad + 1} ({values[bad + 1]}) "
            f"< entry {bad} ({values[bad]})",
        )
    if total is not None and values[-1] > total:
        raise InvalidInputError(name, f"ends at {values[-1]} but there are only {total} rows")
    return steps


def require_indptr_of_rows(name: str, values: Sequence[int], rows: int, rows_of: str) -> list[int]:
    """:func:`check_indptr_values` ending exactly at ``rows``: every row of ``rows_of`` belongs
    to a request. Returns the per-request counts."""
    steps = check_indptr_values(name, values, total=rows)
    if values[-1] != rows:
        raise InvalidInputError(
            name,
            f"ends at {values[-1]} but {rows_of} has {rows} rows; every row of {rows_of} must "
            f"belong to a request (add the missing requests to {name}, or slice {rows_of})",
        )
    return steps


@attrs.frozen(eq=False)
class HostLengths:
    """A step's per-request query lengths and seq_lens as Python ints, with the ranges the
    host rules need: each list is reduced once per step, not once per rule (a reduction over
    a list costs about as much as one Python line per ten entries; a torch op on a small host
    tensor costs more than the whole list). The sum of ``seq_lens``, which no host rule needs,
    is computed when read (:attr:`total_seq`)."""

    query_lens: list[int]
    seq_lens: list[int] | None
    """``None`` when the host does not know the lengths."""
    min_query: int
    max_query: int
    min_seq: int
    """0 without host ``seq_lens`` (as are ``max_seq`` and ``total_seq``)."""
    max_seq: int

    @property
    def total_seq(self) -> int:
        """The sum of ``seq_lens`` (0 without host ``seq_lens``), summed on each read."""
        return sum(self.seq_lens) if self.seq_lens else 0

    @classmethod
    def of(
        cls,
        query_lens: list[int],
        seq_lens: list[int] | None,
        *,
        query_range: tuple[int, int] | None = None,
    ) -> HostLengths:
        """The ranges of ``query_lens`` and ``seq_lens``; ``query_range`` (min, max) when the
        caller knows it already (a uniform step)."""
        if query_range is not None:
            lo_q, hi_q = query_range
        else:
            lo_q, hi_q = (min(query_lens), max(query_lens)) if query_lens else (0, 0)
        if seq_lens:
            return cls(query_lens, seq_lens, lo_q, hi_q, min(seq_lens), max(seq_lens))
        return cls(query_lens, seq_lens, lo_q, hi_q, 0, 0)

    @classmethod
    def from_indptr(cls, query_start_loc: list[int], seq_lens: list[int] | None) -> HostLengths:
        return cls.of(list(map(operator.sub, query_start_loc[1:], query_start_loc[:-1])), seq_lens)

    def first(self, count: int) -> HostLengths:
        """The lengths of the first ``count`` requests."""
        if count == len(self.query_lens):
            return self
        lens = None if self.seq_lens is None else self.seq_lens[:count]
        return HostLengths.of(self.query_lens[:count], lens)


def check_paged_request_values(
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table_shape: tuple[int, ...],
    block_size: int,
    max_model_len: int | None = None,
    lengths: HostLengths | None = None,
    table_lens: Sequence[int] | None = None,
) -> None:
    """The paged-KV rules the host can check, on host values (each request's query length and
    seq_len): seq_len covers the query (``seq_len == 0`` marks a graph-padding request: any
    qlen, no keys), none exceeds ``max_model_len``, the block table has a row per request and
    enough columns for every seq_len. A few comparisons of their ranges (``lengths``, computed
    when not given) on the fast path, a per-request scan only to name a failure.
    ``table_lens``: the keys each request's block-table row holds when that is not its seq_len
    (a rank's share of a sharded cache)."""
    if len(seq_lens) != len(query_lens):
        raise InvalidInputError(
            "seq_lens",
            f"has {len(seq_lens)} entries but query_start_loc describes {len(query_lens)} requests",
        )
    if not seq_lens:
        return
    if lengths is None:
        lengths = HostLengths.of(list(query_lens), list(seq_lens))
    shortest, longest = lengths.min_seq, lengths.max_seq
    widest = longest if table_lens is None else max(table_lens)
    width = block_table_shape[1]
    # A request needs ceil(len / bs) <= width blocks, i.e. len <= width * bs.
    if (
        shortest < 0
        or widest > width * block_size
        or block_table_shape[0] < len(seq_lens)
        or (max_model_len is not None and longest > max_model_len)
        or (
            shortest < lengths.max_query and any(0 < s < q for s, q in zip(seq_lens, query_lens, strict=True))
        )
    ):
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        held = lens if table_lens is None else torch.tensor(table_lens, dtype=torch.int64)
        _explain_paged_requests(
            torch.tensor(query_lens, dtype=torch.int64),
            lens,
            (held + block_size - 1) // block_size,
            block_table_shape,
            block_size,
            max_model_len,
        )


def _explain_paged_requests(
    qlens: torch.Tensor,
    lens: torch.Tensor,
    needed: torch.Tensor,
    block_table_shape: tuple[int, ...],
    block_size: int,
    max_model_len: int | None,
) -> None:
    if bool((lens < 0).any()):
        b = int(torch.nonzero(lens < 0)[0, 0])
        raise InvalidInputError(
            "seq_lens",
            f"request {b} has seq_len {int(lens[b])}; each must be >= 0 (0 marks a graph-padding request)",
        )
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
            f"{num_blocks} blocks; every block a request reads (its first ceil(seq_len / "
            f"{block_size}) columns) must be in [0, {num_blocks})",
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
