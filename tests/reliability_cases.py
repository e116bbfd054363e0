"""Cases of the reliability tests that also run in a child process (``python -m``-free: the
child imports this module with ``tests/`` and the repository root on ``sys.path``).

``outside_block_case(provider, num_blocks)``: a decode step whose last request's last block id
is far past the cache. The run must read nothing there: its output equals the same step with
that request cut to the keys inside the cache (masked positions contribute nothing).
"""

from __future__ import annotations

import sys

import torch

import mla

RANK, ROPE, HEADS, BLOCK = 64, 16, 4, 16
SCALE = 0.125
FAR_BLOCK = 1 << 20
"""A block id far past the 8-block cache: reading it would leave the allocation."""


def backend(provider: str, num_blocks: int | None, **options: object) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, 32, 24, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=num_blocks),
        mla.EngineLimits(4, 64, 64, max_decode_qlen=2),
        model_dtype=torch.float32,
        provider=provider,
        platform="cpu",
        **options,  # type: ignore[arg-type]
    )


def step(seq_lens: tuple[int, int], last_block: int, *, decodes: int = 2) -> mla.StepInputs:
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl,
        seq_lens=lens,
        seq_lens_cpu=lens,
        block_table=torch.tensor([[3, 1, 0], [5, 2, last_block]], dtype=torch.int32),
        num_decodes=decodes,
        num_decode_tokens=3 if decodes else 0,
    )


def outside_block_case(provider: str, num_blocks: int | None) -> float:
    """Max difference between the decode with a block past the cache and the one cut short."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, BLOCK, RANK + ROPE, generator=gen)
    q = torch.randn(3, HEADS, RANK + ROPE, generator=gen)
    results = []
    # Request 1 (one query row) reads blocks 5, 2 and a block past the cache for keys 32..36:
    # masked, they count as no key, which is the step with seq_len 32.
    for lens, last in (((20, 37), FAR_BLOCK), ((20, 32), 0)):
        be = backend(provider, num_blocks)
        metadata = be.builder.build(step(lens, last))
        out = torch.full((3, HEADS, RANK), float("nan"))
        lse = torch.full((3, HEADS), float("nan"))
        be.impl.forward_decode(metadata, q, cache, out=out, lse=lse)
        results.append((out, lse))
    (out, lse), (ref, ref_lse) = results
    return max(float((out - ref).abs().max()), float((lse - ref_lse).abs().max()))


if __name__ == "__main__":
    name, blocks = sys.argv[1], sys.argv[2]
    diff = outside_block_case(name, None if blocks == "none" else int(blocks))
    print(f"diff={diff}")
    sys.exit(0 if diff < 1e-4 else 1)
