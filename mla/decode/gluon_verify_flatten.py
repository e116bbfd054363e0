"""GluonVerifyFlatten: speculative verify (qlen > 1) as qlen-1 rows on the small-head kernel."""

from __future__ import annotations

from typing import ClassVar

from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode._small_head import SmallHeadDecode


class GluonVerifyFlatten(SmallHeadDecode):
    """Multi-token speculative verify (qlen > 1) as independent qlen-1 rows on the small-head
    kernel, each over its own causal window.

    Where it runs: as :class:`~mla.decode.gluon.GluonDecode`, aiter's Gluon kernel on ROCm
    gfx950; the Gluon kernels on Hopper (``gluon`` provider), Triton's on other GPUs, the torch
    reference on the CPU.

    Row ``t`` of a request with ``q`` tokens and ``s`` keys attends the first
    ``clamp(s - (q - 1) + t, 0)`` keys: the right-aligned causal window (vLLM #50476 gave every
    row the whole range and let drafts see later drafts). ``build_metadata`` gives each row its
    request and key count (a row map the kernel reads the request's block-table row with, on
    providers whose kernels read the block table), or gathers a per-row page table on the device
    (providers whose kernels take flat ids). Graph contract: uniform batch.
    """

    NAME: ClassVar[str] = "gluon-verify-flatten"

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        super().check(ctx, reasons)
        reasons.require(
            ctx.max_qlen > 1,
            "qlen",
            f"max qlen {ctx.max_qlen}: verify flattening is for multi-token verify (qlen > 1); "
            "single-token decode is GluonDecode's case",
        )
