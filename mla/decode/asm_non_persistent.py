"""AsmNonPersistent: paged decode with head/qlen padding, no persistent schedule."""

from __future__ import annotations

from typing import ClassVar

from mla.decode._paged import PagedDecode


class AsmNonPersistent(PagedDecode):
    """Non-persistent paged decode: the asm path when the persistent gate is closed.

    Same padding as PaddedAsmPersistent; the kernel splits KV itself. Output rows are
    zero-filled before the kernel when the kernel qlen exceeds 1. Graph contract: uniform batch.
    """

    NAME: ClassVar[str] = "asm-non-persistent"
