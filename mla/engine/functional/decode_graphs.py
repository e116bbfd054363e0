"""CUDA-graph replay of repeated :func:`mla.mla_decode` calls (the functional API's fast path).

A functional call runs a whole engine step: ``builder.build`` (checks, the page-index fill,
the strategy's planning) and the decode kernels. On a GPU the build's launches alone cost more
host time than a small decode's kernels. So on a CUDA device a call that repeats an earlier one
(the same plan and the same tensors: data pointers, strides, dtypes, the host
``query_start_loc`` values and the ``kv_scale`` tensor) is captured once, build and run
together, into a :class:`torch.cuda.CUDAGraph` owned by the plan entry, and later calls replay
it after the Python validation: one graph launch per call.

The captured step reads everything from the caller's tensors on the device (``seq_lens``,
``block_table``, ``q``, ``kv_cache``, a device ``query_start_loc`` or ``kv_scale``) and is sized
by static bounds (the block table's capacity, never the data), so a replay computes the same
result as an eager call on the tensors' current values. A float ``kv_scale`` lives in the
backend's scale buffer, which the graph reads: a new value is one copy before the replay, not a
new capture.

A call without ``out=`` (or wanting the LSE without ``lse=``) replays too: the graph writes
buffers of its own and the call returns fresh copies of them (one device copy each), so results
kept from earlier calls stay theirs.

With ``validate="checked"`` (the default) the captured step also holds the read back of the
fill's counts (:mod:`mla.engine.functional.read_back`): a memset zeroing them before the
fill, their copy into the plan's pinned host buffer right after it and an event-record node
(``torch.cuda.Event(external=True)``), so a replay's call waits for its fill and that copy, not
for its decode kernels, before it reads them.

Calls run eagerly (and capture nothing) when: replay is off (``graph="off"`` or
:data:`GRAPH_REPLAY` ``= False``), the device is not CUDA, ``validate="full"``, the current
stream is capturing (the caller's own graph then records the eager launches),
``torch.compile`` is tracing, q is not on the current CUDA device, or the
strategy's build for this step needs host data (:meth:`DecodeStrategy.capturable_build`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Literal

import attrs
import torch

from mla.core.validate import require_choice

GraphReplay = Literal["auto", "off"]
"""``mla_decode(graph=...)``: ``"auto"`` replays repeated calls from a CUDA graph where it can;
``"off"`` always runs eagerly."""

GRAPH_REPLAY = True
"""Process-wide switch: ``mla.engine.functional.decode_graphs.GRAPH_REPLAY = False`` turns replay off for
every call (as ``graph="off"`` does for one)."""

GRAPHS_PER_PLAN = 4
"""Captured graphs (and once-seen calls) kept per cached plan, least recently used evicted."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


SEEN = _Marker("SEEN")
"""A call seen once: the next identical call captures."""
EAGER = _Marker("EAGER")
"""A call that cannot be captured (its build needs host data): always eager."""


@attrs.define(eq=False)
class CapturedCall:
    """One captured build + run, with the tensors it reads that the caller does not own and
    the outputs it writes where the caller passed none."""

    graph: torch.cuda.CUDAGraph
    keep: tuple[torch.Tensor, ...] = ()
    own_out: torch.Tensor | None = None
    """The graph's ``out`` when the call has no ``out=`` (each replay's call returns a copy)."""
    own_lse: torch.Tensor | None = None
    """The graph's ``lse`` when the call wants the LSE without ``lse=``."""

    def results(
        self, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """What the replayed call returns, given the caller's ``out``/``lse`` (``None`` where
        it passed none): the caller's outputs, or fresh copies of the graph's own (a later
        replay overwrites those)."""
        result_out = out if self.own_out is None else self.own_out.clone()
        result_lse = lse if self.own_lse is None else self.own_lse.clone()
        assert result_out is not None
        if not return_lse:
            return result_out
        assert result_lse is not None  # the caller passed lse= or the graph writes its own
        return result_out, result_lse


GraphState = CapturedCall | _Marker
"""What a plan entry records per call key (:attr:`~mla.engine.functional.plan_cache.DecodeEntry.graphs`)."""


def require_graph_replay(value: object) -> GraphReplay:
    return "off" if require_choice("graph", value, ("auto", "off")) == "off" else "auto"


def replay_allowed(q: torch.Tensor) -> bool:
    """The per-call conditions (see the module docstring): replay on, and
    :func:`device_allows_replay`."""
    return GRAPH_REPLAY and device_allows_replay(q)


def device_allows_replay(q: torch.Tensor) -> bool:
    """q is on the current CUDA device, whose current stream is not capturing, outside
    ``torch.compile`` tracing."""
    device = q.device
    return (
        device.type == "cuda"
        and device.index == torch.cuda.current_device()
        and not torch.cuda.is_current_stream_capturing()
        and not torch.compiler.is_compiling()
    )


def tensor_key(tensor: torch.Tensor | None) -> tuple[int, tuple[int, ...]] | None:
    """What a captured kernel reads of ``tensor``: its data pointer and strides."""
    return None if tensor is None else (tensor.data_ptr(), tensor.stride())


def capture(step: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """Capture ``step`` (already run once eagerly with the same arguments, so every kernel is
    compiled) on a side stream; the current stream is restored even when capture fails."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(current)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            step()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the error above invalidated the capture
                graph.capture_end()
            raise
        graph.capture_end()
    current.wait_stream(side)
    return graph


def capture_or_mark(step: Callable[[], None], device: torch.device) -> GraphState:
    """A :class:`CapturedCall` for ``step``, or :data:`EAGER` (with a warning) when the capture
    fails: a build or provider doing host work that the strategy did not declare."""
    try:
        return CapturedCall(capture(step, device))
    except Exception as exc:  # any failure: the call stays correct, eagerly
        warnings.warn(
            f"mla_decode: capturing this call in a CUDA graph failed ({exc}); it runs eagerly "
            "from now on (pass graph='off' to skip the attempt)",
            RuntimeWarning,
            stacklevel=3,
        )
        return EAGER
