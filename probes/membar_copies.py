"""Where Triton's barrier analysis puts a warp barrier between two ``cp.async`` copies.

    python -m probes.membar_copies

Compiles a small Gluon kernel for sm_90 (no GPU) that issues two copies into shared memory, in
four forms: into two subviews of one allocation or into two allocations, with the ring slot
a constant or a runtime value. Prints the ``bar.sync`` count between the copies in the PTX. With
Triton 3.6 two copies into one allocation get a barrier between them even when their subviews
cannot overlap; copies into two allocations get none. The same holds for two mbarrier operations
on one allocation, which is why the 64-row ``fp8_ds_mla`` kernel keeps its warpgroups'
``empty`` barriers in two allocations.
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from benchmarks._common import print_table


@gluon.jit
def _two_copies(src, out, s, DYNAMIC: gl.constexpr, TWO_ALLOCATIONS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    ptr = src + rows[:, None] * 16 + cols[None, :]
    slot = s if DYNAMIC else 0
    if TWO_ALLOCATIONS:
        a = gl.allocate_shared_memory(gl.int32, [2, 64, 16], shared)
        b = gl.allocate_shared_memory(gl.int32, [2, 64, 16], shared)
        async_copy.async_copy_global_to_shared(a.index(slot), ptr)
        async_copy.async_copy_global_to_shared(b.index(slot), ptr + 1024)
    else:
        buf = gl.allocate_shared_memory(gl.int32, [4, 64, 16], shared)
        async_copy.async_copy_global_to_shared(buf.index(2 * slot), ptr)
        async_copy.async_copy_global_to_shared(buf.index(2 * slot + 1), ptr + 1024)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.store(out, s)


def barriers_between_copies(*, dynamic: bool, two_allocations: bool) -> int:
    """``bar.sync`` instructions between the kernel's two copies in its sm_90 PTX."""
    signature = {
        "src": "*i32", "out": "*i32", "s": "i32", "DYNAMIC": "constexpr", "TWO_ALLOCATIONS": "constexpr",
    }  # fmt: skip
    constexprs = {(3,): dynamic, (4,): two_allocations}
    source = GluonASTSource(_two_copies, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    between = ptx[ptx.index("cp.async") : ptx.rindex("cp.async")]
    return len(re.findall(r"\bbar(?:rier)?\.sync", between))


def main() -> None:
    rows = [
        {
            "slot": "runtime" if dynamic else "constant",
            "destinations": "two allocations" if two else "two subviews of one allocation",
            "bar.sync between the copies": barriers_between_copies(dynamic=dynamic, two_allocations=two),
        }
        for dynamic in (False, True)
        for two in (False, True)
    ]
    print_table(rows)


if __name__ == "__main__":
    main()
