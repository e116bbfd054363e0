"""Decode context parallelism (DCP): each request's latent KV cache sharded by token across ranks.

Layout (vLLM's, with its interleave size ``I``, 1 by default): token ``p`` of a request lives on
rank ``(p // I) % W`` of the ``W``-rank group, at local position ``(p // (I*W)) * I + p % I``.
Each rank's paged cache holds only its tokens, at their local positions, addressed through the
engine's one block table: the same block ids on every rank, each rank's block holding that rank's
share of the tokens. The block table therefore needs ``ceil(local_length / block_size)`` columns,
about ``1/W`` of the columns of an unsharded cache.

Per step, :meth:`DecodeContextParallel.build` derives from the engine's global step (global
``seq_lens``) this rank's local sequence lengths and block-table rows, the cache slot of every new
token it owns (``-1`` for the others: ``write_kv`` writes each token on its owning rank only),
and the plans. Decode splits every query row into a qlen-1 row whose local length counts the
tokens that row sees on this rank, so verify rows keep their causal mask under any interleave.
Each rank decodes its shard with the LSE; the partial states are combined as in vLLM's
``cp_lse_ag_out_rs``: all-gather the LSEs, scale each rank's output by
``exp(lse_rank - logsumexp(lses))``, then reduce-scatter over heads when the DCP ranks are
tensor-parallel ranks (``split_heads``: the query is all-gathered over heads first, so each rank
decodes every head of the group on its shard) or all-reduce when every rank holds the same heads.
A rank that owns no token of a request contributes ``o = 0``, ``lse = -inf``. Prefill gathers the
context rows of the step's prefill requests from every rank (as vLLM does under DCP) and runs the
ordinary prefill on them.

Sparse models (DeepSeek Sparse Attention, ``MLADims.index_topk``) run decode steps the same way:
each rank keeps its shard of the index-key cache too (:meth:`~DecodeContextParallel.write_index_keys`),
selects the top-k of each row's window over its own shard
(:meth:`~DecodeContextParallel.index_topk`, local positions) and attends that selection with the
LSE (:meth:`~DecodeContextParallel.forward_sparse_decode`); the combine below then gives
attention over the union of the ranks' selections. A sparse prefill step is refused by the build.

The partial outputs are combined in float32 (computed in float32 by the torch and Triton
providers, which write float32 partials) and rounded to the model dtype once, so the error does
not grow with the number of ranks.

Step consistency: every rank must build the same global step. At the start of
:meth:`~DecodeContextParallel.build` each rank all-gathers a fixed-size fingerprint of the step
it is building (:func:`~mla.distributed.step.step_fingerprint`: counts and CRC-32s
of the host ``query_start_loc`` and ``seq_lens``) and compares them on the host; a difference
raises :class:`StepMismatchError` on every rank, before any collective whose size depends on the
step (so no rank hangs in one). ``DecodeContextParallel(check_steps=False)`` skips it.

The run path (:meth:`~DecodeContextParallel.forward_decode`, ``write_kv``) performs no host
synchronisation and reads only buffers whose addresses persist across builds, so a decode step
can be captured in a CUDA graph and replayed after an in-place rebuild.
"""

from mla.distributed.combine import combine_decode_states, lse_weights
from mla.distributed.context_parallel import DecodeContextParallel
from mla.distributed.layout import DCPLayout
from mla.distributed.step import ContextGather, DCPMetadata, StepMismatchError, step_fingerprint

__all__ = [
    "ContextGather",
    "DCPLayout",
    "DCPMetadata",
    "DecodeContextParallel",
    "StepMismatchError",
    "combine_decode_states",
    "lse_weights",
    "step_fingerprint",
]
