"""The Gluon prefill kernel under Triton's concurrency sanitizer, one launch layout at a time.

compute-sanitizer's racecheck reports hazards on the split layout's per-key flags hand-off
(``mla/providers/gluon/prefill_parts.py`` ``_clean_v`` → ``prefill.py`` ``_attend_tile``) in
causal runs, and racecheck is known to misread some mbarrier hand-offs
(``probes/ws_mbarrier_probe.py``). Triton 3.6 has its own sanitizer for Gluon kernels,
``TRITON_INSTRUMENTATION_MODE=consan``: it instruments shared-memory accesses, mbarriers, TMA and
wgmma in the compiled kernel and stops the program at an unordered access. This probe launches
small varlen batches (empty, one-token and multi-tile requests) on one layout with it::

    TRITON_INSTRUMENTATION_MODE=consan python -m probes.prefill_consan SPLIT 1    # causal
    TRITON_INSTRUMENTATION_MODE=consan python -m probes.prefill_consan PRODUCER 1
    TRITON_INSTRUMENTATION_MODE=consan python -m probes.prefill_consan SPLIT 0    # non-causal

Arguments: a ``PrefillKernel`` name and ``1``/``0`` for causal. The instrumented kernel needs a
global scratch buffer (about 11 KB for the split layout at 192/128), which this probe hands
Triton through ``triton.set_allocator``. Without the environment variable it runs the same
launches uninstrumented and checks them against the Triton kernel. Prints ``consan probe
<layout> causal=<c>: ok`` or the mismatch; a sanitizer finding aborts the launch with its report.
Needs an sm_90 GPU; the instrumented build compiles for sm_90 on a CPU as well (PTX about 20x
the plain kernel's; on the H200 its compile takes one to two minutes a layout).

On the H200 (2026-12-04) the sanitizer's deadlock check stops the split and persistent layouts
alike, causal, at the producer's wait for a masked tile's V to land (``v_landed``: it waits on
its own TMA before cleaning the tile) while both consumer warpgroups wait for that tile: a wait
that only the TMA unit can end (the check seems to count it as blocked). Neither layout has hung
on the GPU.
"""

from __future__ import annotations

import os
import sys

import attrs
import torch
import triton

from mla.providers.calls import VarlenPrefillCall
from mla.providers.gluon.prefill_launch import PrefillKernel, PrefillLaunchConfig, launch_gluon_prefill
from mla.providers.triton.provider import TritonProvider

BATCHES = ([300, 3, 0, 129], [256, 1])
"""Request lengths (queries = keys): partial, one-token, empty and multi-tile requests."""


def _call(lengths: list[int], dqk: int, causal: bool, gen: torch.Generator) -> VarlenPrefillCall:
    tokens, heads = sum(lengths), 2
    bf16 = torch.bfloat16
    q, k = (torch.randn(tokens, heads, dqk, device="cuda", generator=gen, dtype=bf16) for _ in range(2))
    v = torch.randn(tokens, heads, 128, device="cuda", generator=gen, dtype=bf16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu,
        out=torch.full((tokens, heads, 128), float("nan"), device="cuda", dtype=torch.bfloat16),
        lse=torch.full((tokens, heads), float("nan"), device="cuda"),
        max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), softmax_scale=dqk**-0.5, causal=causal,
    )  # fmt: skip


def main() -> None:
    layout = PrefillKernel[sys.argv[1] if len(sys.argv) > 1 else "SPLIT"]
    causal = (sys.argv[2] if len(sys.argv) > 2 else "1") == "1"
    triton.set_allocator(lambda size, _align, _stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for dqk, stages in ((192, 2), (128, 3)):
        config = PrefillLaunchConfig(kernel=layout, num_stages=stages)
        for lengths in BATCHES:
            call = _call(lengths, dqk, causal, gen)
            launch_gluon_prefill(call, config)
            ref = torch.empty_like(call.out)
            TritonProvider().varlen_attention(attrs.evolve(call, out=ref, lse=torch.empty_like(call.lse)))
            torch.cuda.synchronize()
            worst = max(worst, float((call.out.float() - ref.float()).abs().max()))
    mode = os.environ.get("TRITON_INSTRUMENTATION_MODE", "") or "plain"
    verdict = "ok" if worst < 2e-2 else f"MISMATCH (max abs diff {worst:.3g})"
    print(f"consan probe {layout.name} causal={int(causal)} ({mode}): {verdict}", flush=True)


if __name__ == "__main__":
    main()
