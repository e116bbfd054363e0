"""Whether Triton kernels run in its CPU interpreter, where some paths need exact dtypes."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
