"""One ``fp8_ds_mla`` sparse decode call of the sparse benchmark's kind, for the probes that time a
tree's kernels (:mod:`probes.tree_ab`, :mod:`probes.sparse_timeline`).

Imported inside the tree's own process, so ``mla`` is the tree's. GPU only.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple


class DsMlaCase(NamedTuple):
    """A checked-before-timing sparse decode call: ``call`` (its output NaN-filled), the torch
    provider's ``ref`` output, the launch ``config`` the planner picks and the call's ``flops``."""

    call: Any
    ref: Any
    config: Any
    flops: float


def ds_mla_case(heads: int, batch: int, qlen: int) -> DsMlaCase:
    """``batch × qlen`` query rows of ``heads`` heads, each attending its own top-k 2048 of a
    32768-token ``fp8_ds_mla`` context (:mod:`benchmarks.sparse`'s rows and slots, seed 0), with
    each row's length, as the strategies pass it."""
    import torch

    from benchmarks.sparse import AttentionCase, L, R, _cache, _slots
    from mla.providers import get_provider
    from mla.providers.calls import SparseAttentionCall
    from mla.providers.gluon.planner import launch_config
    from mla.providers.sparse_slots import slot_lengths
    from mla.providers.triton.decode import num_sms

    c = AttentionCase(f"H{heads} B{batch} q{qlen}", "fp8_ds_mla", heads, batch, qlen, 32768)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache, _ = _cache(c.kv, c.batch * c.context // 64, 64, gen)
    flat = cache.view(-1, cache.shape[-1])
    n = c.batch * c.qlen
    q = torch.randn(n, heads, L + R, generator=gen, device="cuda", dtype=torch.bfloat16)
    slots = _slots(c, gen)

    def call_for(out: torch.Tensor) -> SparseAttentionCall:
        return SparseAttentionCall(
            q=q, kv_cache=flat, slots=slots, out=out, lse=None, kv_lora_rank=L, rope_dim=R,
            softmax_scale=192**-0.5, kv_scale=None, lengths=slot_lengths(slots),
        )  # fmt: skip

    ref = torch.empty(n, heads, L, device="cuda", dtype=torch.bfloat16)
    get_provider("torch").sparse_attention(call_for(ref))
    config = launch_config(
        batch=n, rows=heads, max_seqlen_k=2048, num_sms=num_sms(q.device), persistent=False, kv_fp8=True,
        ds_mla=True,
    )  # fmt: skip
    flops = 2.0 * int((slots >= 0).sum()) * heads * (L + R + L)
    return DsMlaCase(call_for(torch.full_like(ref, math.nan)), ref, config, flops)
