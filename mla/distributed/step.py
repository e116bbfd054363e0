"""The records of one decode-context-parallel step: its metadata (:class:`DCPMetadata`), the
prefill context gather (:class:`ContextGather`) and the step fingerprint the ranks compare
(:func:`step_fingerprint`, :class:`StepMismatchError`)."""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import torch

from mla.core.errors import PlanMismatchError
from mla.distributed.combine import all_gather_into
from mla.distributed.layout import DCPLayout
from mla.engine.backend import MLAMetadata


@attrs.frozen(eq=False)
class ContextGather:
    """How one step's prefill context is gathered from every rank (planned at build time)."""

    send_slots: torch.Tensor
    """int64 ``[M]``: this rank's cache slots of the context rows it sends (padded with a valid
    slot), ``M`` the largest share of any rank."""
    source_rows: torch.Tensor
    """int64 ``[C]``: row of the all-gathered ``[W * M]`` buffer holding each context token."""
    target_slots: torch.Tensor
    """int64 ``[C]``: slot of each context token in :attr:`workspace`."""
    workspace: torch.Tensor
    """``[blocks, block_size, L+R]`` in the cache dtype: the prefill requests' gathered context,
    each request on its own contiguous blocks (the prefill plan's block table points here)."""


@attrs.frozen(eq=False)
class DCPMetadata:
    """One step under decode context parallelism, on one rank (from :meth:`DecodeContextParallel.build`).

    The counts are the global step's, as in :class:`~mla.engine.backend.MLAMetadata`.
    """

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    """int64 ``[num_decode_tokens + num_prefill_tokens]`` view of a persistent buffer: this
    rank's cache slot of each new token it owns, ``-1`` for tokens other ranks own and padding."""
    local_seq_lens_cpu: torch.Tensor
    """int64 ``[owned decode rows]``: keys each decode row sees on this rank."""
    decode: MLAMetadata | None
    """The local decode step: one qlen-1 request per decode row, over this rank's shard."""
    prefill: MLAMetadata | None
    """The prefill step over :attr:`ContextGather.workspace`."""
    context: ContextGather | None
    fingerprint: tuple[int, ...] = ()
    """A cheap digest of the global step this rank built (its counts and CRC-32s of the host
    ``query_start_loc`` and ``seq_lens``): the ranks compare it at the start of
    :meth:`DecodeContextParallel.build`, before any collective of the step
    (:class:`StepMismatchError`)."""


class StepMismatchError(PlanMismatchError):
    """The ranks of a decode-context-parallel group are building different steps. Raised by
    :meth:`DecodeContextParallel.build` on every rank (each compares every rank's step
    fingerprint), before any collective whose size depends on the step, so no rank is left
    waiting in one; combining such partial states would be silently wrong."""


FINGERPRINT_LENGTH = 6
"""int64 entries of :attr:`DCPMetadata.fingerprint`."""


def fingerprint_of(step: object) -> tuple[int, ...]:
    """:func:`step_fingerprint` of a step as given (before its checks: the ranks compare it
    first); a step it cannot read gives ``-1``s (its checks then fail alike on every rank)."""
    try:
        qsl = step.query_start_loc_cpu.cpu().to(torch.int64).reshape(-1)  # type: ignore[attr-defined]
        lens = step.seq_lens_cpu if step.seq_lens_cpu is not None else step.seq_lens  # type: ignore[attr-defined]
        seq = lens.cpu().to(torch.int64).reshape(-1)
        return step_fingerprint(qsl, seq, int(step.num_decodes), int(step.num_decode_tokens))  # type: ignore[attr-defined]
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return (-1,) * FINGERPRINT_LENGTH


def step_fingerprint(
    qsl: torch.Tensor, seq: torch.Tensor, num_decodes: int, num_decode_tokens: int
) -> tuple[int, ...]:
    """The digest of a global step: request and token counts, and CRC-32s of the host
    ``query_start_loc`` and ``seq_lens`` values (int64). Block ids (device data) are not in it."""
    qsl_bytes = qsl.to(torch.int64).contiguous().numpy().tobytes()
    seq_bytes = seq.to(torch.int64).contiguous().numpy().tobytes()
    return (
        num_decodes,
        num_decode_tokens,
        seq.numel(),
        int(qsl[-1]) if qsl.numel() else 0,
        zlib.crc32(qsl_bytes),
        zlib.crc32(seq_bytes),
    )


def compare_fingerprints(
    fingerprint: tuple[int, ...], layout: DCPLayout, group: Any, device: torch.device
) -> None:
    """Every rank of ``group`` is building the step of ``fingerprint``: one all-gather of
    :data:`FINGERPRINT_LENGTH` ints (the same size whatever the step) and a comparison on the
    host; :class:`StepMismatchError` on every rank otherwise. Collective over the group. On GPUs
    it reads the gathered digests on the host (a few dozen bytes, in the build, never in the run
    path)."""
    world = layout.world_size
    mine = torch.tensor(fingerprint, dtype=torch.int64)
    gathered = torch.empty(world * FINGERPRINT_LENGTH, dtype=torch.int64, device=device)
    all_gather_into(gathered, mine.to(device), group)
    prints = gathered.view(world, FINGERPRINT_LENGTH).cpu()
    differ = [r for r in range(world) if not torch.equal(prints[r], mine)]
    if differ:
        raise StepMismatchError(
            f"rank {layout.rank} built a different step than rank(s) {differ} of its "
            f"decode-context-parallel group (step fingerprints {mine.tolist()} here, "
            f"{prints[differ[0]].tolist()} on rank {differ[0]}: decodes, decode rows, requests, "
            "tokens, CRC-32 of query_start_loc, CRC-32 of seq_lens); every rank must build the "
            "same global step (same StepInputs) before running it"
        )
