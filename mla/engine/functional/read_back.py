"""The read back of ``validate="checked"``: counts made on the device by a call's own work, read
on the host after the launch.

A decode's page-index fill walks every request's length and block ids anyway; in checked mode it
also counts what it had to clamp or mask (``FillPagesCall.invalid_count`` and ``length_count``)
into two int32 words of the plan's backend (``decode_counts``). Per call the door zeroes them
before the build (:meth:`StepCounts.reset`), starts their copy right after the build
(:meth:`StepCounts.start`), launches the decode kernels and only then waits for the copy
(:meth:`StepCounts.read`). On a CUDA device the copy goes into pinned host memory owned by the
plan, followed by an event (``torch.cuda.Event(external=True)``): inside a captured graph the
copy is a memcpy node and the event an event-record node, so a replay's read waits for the fill
and the copy of this call (which follow the previous call's kernels in stream order), never for
this call's decode kernels: the host keeps one call of lookahead. Elsewhere (CPU, the Triton
interpreter) the counts are read directly after the call.
"""

from __future__ import annotations

import torch


class StepCounts:
    """Int32 device counts of one cached plan, zeroed per call and read after its launch (see
    the module docstring). One call at a time per plan (the plan's lock): the host buffer and the
    event are reused by every call and every graph of the plan."""

    def __init__(self, counts: torch.Tensor) -> None:
        assert counts.dtype == torch.int32, "two int32 words"
        assert counts.shape == (2,), "two int32 words"
        self.counts = counts
        """The device words the call's work adds to."""
        cuda = counts.device.type == "cuda"
        self.host = torch.zeros(counts.shape, dtype=counts.dtype, pin_memory=cuda)
        """Pinned on a CUDA device: what :meth:`start` copies the counts into."""
        self.copied: torch.cuda.Event | None = None
        """Recorded after the copy (an event-record node inside a captured graph); ``None`` off
        CUDA, where the counts are read directly."""
        self.replayable = True
        """A captured graph can hold the read back: ``False`` on a torch without external events
        and on ROCm, whose torch records an event inside a capture as a plain dependency (no
        event-record node the host could wait on): the plan's checked calls then run eagerly."""
        words = self.host if cuda else counts
        self._word = words.numpy().data.cast("B").cast("q")
        """The two int32 words read as one int64 (0 when both are): :meth:`clean`'s read."""
        if cuda:
            try:
                self.copied = torch.cuda.Event(external=True)  # type: ignore[no-untyped-call]
            except TypeError:  # (``external`` came with torch's pull request 155372, mid-2025)
                self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self.replayable = False
            if torch.version.hip:
                self.replayable = False

    def reset(self) -> None:
        """Zero the device words (before the work that counts)."""
        self.counts.zero_()

    def start(self) -> None:
        """After the work that counts, before the launch the host should not wait for: on a CUDA
        device, the asynchronous copy of the counts into pinned memory and the event after it."""
        if self.copied is not None:
            self.host.copy_(self.counts, non_blocking=True)
            self.copied.record()

    def clean(self) -> bool:
        """Whether the last call counted nothing (waits for its copy alone on a CUDA device):
        the common case, read as one machine word (:meth:`read` gives the counts)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self._word[0] == 0

    def read(self) -> list[int]:
        """The counts of the last call (waits for its copy alone on a CUDA device)."""
        if self.copied is None:
            return self.counts.tolist()
        self.copied.synchronize()
        return self.host.tolist()


def active(counts: StepCounts | None, device: torch.device) -> StepCounts | None:
    """``counts``, or ``None`` while the current CUDA stream is capturing: a call recorded into
    the caller's own graph runs later, so nothing can be read back for it (it runs as
    ``validate="fast"`` does)."""
    if counts is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return counts
