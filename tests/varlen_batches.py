"""Varlen prefill batches shared by the GPU tests of the Gluon prefill kernels (bf16 and fp8).

Request lengths ``(q, k)``: more keys than queries (chunked prefill), fewer (rows that see no
key), empty q or k, one-token requests, tile multiples and not.
"""

from __future__ import annotations

VARLEN_BATCHES: dict[str, tuple[list[int], list[int]]] = {
    "mixed": ([100, 1, 257, 0, 64, 5, 1], [300, 50, 257, 10, 64, 0, 1]),
    "sk-lt-sq": ([130, 70, 300], [40, 70, 129]),
    "long": ([1030], [2051]),
    "tiles": ([256, 384], [256, 512]),
}
