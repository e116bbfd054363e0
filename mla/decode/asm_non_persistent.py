"""AsmNonPersistent: paged decode with head/qlen padding, no persistent schedule."""

from __future__ import annotations

from typing import ClassVar

from mla.context import DecodeContext
from mla.decode._paged import PagedDecode
from mla.support import ReasonCollector


class AsmNonPersistent(PagedDecode):
    """Non-persistent paged decode: the asm path when the persistent gate is closed.

    Same padding as PaddedAsmPersistent; the kernel splits KV itself. Output rows are
    zero-filled before the kernel when the kernel qlen exceeds 1. Graph contract: uniform batch.
    """

    NAME: ClassVar[str] = "asm-non-persistent"

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        super().check(ctx, reasons)
        if not ctx.kv_is_fp8:
            return
        caps = ctx.capabilities
        kernel_qlen = ctx.kernel_qlen
        limit = caps.nonpersistent_fp8_max_qlen
        reasons.require(
            limit is None or kernel_qlen <= limit,
            "nonpersistent-fp8-qlen",
            f"fp8 KV at kernel qlen {kernel_qlen}: {caps.provider} has no non-persistent fp8 "
            f"kernel past qlen {limit}",
        )
        products = caps.nonpersistent_fp8_head_qlen_products
        product = caps.padded_heads(ctx.num_heads) * kernel_qlen
        reasons.require(
            products is None or product in products,
            "nonpersistent-fp8-heads-qlen",
            f"fp8 KV: {caps.padded_heads(ctx.num_heads)} kernel heads x qlen {kernel_qlen} = "
            f"{product} has no non-persistent fp8 kernel block (have {sorted(products or ())})",
        )
