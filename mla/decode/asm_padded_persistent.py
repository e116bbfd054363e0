"""PaddedAsmPersistent: paged decode with head/qlen padding on the persistent split-KV schedule."""

from __future__ import annotations

from typing import ClassVar

from mla.core.capabilities import Contract
from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode._paged import PagedDecode


class PaddedAsmPersistent(PagedDecode):
    """Persistent paged decode (aiter ``mla_decode_fwd`` with ``get_mla_metadata_v1`` buffers;
    the Triton/torch split-KV schedule elsewhere).

    Heads pad to the provider's granularity (repeat-interleave for divisors, tile-and-slice
    otherwise); uniform batches whose qlen the kernel lacks pad to the kernel qlen by prepended
    zero rows. The work schedule is planned on the device in ``build_metadata`` into buffers
    sized at init for (padded heads, largest kernel qlen, q/kv dtypes). Graph contract: uniform
    batch.
    """

    NAME: ClassVar[str] = "asm-padded-persistent"
    PERSISTENT: ClassVar[bool] = True
    REQUIRES: ClassVar[frozenset[Contract]] = PagedDecode.REQUIRES | {Contract.DECODE_SCHEDULE}

    @classmethod
    def check(cls, ctx: DecodeContext, reasons: ReasonCollector) -> None:
        super().check(ctx, reasons)
        reasons.require(
            ctx.max_qlen <= ctx.max_decode_qlen,
            "qlen-over-engine-max",
            f"max qlen {ctx.max_qlen} exceeds the engine's max decode qlen "
            f"{ctx.max_decode_qlen} that the persistent buffers are sized for",
        )
