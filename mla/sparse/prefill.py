"""``SparsePrefill``: DeepSeek Sparse Attention for prefill rows over cached and new tokens."""

from __future__ import annotations

from typing import ClassVar

from mla.core.context import PrefillContext
from mla.sparse.base import SparseStrategy
from mla.strategy import GraphSupport, Phase


class SparsePrefill(SparseStrategy[PrefillContext]):
    """Sparse prefill in the absorbed MQA form (576/512), as FlashMLA's ``flash_mla_sparse_fwd``
    computes it: each prefill row attends the cache rows of its own top-k positions, cached
    context and new tokens alike (the new tokens' latent rows are written first), so there is no
    context chunking and no up-projection of cached rows. Any head count, no padding; torch,
    Triton and Gluon providers (Gluon: as :class:`~mla.sparse.decode.SparseDecode`, each row a
    qlen-1 decode over its slots on the Gluon decode kernels).
    """

    NAME: ClassVar[str] = "sparse-prefill"
    PHASE: ClassVar[Phase] = Phase.PREFILL
    GRAPH_SUPPORT: ClassVar[GraphSupport] = GraphSupport.NEVER
