"""racecheck probe: one worker partition writes a shared-memory vector, waits for its own warps
(``thread_barrier``) and arrives on an mbarrier; a second worker waits on that mbarrier, reads the
vector and hands the buffer back on a second mbarrier. ``ROUNDS`` hand-offs reuse the barriers'
phases (parity waits), as the ping-pong decode kernel (``mla/providers/gluon/pingpong.py``) does
for ``P``, the rescale, the row max and the row sum of every tile. Every access is ordered
(bar.sync, then an arrive with release semantics, then a wait with acquire semantics).

    compute-sanitizer --tool racecheck python3 benchmarks/ws_mbarrier_probe.py [ROUNDS]
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _idle(out_ptr):
    pass


@gluon.jit
def _writer(buf, full, empty, x_ptr, rounds):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=lay)
    for k in range(rounds):
        mbarrier.wait(empty, (k & 1) ^ 1)
        buf.store(gl.load(x_ptr + offs) * (k + 1))
        gl.thread_barrier()
        mbarrier.arrive(full)


@gluon.jit
def _reader(buf, full, empty, out_ptr, rounds):
    # The reader partition's warps are not the writer's: every value crosses warps.
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    acc = gl.zeros([128], gl.float32, layout=lay)
    for k in range(rounds):
        mbarrier.wait(full, k & 1)
        acc += buf.load(lay)
        gl.thread_barrier()
        mbarrier.arrive(empty)
    gl.store(out_ptr + gl.arange(0, 128, layout=lay), acc)


@gluon.jit
def probe_kernel(x_ptr, out_ptr, rounds, num_warps: gl.constexpr):
    vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [128], vec)
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(empty, count=1)
    gl.warp_specialize(
        [
            (_idle, (out_ptr,)),
            (_writer, (buf, full, empty, x_ptr, rounds)),
            (_reader, (buf, full, empty, out_ptr, rounds)),
        ],
        [4, 4],
        [96, 96],
    )


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
x = torch.randn(128, device="cuda")
out = torch.zeros(128, device="cuda")
probe_kernel[(4,)](x, out, rounds, num_warps=4)
torch.cuda.synchronize()
print("probe ok", rounds, torch.allclose(out, x * rounds * (rounds + 1) / 2))
