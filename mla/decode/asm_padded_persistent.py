"""PaddedAsmPersistent: paged decode/verify on a persistent split-KV schedule (aiter asm on ROCm)."""

from __future__ import annotations

from typing import ClassVar

from mla.core.capabilities import Contract
from mla.core.context import DecodeContext
from mla.core.support import ReasonCollector
from mla.decode._paged import PagedDecode


class PaddedAsmPersistent(PagedDecode):
    """Paged decode and verify (any qlen) on a persistent split-KV schedule planned on the
    device, heads and qlen padded to what the kernel takes.

    Where it runs: aiter's asm kernel (``mla_decode_fwd`` with ``get_mla_metadata_v1`` buffers)
    on ROCm gfx942/gfx950; elsewhere the provider's paged kernel on its split-KV schedule: the
    Gluon kernels on Hopper (``gluon`` provider), Triton's on other GPUs, the torch reference on
    the CPU.

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
