"""GluonDecode: single-token small-head decode (aiter's Gluon kernel on ROCm; Gluon/Triton/torch
elsewhere)."""

from __future__ import annotations

from typing import ClassVar

from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode._small_head import SmallHeadDecode
from mla.strategy import StrategySetup


class GluonDecode(SmallHeadDecode):
    """Single-token decode (qlen 1) on the small-head kernel: one row per request, heads as they
    are (no padding).

    Where it runs: aiter's Gluon kernel (``mla_gluon``) on ROCm gfx950 (gfx942 ships none);
    elsewhere the provider's small-head kernel: the Gluon kernels on Hopper (``gluon``
    provider), Triton's on other GPUs, the torch reference on the CPU.

    Applies when the batch's max qlen is 1 and the head count, query and KV dtypes fit the
    kernel. Rows are requests; their keys are their block-table rows (providers whose kernels
    read the block table) or the flat ``kv_indices`` itself. Graph contract: uniform batch
    (rebuild in place, replay).
    """

    NAME: ClassVar[str] = "gluon-decode"

    @classmethod
    def max_rows(cls, setup: StrategySetup) -> int:
        return setup.limits.max_num_seqs

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        super().check(ctx, reasons)
        reasons.require(
            ctx.max_qlen == 1,
            "qlen",
            f"max qlen {ctx.max_qlen}: GluonDecode runs single-token decode; multi-token "
            "verify is GluonVerifyFlatten's case",
        )
