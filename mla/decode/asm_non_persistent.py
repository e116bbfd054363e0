"""AsmNonPersistent: paged decode/verify, the kernel splitting KV itself (aiter asm on ROCm)."""

from __future__ import annotations

from typing import ClassVar

from mla.decode._paged import PagedDecode


class AsmNonPersistent(PagedDecode):
    """Paged decode and verify (any qlen) with no planned schedule: the kernel splits KV itself.

    Where it runs: aiter's asm kernel (``mla_decode_fwd`` without schedule buffers) on ROCm
    gfx942/gfx950, where the persistent gate is closed; elsewhere the provider's paged kernel in
    its non-persistent mode: the Gluon kernels on Hopper (``gluon`` provider), Triton's on other
    GPUs, the torch reference on the CPU.

    Same padding as PaddedAsmPersistent. Output rows are zero-filled before the kernel when the
    kernel qlen exceeds 1. Graph contract: uniform batch.
    """

    NAME: ClassVar[str] = "asm-non-persistent"
