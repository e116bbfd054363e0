"""The ``triton`` kernel provider (portable Triton kernels for NVIDIA and AMD GPUs).

Importing this package imports triton; ``mla.providers.get_provider("triton")`` does so lazily.
"""

from mla.providers.triton.provider import TritonProvider

__all__ = ["TritonProvider"]
