"""``SparseAttentionCall.lengths`` on the GPU providers: each row attends only its first
``lengths[t]`` slots, exactly as if the columns past it were ``-1``, on every Gluon decode kernel
the sparse path picks (few rows and 64-row tiles; bf16, per-tensor fp8 and ``fp8_ds_mla`` rows;
split and unsplit launches) and on the Triton sparse kernel. The counts cover a cut inside a
tile, none, all ``K``, past ``K`` and negative; the slots past a row's count are valid rows, so
a kernel that read them would differ. Outputs are NaN before each call.

Run: ``pytest -m gpu tests/test_sparse_lengths_gpu.py`` (seconds on an H200).
"""

from __future__ import annotations

import math

import pytest
import torch

from mla.core.config import DS_MLA_DTYPE
from mla.providers import get_provider
from mla.providers.calls import SparseAttentionCall
from mla.testing import encode_latent_cache

pytestmark = pytest.mark.gpu

RANK, ROPE, TOPK = 512, 64, 2048
KV_FORMATS = {
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.float8_e4m3fn, 0.05),
    "fp8_ds_mla": (DS_MLA_DTYPE, None),
}
"""name -> (cache dtype, kv_scale)."""
TOL = 3e-2


def _counts(rows: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows]``: random counts, with the edge cases in the first five rows."""
    counts = torch.randint(0, TOPK + 1, (rows,), generator=gen, dtype=torch.int32)
    edges = torch.tensor([0, 1, 1000, TOPK, TOPK + 7, -3, 64, 65], dtype=torch.int32)
    counts[: min(rows, edges.numel())] = edges[:rows]
    return counts


def _call(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv_scale: float | None,
          lengths: torch.Tensor | None) -> SparseAttentionCall:  # fmt: skip
    out = torch.full((q.shape[0], q.shape[1], RANK), math.nan, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((q.shape[0], q.shape[1]), math.nan, device="cuda")
    scale = None if kv_scale is None else torch.tensor([kv_scale], device="cuda")
    return SparseAttentionCall(
        q=q, kv_cache=cache, slots=slots, out=out, lse=lse, kv_lora_rank=RANK, rope_dim=ROPE,
        softmax_scale=(RANK + ROPE) ** -0.5, kv_scale=scale, lengths=lengths,
    )  # fmt: skip


@pytest.mark.parametrize("rows", [3, 300], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("heads", [16, 128], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("kv", list(KV_FORMATS))
@pytest.mark.parametrize("provider", ["gluon", "triton"])
def test_gpu_lengths_equal_a_masked_tail(provider: str, kv: str, heads: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 131 + heads)
    kv_dtype, kv_scale = KV_FORMATS[kv]
    tokens = 8192
    latent = torch.randn(tokens, RANK + ROPE, generator=gen).cuda()
    cache = encode_latent_cache(latent, kv_dtype, kv_lora_rank=RANK, kv_scale=kv_scale)
    slots = torch.stack([torch.randperm(tokens, generator=gen)[:TOPK] for _ in range(rows)]).to(torch.int32)
    slots[1::4, 100:300] = -1  # -1 pads inside the kept part of some rows
    q = torch.randn(rows, heads, RANK + ROPE, generator=gen).to(torch.bfloat16).cuda()
    counts = _counts(rows, gen)
    masked = slots.clone()
    keep = counts.clamp(0, TOPK)
    masked[torch.arange(TOPK)[None, :] >= keep[:, None]] = -1
    slots, masked, counts, keep = slots.cuda(), masked.cuda(), counts.cuda(), keep.cuda()

    want = _call(q, cache, masked, kv_scale, None)
    get_provider("torch").sparse_attention(want)
    got = _call(q, cache, slots, kv_scale, counts)
    get_provider(provider).sparse_attention(got)
    every = _call(q, cache, slots, kv_scale, None)
    get_provider(provider).sparse_attention(every)

    assert not torch.isnan(got.out).any(), "unwritten output rows"
    assert not torch.isnan(got.lse).any(), "unwritten lse rows"
    empty = keep == 0
    assert torch.isneginf(got.lse[empty]).all()
    assert (got.out[empty] == 0).all()
    torch.testing.assert_close(got.out.float(), want.out.float(), atol=TOL, rtol=TOL)
    finite = torch.isfinite(want.lse)
    assert torch.equal(finite, torch.isfinite(got.lse))
    torch.testing.assert_close(got.lse[finite], want.lse[finite], atol=TOL, rtol=TOL)
    cut = (keep > 0) & (keep < TOPK)
    assert (got.out[cut].float() - every.out[cut].float()).abs().amax() > 0.05, "the lengths changed nothing"
