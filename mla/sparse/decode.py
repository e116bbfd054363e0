"""``SparseDecode``: DeepSeek Sparse Attention for decode and speculative-verify rows."""

from __future__ import annotations

from typing import ClassVar

from mla.core.context import DecodeContext
from mla.sparse.base import SparseStrategy
from mla.strategy import GraphSupport, Phase


class SparseDecode(SparseStrategy[DecodeContext]):
    """Sparse decode: every decode and verify row (qlen 1 and up, mixed in one batch) attends
    the cache rows of its own top-k positions, in the absorbed MQA form, with any head count
    (no padding). Runs on every provider that ships the ``sparse-attention`` kernel (torch,
    Triton, and Gluon: each query row a qlen-1 decode over its slots on the Gluon decode
    kernels for 512+64 dims, the Triton kernel otherwise). Capturable in a CUDA graph
    for a fixed (batch, qlen) shape: the plan is views of persistent buffers rewritten in place.
    """

    NAME: ClassVar[str] = "sparse-decode"
    PHASE: ClassVar[Phase] = Phase.DECODE
    GRAPH_SUPPORT: ClassVar[GraphSupport] = GraphSupport.UNIFORM_BATCH
