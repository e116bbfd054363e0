"""GluonDecode: single-token decode on the small-head (Gluon-style) kernel, no head padding."""

from __future__ import annotations

from typing import ClassVar

from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode._small_head import SmallHeadDecode
from mla.strategy import StrategySetup


class GluonDecode(SmallHeadDecode):
    """qlen-1 decode with the small-head kernel (aiter ``mla_gluon`` on gfx950; the Triton and
    torch providers ship one on every arch).

    Applies when the batch's max qlen is 1 and the head count, query and KV dtypes fit the
    kernel. Rows are requests; their page table is the flat ``kv_indices`` itself. Graph
    contract: uniform batch (rebuild in place, replay).
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
