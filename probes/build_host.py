"""Host time of ``backend.builder.build(step)`` alone, on any machine (no GPU needed).

    python -m probes.build_host                      # B 1/64/128 x block 1/64, H16, S4096
    python -m probes.build_host --launch triton      # with the Triton fill's host launch path
    python -m probes.build_host --profile            # plus a cProfile of 2000 builds per shape
    python -m probes.build_host --vary               # plus steps whose seq_lens change

The backend runs on the CPU with the torch provider, and the provider's device calls of a
decode build (``fill_page_indices``, ``plan_decode_schedule``) are replaced by no-ops, so what is
timed is the framework's own Python: the checks, the cached resolution, the strategy's planning
and the records. ``--launch triton`` makes them the Triton provider's instead, launched against
a stand-in driver (:mod:`mla.testing.triton_driver`: Triton's host code runs, compiling for
sm_90 on first use, and the launcher records instead of launching), which adds the host cost
of a Triton launch short of the driver call itself; ``MLA_TRITON_LAUNCH_CACHE=0`` times it
without :mod:`mla.providers.triton.launch_cache`. Decode-only steps of single-token requests
with the engine's host copies passed (``query_start_loc_cpu``, ``seq_lens_cpu``),
``validate="fast"``, as in ``benchmarks/overhead.py``.
Each number is the median over rounds of the per-build time of back-to-back builds of one step
(``build us``); ``--vary`` adds ``vary us``: builds alternating between two steps of the same
shape whose ``seq_lens`` differ (values and tensors), as an engine's consecutive decode steps
do, so nothing a build reuses from the previous one can depend on unchanged lengths.

On the H200 ``benchmarks/overhead.py`` times the same build with the real fill launch.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

import mla
from benchmarks._common import print_profile, print_table, wall_us

STUBBED = ("fill_page_indices", "plan_decode_schedule")
"""Provider methods a decode build calls: the device work, replaced by no-ops here."""


def make_build(
    *,
    batch: int,
    block: int,
    heads: int,
    seq_len: int,
    strategy: str | None,
    launch: str = "stub",
    vary: bool = False,
) -> Any:
    """A zero-argument callable running one build of a decode-only step, and its backend;
    ``vary``: each call builds the other of two steps whose ``seq_lens`` differ."""
    rank, rope = 512, 64
    blocks_per_seq = -(-seq_len // block)
    num_blocks = batch * blocks_per_seq
    backend = mla.MLABackend(
        mla.MLADims(heads, rank, rope, softmax_scale=(rank + rope) ** -0.5),
        mla.KVCacheSpec(block, torch.bfloat16, num_blocks=num_blocks),
        mla.EngineLimits(batch, blocks_per_seq * block, batch),
        model_dtype=torch.bfloat16,
        provider="torch",
        platform="cpu",
        decode_strategy=strategy,
    )
    if launch == "triton":
        from mla.providers.triton import TritonProvider

        triton_provider = TritonProvider()
        for name in STUBBED:
            setattr(backend.provider, name, getattr(triton_provider, name))
    else:
        for name in STUBBED:
            setattr(backend.provider, name, lambda call: None)
    gen = torch.Generator().manual_seed(batch * 100 + block)
    table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), seq_len, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    steps = [
        mla.StepInputs(
            query_start_loc_cpu=qsl.clone(),
            query_start_loc=qsl.clone(),
            seq_lens=lens.clone(),
            seq_lens_cpu=lens,
            block_table=table,
            num_decodes=batch,
            num_decode_tokens=batch,
        )
        for lens in (lens, torch.randint(seq_len // 2, seq_len, (batch,), generator=gen, dtype=torch.int32))
    ]
    if not vary:
        return lambda: backend.builder.build(steps[0]), backend
    turn = itertools.cycle(steps)
    return lambda: backend.builder.build(next(turn)), backend


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategy", default=None, help="decode strategy (default: the resolver's)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--launch",
        choices=("stub", "triton"),
        default="stub",
        help="stub: no-op device calls; triton: the Triton provider's, against a stand-in driver",
    )
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of 2000 builds per shape")
    parser.add_argument("--vary", action="store_true", help="also time steps whose seq_lens change")
    args = parser.parse_args()
    if args.launch == "triton":
        from mla.testing.triton_driver import stand_in_driver

        with stand_in_driver() as driver:
            run(args, driver)
    else:
        run(args, None)


def run(args: argparse.Namespace, driver: Any) -> None:
    rows = []
    for batch in (1, 64, 128):
        for block in (1, 64):
            shape = {
                "batch": batch,
                "block": block,
                "heads": 16,
                "seq_len": args.seq_len,
                "strategy": args.strategy,
                "launch": args.launch,
            }
            build, backend = make_build(**shape)
            if driver is not None:
                driver.record = False  # launch records would pile up
            metadata = build()
            row = {
                "B": batch,
                "block": block,
                "strategy": metadata.decode.strategy if metadata.decode is not None else "-",
                "build us": round(wall_us(build, calls=args.calls, rounds=args.rounds), 1),
            }
            if args.vary:
                varied, _ = make_build(**shape, vary=True)
                row["vary us"] = round(wall_us(varied, calls=args.calls, rounds=args.rounds), 1)
            rows.append(row)
            if args.profile:
                print_profile(build, f"builder.build, B{batch} block {block}", calls=2000, top=25)
            del backend
    what = "Triton launch path, stand-in driver" if args.launch == "triton" else "device calls stubbed out"
    print_table(rows, title=f"builder.build host time (CPU, {what})")


if __name__ == "__main__":
    main()
