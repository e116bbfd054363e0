"""DeepSeek Sparse Attention: sparse MLA strategies and the lightning indexer."""

from mla.sparse.base import SparseBuffers, SparseGeometry, SparsePlan, SparseRows, SparseStrategy
from mla.sparse.decode import SparseDecode
from mla.sparse.indexer import INDEXER_STRATEGIES, IndexerContext, IndexerStrategy, LightningIndexer
from mla.sparse.prefill import SparsePrefill

__all__ = [
    "INDEXER_STRATEGIES",
    "IndexerContext",
    "IndexerStrategy",
    "LightningIndexer",
    "SparseBuffers",
    "SparseDecode",
    "SparseGeometry",
    "SparsePlan",
    "SparsePrefill",
    "SparseRows",
    "SparseStrategy",
]
