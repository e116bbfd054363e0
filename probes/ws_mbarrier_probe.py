"""racecheck probes for the mbarrier hand-offs between Gluon warp-specialised partitions.

``handoff``: one worker partition writes a shared-memory vector, waits for its own warps
(``thread_barrier``) and arrives on an mbarrier; a second worker waits on that mbarrier, reads the
vector and hands the buffer back on a second mbarrier, over ``ROUNDS`` rounds (phases reused,
parity waits). ``alternate``: two workers take alternate rounds, each waiting for the previous
round's publication on ``p_ready[(k - 1) % 2]``, reading the vector, writing its own and
arriving on ``p_ready[k % 2]``: the hand-off the ping-pong decode kernel
(``mla/providers/gluon/pingpong.py``) uses for ``P``, the rescale, the row max and the row sum.
Every access is ordered (bar.sync of the writer's warps, one arrive with release semantics, the
reader's wait with acquire semantics) and the values are checked.

    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe handoff 4
    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe alternate 6

``ring``: the default partition ``cp.async``-copies round ``k``'s row of a global matrix into a
shared-memory slot and announces it with ``cp.async.mbarrier.arrive.noinc`` on ``landed`` (one
arrival per thread); a worker waits, reads the slot with plain loads, waits for its own warps
and arrives on ``free``, which the default partition waits for before copying the next round
into the slot: the ring hand-off of the dual-chain kernel (``mla/providers/gluon/dual.py``).
``ring-wait`` announces each round instead after ``cp.async.wait_group 0``, a barrier of the
copier's warps and one arrive with release semantics.

    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe ring 6
    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe ring-wait 6

H200, Triton 3.6, 2026-12-01: ``handoff`` (1 and 4 rounds) 0 hazards; ``alternate`` (6 rounds)
1 hazard (5 to 16 instances between runs) between two accesses of compiler-generated code at
the kernel's own line (the buffer through which the partitions receive their arguments), none on
the vector, and the values are right. ``ring`` and ``ring-wait`` (6 rounds, 18:56 UTC): the
values are right and racecheck reports, besides that start-up hazard, one hazard between the
reader's loads of the slot and the copier's ``cp.async`` writes into it (16,000 to 20,000
instances), under either announcement. Each write is ordered after the loads of the round
before (the reader's barrier, its release arrive on ``free``, the copier's acquire wait) and
before the loads of its own round (the announcement and the reader's acquire wait): the orders
``handoff``, with plain stores where ``ring`` has ``cp.async``, is reported clean with.
racecheck does not apply them to ``cp.async`` writes. The same acquire-then-``cp.async``
producer is the paged-KV path of FlashAttention-3's Hopper mainloop (``producer_acquire``,
``cp.async``, ``cpasync_barrier_arrive``).
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
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
def _reader(buf, full, empty, out_ptr, rounds, N: gl.constexpr = 128):
    # The reader partition's warps are not the writer's: every value crosses warps.
    lay: gl.constexpr = gl.BlockedLayout([N // 128], [32], [4], [0])
    acc = gl.zeros([N], gl.float32, layout=lay)
    for k in range(rounds):
        mbarrier.wait(full, k & 1)
        acc += buf.load(lay)
        gl.thread_barrier()
        mbarrier.arrive(empty)
    gl.store(out_ptr + gl.arange(0, N, layout=lay), acc)


@gluon.jit
def _buffer_and_barriers(N: gl.constexpr, FULL_ARRIVALS: gl.constexpr):
    """A float32 vector of ``N`` in shared memory, its ``full`` mbarrier (``FULL_ARRIVALS``
    arrivals a phase) and its ``empty`` mbarrier (one)."""
    vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [N], vec)
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=FULL_ARRIVALS)
    mbarrier.init(empty, count=1)
    return buf, full, empty


@gluon.jit
def probe_kernel(x_ptr, out_ptr, rounds, num_warps: gl.constexpr):
    buf, full, empty = _buffer_and_barriers(128, 1)
    gl.warp_specialize(
        [
            (_idle, (out_ptr,)),
            (_writer, (buf, full, empty, x_ptr, rounds)),
            (_reader, (buf, full, empty, out_ptr, rounds)),
        ],
        [4, 4],
        [96, 96],
    )


@gluon.jit
def _player(buf, p_ready, out_ptr, rounds, W: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=lay)
    acc = gl.zeros([128], gl.float32, layout=lay)
    if W == 0:
        buf.store(gl.zeros([128], gl.float32, layout=lay) + 1.0)
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(0))
    for k in range(2 - W, rounds, 2):
        mbarrier.wait(p_ready.index((k - 1) % 2), ((k - 1) // 2) & 1)
        v = buf.load(lay)
        acc += v
        buf.store(v + 1.0)
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(k % 2))
    gl.store(out_ptr + W * 128 + offs, acc)


@gluon.jit
def alternate_kernel(out_ptr, rounds, num_warps: gl.constexpr):
    vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.float32, [128], vec)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
    gl.warp_specialize(
        [
            (_idle, (out_ptr,)),
            (_player, (buf, p_ready, out_ptr, rounds, 0)),
            (_player, (buf, p_ready, out_ptr, rounds, 1)),
        ],
        [4, 4],
        [96, 96],
    )


@gluon.jit
def _ring_copier(src_ptr, slot, landed, free, rounds, WAIT: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.arange(0, 512, layout=lay)
    for k in range(rounds):
        mbarrier.wait(free, k & 1)
        async_copy.async_copy_global_to_shared(slot, src_ptr + k * 512 + offs)
        if WAIT:
            # The copies land before the copier's warps meet; one arrive announces them.
            async_copy.commit_group()
            async_copy.wait_group(0)
            gl.thread_barrier()
            mbarrier.arrive(landed)
        else:
            async_copy.mbarrier_arrive(landed, increment_count=False)


@gluon.jit
def ring_kernel(src_ptr, out_ptr, rounds, num_warps: gl.constexpr, WAIT: gl.constexpr):
    # landed: one cp.async arrival per copier thread (or, WAIT, one arrive after the copier has
    # waited for its copies); free: the reader's arrival.
    slot, landed, free = _buffer_and_barriers(512, 1 if WAIT else num_warps * 32)
    mbarrier.arrive(free)  # the slot starts free
    gl.warp_specialize(
        [
            (_ring_copier, (src_ptr, slot, landed, free, rounds, WAIT)),
            (_reader, (slot, landed, free, out_ptr, rounds, 512)),
        ],
        [4],
        [96],
    )


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "handoff"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    out = torch.zeros(256, device="cuda")
    if mode == "handoff":
        x = torch.randn(128, device="cuda")
        probe_kernel[(4,)](x, out, rounds, num_warps=4)
        torch.cuda.synchronize()
        ok = torch.allclose(out[:128], x * rounds * (rounds + 1) / 2)
    elif mode in ("ring", "ring-wait"):
        src = torch.randn(rounds, 512, device="cuda")
        out = torch.zeros(512, device="cuda")
        ring_kernel[(2,)](src, out, rounds, num_warps=4, WAIT=mode == "ring-wait")
        torch.cuda.synchronize()
        ok = torch.allclose(out, src.sum(0), atol=1e-4)
    else:
        alternate_kernel[(2,)](out, rounds, num_warps=4)
        torch.cuda.synchronize()
        # round k reads the value k that round k - 1 wrote
        ok = out[0].item() == sum(range(2, rounds, 2)) and out[128].item() == sum(range(1, rounds, 2))
    print("probe", mode, rounds, "values ok" if ok else "VALUES WRONG")


if __name__ == "__main__":
    main()
