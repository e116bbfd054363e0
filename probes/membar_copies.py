"""Where Triton's barrier analysis puts a warp barrier between two shared-memory operations.

    python -m probes.membar_copies

Compiles a small Gluon kernel for sm_90 (no GPU) that issues two operations of one kind, into
two subviews of one allocation or into two allocations, with the ring slot a runtime value, and
prints the ``bar.sync`` count between them in the PTX. With Triton 3.6:

* two ``cp.async`` copies into one allocation meet at a barrier, even into disjoint subviews;
  into two allocations they do not;
* two mbarrier waits on one allocation meet at a barrier; on two allocations they do not;
* two mbarrier arrivals (one elected thread each) always meet at a barrier.

The 64-row ``fp8_ds_mla`` kernel keeps its warpgroups' ``empty`` barriers in two allocations for
the second rule, and its candidate pair copies (``probes/candidates/``) rest on the first.
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from benchmarks._common import print_table

KINDS = {"copy": "cp.async", "wait": "mbarrier.try_wait", "arrive": "mbarrier.arrive"}
"""The operations compared, by the PTX instruction each lowers to."""


@gluon.jit
def _two_ops(src, out, s, KIND: gl.constexpr, TWO_ALLOCATIONS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    if KIND == "copy":
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
        ptr = src + rows[:, None] * 16 + cols[None, :]
        if TWO_ALLOCATIONS:
            a = gl.allocate_shared_memory(gl.int32, [2, 64, 16], shared)
            b = gl.allocate_shared_memory(gl.int32, [2, 64, 16], shared)
            async_copy.async_copy_global_to_shared(a.index(s), ptr)
            async_copy.async_copy_global_to_shared(b.index(s), ptr + 1024)
        else:
            buf = gl.allocate_shared_memory(gl.int32, [4, 64, 16], shared)
            async_copy.async_copy_global_to_shared(buf.index(2 * s), ptr)
            async_copy.async_copy_global_to_shared(buf.index(2 * s + 1), ptr + 1024)
        async_copy.commit_group()
        async_copy.wait_group(0)
    else:
        if TWO_ALLOCATIONS:
            first = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()).index(s)
            second = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()).index(s)
        else:
            bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
            first = bars.index(2 * s)
            second = bars.index(2 * s + 1)
        if KIND == "wait":
            mbarrier.wait(first, 0)
            mbarrier.wait(second, 0)
        else:
            mbarrier.arrive(first)
            mbarrier.arrive(second)
    gl.store(out, s)


def barriers_between(kind: str, *, two_allocations: bool) -> int:
    """``bar.sync`` instructions between the kernel's two operations of ``kind`` (a key of
    :data:`KINDS`) in its sm_90 PTX."""
    signature = {
        "src": "*i32", "out": "*i32", "s": "i32", "KIND": "constexpr", "TWO_ALLOCATIONS": "constexpr",
    }  # fmt: skip
    constexprs = {(3,): kind, (4,): two_allocations}
    source = GluonASTSource(_two_ops, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    at = [m.start() for m in re.finditer(re.escape(KINDS[kind]), ptx)]
    return len(re.findall(r"\bbar(?:rier)?\.sync", ptx[at[0] : at[-1]]))


def main() -> None:
    rows = [
        {
            "operations": f"two {kind} operations",
            "into": "two allocations" if two else "two subviews of one allocation",
            "bar.sync between them": barriers_between(kind, two_allocations=two),
        }
        for kind in KINDS
        for two in (False, True)
    ]
    print_table(rows)


if __name__ == "__main__":
    main()
