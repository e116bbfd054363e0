"""The step checker: the one place a step's rules are checked.

Every door that takes a step checks it here, once: ``MetadataBuilder.build``,
``DecodeContextParallel.build`` (the global step, with its shard rule) and the functional
:func:`mla.mla_decode` (a step derived from its arguments). :meth:`StepChecker.check` returns a
:class:`CheckedStep`, the step with the host values the rules were checked on; the builder
plans a checked step (``MetadataBuilder.plan``) without checking anything again.

The rules, in the order they are checked (each raises :class:`InvalidInputError` naming the
argument and the fix):

1. tensors (:meth:`StepChecker.check_tensors`): index dtypes, ranks, the device tensors on the
   backend's device type; ``num_decodes`` and ``num_decode_tokens`` ints >= 0.
2. values (:meth:`StepChecker.check_values`) on the host copies: ``query_start_loc`` is an
   indptr (and, for a caller without graph-padding rows, ends at its row count); its device copy
   has as many entries; the request count fits ``max_num_seqs``, ``seq_lens`` has an entry and
   ``block_table`` a row per request; ``num_decodes`` counts at most the requests; with host
   ``seq_lens``: each covers its query (0 marks a graph-padding decode request; a prefill
   request's covers its query), none exceeds ``max_model_len``, the block table has the columns
   for it; decode qlens fit ``max_decode_qlen`` and the step's tokens ``max_num_batched_tokens``;
   ``num_decode_tokens`` counts the decode requests' tokens (extra graph-padding rows only in a
   decode-only step) and fits the decode buffers. ``validate="full"`` also compares the device
   copies with the host ones and checks every block id a request reads against the cache.

``validate="fast"`` reads nothing from the device: without a host ``seq_lens`` the length rules
wait for the run, whose kernels mask block ids outside the cache.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import Tensor

from mla.core.config import EngineLimits
from mla.core.errors import InvalidInputError
from mla.core.records import fast_constructor
from mla.core.step_rules import (
    HostLengths,
    check_block_ids,
    check_indptr_values,
    check_paged_request_values,
    require_indptr_of_rows,
)
from mla.core.validate import INDEX_DTYPES, ValidateMode, require_index, require_int
from mla.engine.backend.step import StepInputs

_INDEX = frozenset(INDEX_DTYPES)
_HOST_LENGTHS = fast_constructor(HostLengths)


@attrs.frozen(eq=False)
class StepRules:
    """What a step is checked against: the limits its buffers were sized for, the cache and the
    device it runs on, and how much to check (:data:`~mla.core.validate.ValidateMode`)."""

    limits: EngineLimits
    block_size: int
    num_blocks: int | None
    """Blocks in the cache when known (``validate="full"`` checks block ids against it)."""
    device: torch.device
    """The device tensors of a step must be on this device type."""
    validate: ValidateMode = "fast"
    table_lengths: Callable[[list[int]], list[int]] | None = None
    """The keys each request's block-table row holds, from the requests' ``seq_lens`` (default:
    the ``seq_lens`` themselves; decode context parallelism: the largest share of one rank)."""
    host_seq_lens: bool = False
    """Read ``seq_lens`` from the device when the step has no host copy (one device-to-host copy;
    decode context parallelism plans every step on host lengths)."""
    rows_of: str | None = None
    """The caller's name of the step's rows when every row must belong to a request (the
    functional ``mla_decode``'s ``q``: no graph-padding rows); ``None`` for an engine step."""
    model_len: bool = True
    """Check seq_lens against ``limits.max_model_len`` (a functional call has no model length:
    its block table alone bounds each request)."""


@attrs.frozen(eq=False)
class CheckedStep:
    """A step the checker accepted, with the host values its rules were checked on.

    Made by :meth:`StepChecker.check`, or by :func:`derived_step` for a step the engine derives
    from a checked one; the builder plans it as it is (``MetadataBuilder.plan``).
    """

    inputs: StepInputs
    query_start_loc: list[int]
    """``inputs.query_start_loc_cpu`` as Python ints: an indptr."""
    lengths: HostLengths
    """Query lengths and (when the host has them) ``seq_lens``, with their ranges."""
    num_decodes: int
    num_decode_tokens: int
    block_table_cpu: torch.Tensor | None
    """The block table read on the host (``validate="full"``), else ``None``."""

    @property
    def num_requests(self) -> int:
        return len(self.query_start_loc) - 1

    @property
    def num_prefills(self) -> int:
        return self.num_requests - self.num_decodes

    @property
    def owned_decode_tokens(self) -> int:
        """Tokens the decode requests own (``num_decode_tokens`` adds graph-padding rows)."""
        return self.query_start_loc[self.num_decodes]

    @property
    def num_prefill_tokens(self) -> int:
        return self.query_start_loc[-1] - self.owned_decode_tokens

    def with_inputs(self, inputs: StepInputs) -> CheckedStep:
        """This checked step over ``inputs``: the same values in other tensors (a caller that
        checked the step with host tensors and runs it with their device copies)."""
        return _CHECKED_STEP(
            inputs=inputs,
            query_start_loc=self.query_start_loc,
            lengths=self.lengths,
            num_decodes=self.num_decodes,
            num_decode_tokens=self.num_decode_tokens,
            block_table_cpu=self.block_table_cpu,
        )


_CHECKED_STEP = fast_constructor(CheckedStep)


def derived_step(inputs: StepInputs, query_start_loc: list[int], seq_lens: list[int] | None) -> CheckedStep:
    """The checked record of a step the engine derived from a checked one (decode context
    parallelism's local steps): its values follow from values the checker accepted, so no rule
    runs again. ``query_start_loc`` and ``seq_lens`` are its host values."""
    return _CHECKED_STEP(
        inputs=inputs,
        query_start_loc=query_start_loc,
        lengths=HostLengths.from_indptr(query_start_loc, seq_lens),
        num_decodes=inputs.num_decodes,
        num_decode_tokens=inputs.num_decode_tokens,
        block_table_cpu=None,
    )


class StepChecker:
    """Checks steps against one set of :class:`StepRules` (see the module docstring)."""

    def __init__(self, rules: StepRules) -> None:
        self.rules = rules
        self._devices: set[torch.device] = set()
        """Devices of the rules' type seen on a step's device tensors."""
        self._uniform_indptrs: dict[int, list[int]] = {}
        """Per qlen ``q``: ``[0, q, 2q, ..., q * max_num_seqs]`` (a uniform step's indptr)."""

    def check(self, step: StepInputs) -> CheckedStep:
        """Every rule of ``step``: its tensors, then its values."""
        self.check_tensors(step)
        return self.check_values(step)

    def check_tensors(self, step: StepInputs) -> None:
        """Rule 1: the step's tensors and counts are of the kinds the rules read (a caller that
        made the step from arguments it checked itself calls :meth:`check_values` alone)."""
        if type(step) is not StepInputs and not isinstance(step, StepInputs):
            raise InvalidInputError("step", f"expected an mla.StepInputs, got {type(step).__name__}")
        self._index("query_start_loc_cpu", step.query_start_loc_cpu, 1, on_device=False)
        self._index("query_start_loc", step.query_start_loc, 1, on_device=True)
        self._index("seq_lens", step.seq_lens, 1, on_device=True)
        self._index("block_table", step.block_table, 2, on_device=True)
        for name in ("num_decodes", "num_decode_tokens"):
            value = getattr(step, name)
            if type(value) is not int or value < 0:
                require_int(name, value, minimum=0)
        if step.seq_lens_cpu is not None:
            self._index("seq_lens_cpu", step.seq_lens_cpu, 1, on_device=False)

    def _index(self, name: str, tensor: object, ndim: int, *, on_device: bool) -> None:
        """``tensor`` is an int32/int64 tensor of ``ndim`` dims (on the rules' device type when
        ``on_device``); the usual case costs one expression."""
        if (
            type(tensor) is Tensor
            and tensor.dtype in _INDEX
            and tensor.dim() == ndim
            and (not on_device or tensor.device in self._devices)
        ):
            return
        value = require_index(name, tensor, ndim=ndim)
        if on_device:
            device = self.rules.device
            if value.device.type != device.type:
                raise InvalidInputError(
                    name, f"is on {value.device} but the backend runs on {device}; move it there"
                )
            self._devices.add(value.device)

    def check_values(self, step: StepInputs) -> CheckedStep:
        """Rule 2: the step's values, read once each on the host (``.tolist()``) and checked as
        Python ints; the step's tensors must be of the kinds :meth:`check_tensors` checks."""
        rules, limits = self.rules, self.rules.limits
        full = rules.validate == "full"
        nd, num_decode_tokens = operator.index(step.num_decodes), operator.index(step.num_decode_tokens)
        qsl: list[int] = step.query_start_loc_cpu.tolist()
        seq_host = step.seq_lens_cpu
        lens: list[int] | None = None if seq_host is None else seq_host.tolist()
        lengths = self.host_lengths(qsl, lens)
        if not qsl or qsl[0] != 0 or lengths.min_query < 0:
            check_indptr_values("query_start_loc", qsl)  # raises, naming the bad entry
        if rules.rows_of is not None:
            require_indptr_of_rows("query_start_loc", qsl, num_decode_tokens, rules.rows_of)
        num_requests = len(qsl) - 1
        if step.query_start_loc.numel() != num_requests + 1:
            raise InvalidInputError(
                "query_start_loc",
                f"has {step.query_start_loc.numel()} entries but query_start_loc_cpu has "
                f"{num_requests + 1}; pass the same indptr on the device and on the host",
            )
        if nd > num_requests:
            raise InvalidInputError("num_decodes", f"must be in [0, {num_requests}], got {nd}")
        if num_requests > limits.max_num_seqs:
            raise InvalidInputError(
                "query_start_loc",
                f"{num_requests} requests exceed max_num_seqs {limits.max_num_seqs}; split the "
                "step or build the backend with a larger EngineLimits.max_num_seqs",
            )
        if step.seq_lens.numel() != num_requests:
            raise InvalidInputError(
                "seq_lens",
                f"has {step.seq_lens.numel()} entries but query_start_loc describes {num_requests} requests",
            )
        table_shape = tuple(step.block_table.shape)
        if table_shape[0] < num_requests:
            raise InvalidInputError("block_table", f"has {table_shape[0]} rows for {num_requests} requests")
        if full:
            self._cross_check(step, qsl, lens)
        if lens is None and (full or rules.host_seq_lens or nd < num_requests):
            lens = step.seq_lens.tolist()
            lengths = HostLengths.of(lengths.query_lens, lens)
        table_cpu = None
        if lens is not None:
            table_lens = None if rules.table_lengths is None else rules.table_lengths(lens)
            check_paged_request_values(
                query_lens=lengths.query_lens,
                seq_lens=lens,
                block_table_shape=table_shape,
                block_size=rules.block_size,
                max_model_len=limits.max_model_len if rules.model_len else None,
                lengths=lengths,
                table_lens=table_lens,
            )
            if nd < num_requests:
                _check_prefill_lengths(lengths.query_lens, lens, nd)
            if full:
                table_cpu = step.block_table.cpu()
                check_block_ids(
                    seq_lens_cpu=torch.tensor(lens if table_lens is None else table_lens, dtype=torch.int64),
                    block_table_cpu=table_cpu,
                    block_size=rules.block_size,
                    num_blocks=rules.num_blocks or (1 << 62),
                )
        decode = lengths if nd == num_requests else lengths.first(nd)
        self._check_limits(decode, qsl[-1])
        owned = qsl[nd]
        if num_decode_tokens < owned or (nd < num_requests and num_decode_tokens != owned):
            raise InvalidInputError(
                "num_decode_tokens",
                f"got {num_decode_tokens}; the decode requests own {owned} tokens (extra "
                "graph-padding rows are allowed only in decode-only steps)",
            )
        if num_decode_tokens > limits.max_decode_tokens:
            raise InvalidInputError(
                "num_decode_tokens",
                f"{num_decode_tokens} exceeds max_num_seqs * max_decode_qlen = {limits.max_decode_tokens}",
            )
        return _CHECKED_STEP(
            inputs=step,
            query_start_loc=qsl,
            lengths=lengths,
            num_decodes=nd,
            num_decode_tokens=num_decode_tokens,
            block_table_cpu=table_cpu,
        )

    def host_lengths(self, qsl: list[int], lens: list[int] | None) -> HostLengths:
        """:meth:`HostLengths.from_indptr`, with the ranges of a uniform indptr (every request
        ``q <= max_decode_qlen`` tokens, the decode steps' usual shape) found by one list
        comparison with the uniform prefix of its qlen instead of a pass per reduction."""
        count = len(qsl) - 1
        limits = self.rules.limits
        if not (0 < count <= limits.max_num_seqs and qsl[0] == 0):
            return HostLengths.from_indptr(qsl, lens)
        qlen, rest = divmod(qsl[-1], count)
        if rest or not 0 < qlen <= limits.max_decode_qlen:
            return HostLengths.from_indptr(qsl, lens)
        uniform = self._uniform_indptrs.get(qlen)
        if uniform is None:
            uniform = list(range(0, qlen * limits.max_num_seqs + 1, qlen))
            self._uniform_indptrs[qlen] = uniform
        if qsl != uniform[: count + 1]:
            return HostLengths.from_indptr(qsl, lens)
        lo = hi = 0
        if lens:
            lo, hi = min(lens), max(lens)
        return _HOST_LENGTHS(
            query_lens=[qlen] * count, seq_lens=lens, min_query=qlen, max_query=qlen, min_seq=lo, max_seq=hi
        )

    def _check_limits(self, decode: HostLengths, total: int) -> None:
        """The step's decode qlens and token count are within the limits the buffers were sized
        (and the strategies allocated) for."""
        limits = self.rules.limits
        if decode.query_lens and decode.max_query > limits.max_decode_qlen:
            b = decode.query_lens.index(decode.max_query)
            raise InvalidInputError(
                "query_start_loc",
                f"decode request {b} has {decode.max_query} query tokens > max_decode_qlen "
                f"{limits.max_decode_qlen}. Decode requests (qlen <= max_decode_qlen: one token, or "
                "a speculative verify) come first in the batch and num_decodes counts them; a "
                "prefill placed before the decodes, a num_decodes that is too large, or more "
                "speculative tokens than EngineLimits.max_decode_qlen allows look like this",
            )
        if total > limits.max_num_batched_tokens:
            raise InvalidInputError(
                "query_start_loc",
                f"the step has {total} query tokens > max_num_batched_tokens "
                f"{limits.max_num_batched_tokens}; split the step or raise the limit",
            )

    @staticmethod
    def _cross_check(step: StepInputs, qsl: list[int], lens: list[int] | None) -> None:
        """``validate="full"``: the device tensors hold what their host copies say (one
        device-to-host copy each)."""
        device_qsl = step.query_start_loc.tolist()
        if device_qsl != qsl:
            raise InvalidInputError(
                "query_start_loc",
                f"the device copy {device_qsl} differs from query_start_loc_cpu "
                f"{qsl}; pass the same indptr on both sides",
            )
        if lens is not None:
            device_lens = step.seq_lens.tolist()
            if device_lens != lens:
                raise InvalidInputError(
                    "seq_lens",
                    f"the device copy {device_lens} differs from seq_lens_cpu "
                    f"{lens}; pass the same lengths on both sides",
                )


def _check_prefill_lengths(query_lens: Sequence[int], seq_lens: Sequence[int], num_decodes: int) -> None:
    """Each prefill request's seq_len covers its query (a seq_len of 0 marks only a decode
    graph-padding request)."""
    for b in range(num_decodes, len(seq_lens)):
        if seq_lens[b] < query_lens[b]:
            raise InvalidInputError(
                "seq_lens",
                f"prefill request {b} has seq_len {seq_lens[b]} < query length {query_lens[b]}",
            )
