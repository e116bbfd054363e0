"""The shortcut of a repeated :func:`mla.mla_decode` call that replays a captured CUDA graph.

Without it, such a call finds its graph through three caches, each keyed by a tuple made and
hashed per call: its signature's checks (:data:`~mla.engine.functional.decode_call.DECODE_CALLS`),
its plan (:data:`~mla.engine.functional.plan_cache.DECODE_PLANS`) and the plan's graph of its
tensors (``DecodeEntry.graphs``). A call that replayed once through them is recorded here under
one flat key (:func:`replay_key`: every tensor's data pointer, shape, strides, dtype and device,
the host ``query_start_loc`` values, the kind of ``kv_scale`` and the scalar options: everything
the three keys hold), so the next such call makes one key and one lookup.

A record holds its signature record, plan and graph weakly (an evicted plan frees its memory as
before) and the three keys it was found under. It is used only while each cache still maps its
key to the same object; it keeps each cache's least-recently-used order as a lookup would, but
touches a cache only when that cache changed since the record last looked
(:attr:`PlanCache.changes <mla.engine.functional.plan_cache.PlanCache.changes>`), so a loop
repeating one call touches none.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch

from mla.engine.functional.args import DecodeArgs
from mla.engine.functional.decode_call import DECODE_CALLS, DecodeCall
from mla.engine.functional.decode_graphs import GRAPHS_PER_PLAN, CapturedCall
from mla.engine.functional.plan_cache import DECODE_PLANS, PLAN_CACHE_SIZE, DecodeEntry

MAX_RECORDS = PLAN_CACHE_SIZE * GRAPHS_PER_PLAN
"""Records kept at most (as many as the plans can hold graphs); past it the dead ones go, then
all of them."""


def replay_key(args: DecodeArgs) -> tuple[object, ...] | None:
    """The call's flat key, or ``None``: a device ``query_start_loc`` (its values are on the
    device; such a call replays after its step check), or arguments that cannot make one (of
    another kind, a tensor without data: the door's route then handles them; an unhashable
    option makes a key that :func:`recall` and :func:`remember` pass over)."""
    try:
        (
            q, kv_cache, block_table, seq_lens, qsl, softmax_scale, kv_lora_rank, kv_scale, provider,
            strategy, platform, out, lse, return_lse, validate, graph,
        ) = args  # fmt: skip
        qsl_key: object = None
        if qsl is not None:
            if not qsl.is_cpu:
                return None
            qsl_key = (qsl.shape, qsl.dtype, tuple(qsl.tolist()))
        scale_key: object = None
        if isinstance(kv_scale, torch.Tensor):
            scale = kv_scale
            scale_key = (scale.data_ptr(), scale.shape, scale.stride(), scale.dtype, scale.device)
        elif kv_scale is not None:
            scale_key = type(kv_scale)  # a float's value is checked and written per call
        return (
            q.data_ptr(), q.shape, q.stride(), q.dtype, q.device,
            kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
            block_table.data_ptr(), block_table.shape, block_table.stride(), block_table.dtype,
            block_table.device,
            seq_lens.data_ptr(), seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.device,
            None if out is None else (out.data_ptr(), out.shape, out.stride(), out.dtype, out.device),
            None if lse is None else (lse.data_ptr(), lse.shape, lse.stride(), lse.dtype, lse.device),
            qsl_key, scale_key, type(softmax_scale), softmax_scale, type(kv_lora_rank), kv_lora_rank,
            provider, strategy, platform, type(return_lse), return_lse, validate, graph,
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):  # (RuntimeError: a tensor without data)
        return None


class ReplayRecord:
    """What one recorded call replays, and where it was found (see the module docstring)."""

    __slots__ = ("_call", "_entry", "_state", "graph_key", "plan_key", "seen", "signature")

    def __init__(
        self,
        call: DecodeCall,
        entry: DecodeEntry,
        state: CapturedCall,
        signature: tuple[object, ...],
        plan_key: tuple[object, ...],
        graph_key: Hashable,
    ) -> None:
        self._call = weakref.ref(call)
        self._entry = weakref.ref(entry)
        self._state = weakref.ref(state)
        self.signature, self.plan_key, self.graph_key = signature, plan_key, graph_key
        self.seen = (DECODE_CALLS.changes, DECODE_PLANS.changes, entry.graphs.changes)
        """Each cache's change count when the record last found its key there."""

    def target(self) -> tuple[DecodeCall, DecodeEntry, CapturedCall] | None:
        """The signature record, plan and graph, when the caches still map the record's keys to
        them (each made the most recently used where its cache changed since); else ``None``."""
        call, entry, state = self._call(), self._entry(), self._state()
        if call is None or entry is None or state is None:
            return None
        graphs = entry.graphs
        seen = self.seen
        if (DECODE_CALLS.changes, DECODE_PLANS.changes, graphs.changes) != seen:
            if DECODE_CALLS.changes != seen[0] and not DECODE_CALLS.touch(self.signature, call):
                return None
            if DECODE_PLANS.changes != seen[1] and not DECODE_PLANS.touch(self.plan_key, entry):
                return None
            if graphs.changes != seen[2] and not graphs.touch(self.graph_key, state):
                return None
            self.seen = (DECODE_CALLS.changes, DECODE_PLANS.changes, graphs.changes)
        return call, entry, state

    def alive(self) -> bool:
        """The caches still map the record's keys to its objects (nothing touched)."""
        call, entry, state = self._call(), self._entry(), self._state()
        return (
            call is not None
            and entry is not None
            and state is not None
            and DECODE_CALLS.holds(self.signature, call)
            and DECODE_PLANS.holds(self.plan_key, entry)
            and entry.graphs.holds(self.graph_key, state)
        )


RECORDS: dict[tuple[object, ...], ReplayRecord] = {}
"""Per flat key (:func:`replay_key`): the recorded call."""


def recall(key: tuple[object, ...]) -> tuple[DecodeCall, DecodeEntry, CapturedCall] | None:
    """The signature record, plan and graph recorded under ``key`` while they are current; a
    record that is not is dropped."""
    try:
        record = RECORDS.get(key)
    except TypeError:  # an unhashable option: the door's route names it
        return None
    if record is None:
        return None
    target = record.target()
    if target is None:
        RECORDS.pop(key, None)
    return target


def remember(key: tuple[object, ...], record: ReplayRecord) -> None:
    """Record a call that replayed through the caches (dead records go first when full); a key
    that cannot be hashed records nothing."""
    try:
        hash(key)
    except TypeError:
        return
    if len(RECORDS) >= MAX_RECORDS:
        for old, held in list(RECORDS.items()):
            if not held.alive():
                RECORDS.pop(old, None)
        if len(RECORDS) >= MAX_RECORDS:
            RECORDS.clear()
    RECORDS[key] = record
