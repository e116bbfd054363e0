"""How fast the H200's tensor cores run the dual-chain kernel's MMA shape: ``wgmma`` with N = 16.

The dual-chain fp8 kernel (``mla/providers/gluon/dual.py``) multiplies 64-token tiles by the 16
query rows: per tile 17 fp16 ``wgmma`` of ``M = 64, N = 16, K = 64`` (68 steps of ``k = 16``),
the K or Vᵀ operand from registers. This probe times long runs of that instruction on every SM,
two warpgroups a CTA (as in the kernel), for N = 16, 64 and 256, with the A operand in registers
(as in the kernel) or in shared memory, and prints the cycles one SM takes per ``m64nNk16`` step
against the dense fp16 peak (2048 multiply-adds a cycle and SM: 8 cycles at N = 16).

    python benchmarks/wgmma_rate_probe.py                 # needs an sm_90 GPU
    python benchmarks/wgmma_rate_probe.py --compile-only  # the SASS wgmma of each case, no GPU

Each warpgroup issues ``iters`` asynchronous ``wgmma`` into one accumulator (a chain the tensor
cores pipeline), waiting with one group outstanding; the operands are loaded from memory so
nothing is folded away. Results: ``docs/performance.md``, "The dual-chain fp8 kernel".
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table
from gluon_compile import sass_of

K_STEP = gl.constexpr(64)
"""K of one ``wgmma`` instruction (four ``k = 16`` steps), as in the kernel."""
PEAK_FMA_PER_CYCLE = 2048
"""Dense fp16 multiply-adds per cycle and SM of the H100/H200 tensor cores."""


@gluon.jit
def _rate_kernel(a_ptr, b_ptr, out_ptr, iters, N: gl.constexpr, A_REGS: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, N, 16]
    )
    M: gl.constexpr = 128  # two warpgroups, 64 rows each
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, K_STEP, layout=gl.SliceLayout(0, ld))
    a = gl.load(a_ptr + rows[:, None] * K_STEP + cols[None, :])
    kb = gl.arange(0, K_STEP, layout=gl.SliceLayout(1, ld))
    nb = gl.arange(0, N, layout=gl.SliceLayout(0, ld))
    b = gl.load(b_ptr + kb[:, None] * N + nb[None, :])
    b_smem = gl.allocate_shared_memory(
        gl.float16,
        [K_STEP, N],
        gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * N), element_bitwidth=16, rank=2),
    )
    b_smem.store(b)
    a_smem = gl.allocate_shared_memory(
        gl.float16, [M, K_STEP], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    )
    a_smem.store(a)
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([M, N], gl.float32, layout=acc_layout)
    if A_REGS:
        a_op = a_smem.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
        for _ in range(iters):
            acc = warpgroup_mma(a_op, b_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    else:
        for _ in range(iters):
            acc = warpgroup_mma(a_smem, b_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out_rows = gl.arange(0, M, layout=gl.SliceLayout(1, acc_layout))
    out_cols = gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout))
    base = out_ptr + gl.program_id(0) * M * N
    gl.store(base + out_rows[:, None] * N + out_cols[None, :], acc)


def cycles_per_step(n: int, *, a_regs: bool, iters: int, sm_clock_hz: float) -> float:
    """Cycles one SM takes per ``m64nNk16`` step (both warpgroups' steps counted), timed over
    one CTA per SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(128, K_STEP.value, device="cuda").half() / 8
    b = torch.randn(K_STEP.value, n, device="cuda").half() / 8
    out = torch.empty(sms, 128, n, device="cuda")
    launch = _rate_kernel[(sms,)]
    launch(a, b, out, iters, n, a_regs, num_warps=8)  # compile and warm up
    expected = (a.float() @ b.float()) * iters
    torch.testing.assert_close(out[0], expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch(a, b, out, iters, n, a_regs, num_warps=8)
    stop.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(stop) / 1e3
    steps = 2 * iters * (K_STEP.value // 16)  # two warpgroups, four k16 steps an instruction
    return seconds * sm_clock_hz / steps


CASES = [(n, a_regs) for n in (16, 64, 256) for a_regs in (True, False)]
"""``(N, A operand in registers)`` of each timed case."""


def compiled_wgmma(n: int, *, a_regs: bool) -> list[str]:
    """The distinct ``HGMMA`` instructions of the case compiled for sm_90 (no GPU needed)."""
    signature = {"a_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": "*fp32", "iters": "i32"}
    signature.update({"N": "constexpr", "A_REGS": "constexpr"})
    source = GluonASTSource(_rate_kernel, signature=signature, constexprs={(4,): n, (5,): a_regs}, attrs={})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    found = re.findall(r"HGMMA\.(\w+)\.F32 R\d+, (R\d+|gdesc)", sass_of(compiled))
    return sorted({f"{shape} A={'shared' if a == 'gdesc' else 'registers'}" for shape, a in found})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--sm-clock-mhz", type=float, default=1980.0, help="the SM clock the GPU runs at")
    parser.add_argument("--compile-only", action="store_true", help="print each case's SASS wgmma, no GPU")
    args = parser.parse_args()
    if args.compile_only:
        for n, a_regs in CASES:
            operand = "registers" if a_regs else "shared"
            print(f"N={n} A={operand}: {', '.join(compiled_wgmma(n, a_regs=a_regs))}")
        return
    rows = []
    for n, a_regs in CASES:
        cycles = cycles_per_step(n, a_regs=a_regs, iters=args.iters, sm_clock_hz=args.sm_clock_mhz * 1e6)
        peak = 64 * n * 16 / PEAK_FMA_PER_CYCLE
        rows.append(
            {
                "wgmma": f"m64n{n}k16",
                "A operand": "registers" if a_regs else "shared",
                "cycles a step (SM)": round(cycles, 1),
                "at peak": peak,
                "of peak": f"{peak / cycles:.0%}",
            }
        )
    print_table(rows, title=f"wgmma rate, one CTA of two warpgroups per SM, {args.sm_clock_mhz:.0f} MHz")


if __name__ == "__main__":
    main()
