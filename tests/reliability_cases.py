"""Cases of the reliability tests that also run in a child process (``python -m``-free: the
child imports this module with ``tests/`` and the repository root on ``sys.path``).

``outside_block_case(provider, num_blocks)``: a decode step whose last request's last block id
is far past the cache. The run must read nothing there: its output equals the same step with
that request cut to the keys inside the cache (masked positions contribute nothing).
"""

from __future__ import annotations

import os
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


def dcp_mismatch_worker(rank: int, world: int, result_dir: str, modes: list[str]) -> None:
    """One rank of a gloo group whose ranks build different steps, once per mode, each in a
    group of its own (``"lens"``: other seq_lens, same rows; ``"rows"``: another row count):
    every rank must raise :class:`~mla.distributed.StepMismatchError` from ``forward_decode``
    (none hangs). Writes each outcome to ``<mode>-rank<rank>`` in ``result_dir``."""
    for mode in modes:
        dcp_mismatch_case(rank, world, os.path.join(result_dir, f"init-{mode}"), result_dir, mode)


def dcp_mismatch_case(rank: int, world: int, init_file: str, result_dir: str, mode: str) -> None:
    import torch.distributed as dist

    from mla.distributed import DecodeContextParallel, StepMismatchError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    outcome = "no error"
    try:
        dcp = DecodeContextParallel(
            mla.MLADims(2, 32, 16, 16, 16, softmax_scale=SCALE),
            mla.KVCacheSpec(BLOCK, torch.float32),
            mla.EngineLimits(4, 128, 64),
            model_dtype=torch.float32,
            provider="torch",
            platform="cpu",
        )
        lens = [20, 37] if rank == 0 or mode != "lens" else [20, 36]
        requests = 3 if rank == 1 and mode == "rows" else 2
        lens = [*lens, 5][:requests]
        seq = torch.tensor(lens, dtype=torch.int32)
        qsl = torch.arange(requests + 1, dtype=torch.int32)
        step = mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl,
            seq_lens=seq,
            seq_lens_cpu=seq,
            block_table=torch.arange(requests * 2, dtype=torch.int32).view(requests, 2),
            num_decodes=requests,
            num_decode_tokens=requests,
        )
        metadata = dcp.build(step)
        cache = torch.randn(8, BLOCK, 48)
        out = torch.empty(requests, 2, 32)
        dcp.forward_decode(metadata, torch.randn(requests, 2, 48), cache, out=out)
    except StepMismatchError as error:
        outcome = f"StepMismatchError: {error}"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    with open(os.path.join(result_dir, f"{mode}-rank{rank}"), "w") as handle:
        handle.write(outcome)
    dist.destroy_process_group()


def dcp_mismatch(modes: list[str], result_dir: str) -> None:
    """Two ranks run every mode (one start of the processes for all of them)."""
    import torch.multiprocessing as mp

    mp.spawn(dcp_mismatch_worker, args=(2, result_dir, modes), nprocs=2, join=True)


if __name__ == "__main__" and sys.argv[1] == "dcp-mismatch":
    dcp_mismatch(sys.argv[2].split(","), sys.argv[3])
elif __name__ == "__main__":
    name, blocks = sys.argv[1], sys.argv[2]
    diff = outside_block_case(name, None if blocks == "none" else int(blocks))
    print(f"diff={diff}")
    sys.exit(0 if diff < 1e-4 else 1)
