"""Preference: which of several supported strategies runs first.

Pure functions of the context and the knobs. Correctness limits live in ``supports``; these
rules only order, so a wrong rule costs speed, never accuracy. Each rule says where it comes
from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mla.core.context import DecodeContext, PrefillContext
from mla.strategy import StrategyKind

Registration = tuple[str, int, StrategyKind, bool]
"""``(name, priority, kind, persistent)`` of one registered strategy."""


def small_head_preferred(ctx: DecodeContext) -> bool:
    """Whether small-head (Gluon-style) strategies go before paged ones in ``auto`` mode.

    vLLM's AiterMLAHelper (PR #50578): for single-token decode only head counts dividing the
    paged kernel's granularity (1, 2, 4, 8 of 16) beat the repeat-padded asm kernel; for verify
    every small head count does. With granularity 1 nothing is padded, so paged goes first.
    """
    granularity = ctx.capabilities.head_granularity
    heads = ctx.num_heads
    if heads >= granularity:
        return False
    if ctx.max_qlen == 1:
        return granularity % heads == 0
    return True


def decode_order(
    ctx: DecodeContext, registrations: Sequence[Registration], *, explicit_order: bool = False
) -> list[tuple[str, str | None]]:
    """Candidates in preference order, each with the rule that excludes it (or ``None``).

    Within the paged family, persistent goes first unless the provider's record says its
    non-persistent kernel is the faster one (``persistent_decode_preferred``); an
    ``explicit_order`` (a user's override) keeps its own order there.
    """
    mode = ctx.platform.knobs.small_head_mode
    if mode == "gluon":
        small_first = True
    elif mode == "asm":
        small_first = False
    else:
        small_first = small_head_preferred(ctx)

    def rank(kind: StrategyKind) -> int:
        if kind is StrategyKind.SMALL_HEAD:
            return 0 if small_first else 1
        if kind is StrategyKind.PAGED:
            return 1 if small_first else 0
        return 0

    persistent_first = ctx.capabilities.persistent_decode_preferred

    def persistence(kind: StrategyKind, persistent: bool) -> int:
        if explicit_order:
            return 0
        return int(kind is StrategyKind.PAGED and persistent != persistent_first)

    ordered = sorted(registrations, key=lambda r: (rank(r[2]), persistence(r[2], r[3]), r[1], r[0]))
    asm_only = mode == "asm"
    return _excluded_last(
        ordered,
        lambda kind: (
            "small-head mode 'asm' never selects small-head kernels automatically"
            if asm_only and kind is StrategyKind.SMALL_HEAD
            else None
        ),
    )


def prefill_order(ctx: PrefillContext, registrations: Sequence[Registration]) -> list[tuple[str, str | None]]:
    """fp8 prefill first when the knob is ``on``, or ``auto`` with an fp8 KV cache (vLLM PR
    #51040 gated it on fp8 KV); excluded when ``off``."""
    knob = ctx.platform.knobs.fp8_prefill
    fp8_first = knob == "on" or (knob == "auto" and ctx.kv_is_fp8)

    def rank(kind: StrategyKind) -> int:
        if kind is StrategyKind.FP8_PREFILL:
            return 0 if fp8_first else 1
        if kind is StrategyKind.FLASH:
            return 1 if fp8_first else 0
        return 0

    ordered = sorted(registrations, key=lambda r: (rank(r[2]), r[1], r[0]))
    fp8_off = knob == "off"
    return _excluded_last(
        ordered,
        lambda kind: "fp8-prefill knob is 'off'" if fp8_off and kind is StrategyKind.FP8_PREFILL else None,
    )


def _excluded_last(
    ordered: Sequence[Registration], excluded: Callable[[StrategyKind], str | None]
) -> list[tuple[str, str | None]]:
    """``(name, why excluded)`` of ``ordered``, the included ones first (in order), then the
    excluded ones with the knob's reason."""
    out = [(name, excluded(kind)) for name, _priority, kind, _persistent in ordered]
    return [item for item in out if item[1] is None] + [item for item in out if item[1]]
