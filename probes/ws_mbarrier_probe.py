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

The ``handoff2`` modes reproduce the hand-off of the per-key flags in the Gluon prefill's split
layout (``mla/providers/gluon/prefill_parts.py``: ``_split_producer``, ``_clean_v``;
``prefill.py``: ``_attend_tile``), where racecheck reported 16 hazards between the producer's
flag store (``prefill_parts.py:117``) and the consumers' flag loads (``prefill.py:139``), one
difference at a time. ``handoff2``: the writer is the default partition (the launch's 4 warps);
two 4-warp worker partitions wait on ``full`` (count 1), read the vector and each release it
(``thread_barrier``, one arrive) on ``empty``, initialised with count 2 and pre-arrived with
count 2 so that the writer's first wait passes. From ``handoff2``:

* ``handoff2-ldst``: plain ``st.shared.b32`` and ``ld.shared.b32`` (every 4th float a warp).
  The vector's layout in ``handoff``, ``alternate`` and ``handoff2`` (32 consecutive floats a
  warp) compiles to ``stmatrix`` and ``ldmatrix`` on sm_90; the prefill's flag store and loads
  compile to ``st.shared.b32`` and ``ld.shared.v2.b32`` (so ``handoff``'s clean result above is
  one for ``stmatrix`` and ``ldmatrix``). ``handoff-ldst`` is ``handoff`` with the layout of
  ``handoff2-ldst``.
* ``handoff2-fence``: ``fence_async_shared()`` between the writer's stores and its
  ``thread_barrier``, as in ``_clean_v``.
* ``handoff2-replicated``: the writer stores as ``_clean_v`` stores the flags (the row maxima of
  ``[16, 128]`` tiles, each value stored by 8 threads to one address: ``st.shared.b32``); the
  readers load in the split consumers' key layout (a slice of a wgmma accumulator layout:
  ``ld.shared.v2.b32``): the instructions of the prefill's two lines.
* ``handoff2-tma``: odd rounds the writer TMAs the round's vector into the vector's buffer
  (``mbarrier.expect`` and ``tma.async_copy_global_to_shared``, ``full`` completed by the
  transaction count); even rounds as ``handoff2``. (Triton puts a ``fence.proxy.async`` and a
  barrier of the writer's warps before each TMA: it overwrites generic stores.)
* ``handoff2-tma-apart``: the same, the TMA landing in a buffer of its own, as in the prefill
  (the V tile by TMA, the flags only by stores, both announced on ``v_ready[s]``): only how the
  barrier's phases complete alternates.

    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe handoff2 4
    compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe handoff2-replicated 4

and so for each of the others and ``handoff-ldst``.

H200, Triton 3.6, 2026-12-04 15:47 UTC, 4 rounds each, values right in every mode:

* ``handoff`` 0 hazards; ``handoff-ldst`` 1 (the writer's store, line 117, against the reader's
  load, line 129): the same worker-to-worker hand-off is reported once its accesses are plain
  ``st.shared``/``ld.shared`` instead of ``stmatrix``/``ldmatrix``;
* ``handoff2``, ``handoff2-fence``, ``handoff2-tma``, ``handoff2-tma-apart``: 1 hazard each, the
  start-up class (the kernel's own lines), none on the vector: a default-partition writer is
  not what racecheck reports;
* ``handoff2-ldst`` 2 hazards, the vector's store against its loads; ``handoff2-replicated``
  9 (8 replicated ``st.shared.b32`` stores against 32 loads): the prefill's report.

So racecheck reports this synchronisation (a barrier of the writer's warps, one release arrive,
the readers' acquire wait) whenever the accesses are plain shared stores and loads, whichever
partition writes; the prefill's flag hand-off is that case.
"""

import sys
from collections.abc import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _idle(out_ptr):
    pass


@gluon.constexpr_function
def _vector_layout(ldst):
    """The layout in which 4 warps store and load a 128-float vector: one float a thread, 32
    consecutive floats a warp (sm_90: ``stmatrix`` and ``ldmatrix``), or (``ldst``) every 4th
    float a warp (plain ``st.shared.b32`` and ``ld.shared.b32``)."""
    if ldst:
        return gl.DistributedLinearLayout(
            reg_bases=[],
            lane_bases=[[4], [8], [16], [32], [64]],
            warp_bases=[[1], [2]],
            block_bases=[],
            shape=[128],
        )
    return gl.BlockedLayout([1], [32], [4], [0])


@gluon.jit
def _writer(buf, full, empty, x_ptr, rounds, LDST: gl.constexpr = False):
    lay: gl.constexpr = _vector_layout(LDST)
    offs = gl.arange(0, 128, layout=lay)
    for k in range(rounds):
        mbarrier.wait(empty, (k & 1) ^ 1)
        buf.store(gl.load(x_ptr + offs) * (k + 1))
        gl.thread_barrier()
        mbarrier.arrive(full)


@gluon.jit
def _reader(buf, full, empty, out_ptr, rounds, N: gl.constexpr = 128, LDST: gl.constexpr = False):
    # The reader partition's warps are not the writer's: every value crosses warps.
    lay: gl.constexpr = _vector_layout(LDST) if N == 128 else gl.BlockedLayout([N // 128], [32], [4], [0])
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
def probe_kernel(x_ptr, out_ptr, rounds, num_warps: gl.constexpr, LDST: gl.constexpr):
    buf, full, empty = _buffer_and_barriers(128, 1)
    gl.warp_specialize(
        [
            (_idle, (out_ptr,)),
            (_writer, (buf, full, empty, x_ptr, rounds, LDST)),
            (_reader, (buf, full, empty, out_ptr, rounds, 128, LDST)),
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


VECTOR_TMA_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
"""The shared layout of a vector that TMA writes (unswizzled) and of its descriptor's boxes."""


@gluon.constexpr_function
def _keys_layout():
    """The key layout of the prefill's split consumers, in which they load the flags: the columns
    of a 4-warp ``[64, 128]`` wgmma accumulator, each held by several threads (``ld.shared.v2``)."""
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    return gl.SliceLayout(0, mma)


@gluon.jit
def _publish(buf, full, x_ptr, k, FENCE: gl.constexpr, REPLICATED: gl.constexpr, LDST: gl.constexpr):
    """Round ``k``'s vector (``x · (k + 1)``) stored into ``buf`` by the writer's 4 warps (in
    :func:`_vector_layout`) and announced on ``full`` (one arrive). ``REPLICATED``: stored as
    ``_clean_v`` stores the prefill's flags instead, 16 at a time, each the row maximum of a
    ``[16, 128]`` tile, so that 8 threads store each value to the same address (``st.shared.b32``).
    ``FENCE``: ``fence_async_shared()`` between the stores and the barrier of the writer's warps."""
    if REPLICATED:
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, ld)).to(gl.float32)
        for r in gl.static_range(8):
            rows = r * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, ld))
            tile = (gl.load(x_ptr + rows) * (k + 1))[:, None] - cols[None, :]  # row max: column 0
            buf.slice(r * 16, 16, dim=0).store(gl.max(tile, axis=1))
    else:
        lay: gl.constexpr = _vector_layout(LDST)
        buf.store(gl.load(x_ptr + gl.arange(0, 128, layout=lay)) * (k + 1))
    if FENCE:
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(full)


@gluon.jit
def _writer2(
    buf, tbuf, full, empty, x_ptr, x_desc, rounds, FENCE: gl.constexpr, REPLICATED: gl.constexpr,
    TMA: gl.constexpr, LDST: gl.constexpr,
):  # fmt: skip
    """The default partition (the launch's 4 warps), as the prefill's split producer: each round,
    once both readers have released the vector (``empty``), publish the next one on ``full``.
    ``TMA``: odd rounds instead TMA row ``k`` of ``x_desc`` into ``tbuf``, completing ``full``
    by its transaction count."""
    for k in range(rounds):
        mbarrier.wait(empty, k & 1)
        if TMA:
            if k % 2 == 1:
                mbarrier.expect(full, x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [k * 128], full, tbuf)
            else:
                _publish(buf, full, x_ptr, k, FENCE, REPLICATED, LDST)
        else:
            _publish(buf, full, x_ptr, k, FENCE, REPLICATED, LDST)


@gluon.jit
def _reader2(
    buf, tbuf, full, empty, out_ptr, rounds, W: gl.constexpr, REPLICATED: gl.constexpr, TMA: gl.constexpr,
    LDST: gl.constexpr,
):  # fmt: skip
    """Reader ``W`` (a 4-warp worker, as a split consumer of the prefill): each round waits on
    ``full``, adds the vector (``TMA``: ``tbuf``'s on odd rounds) to its sum, waits for its own
    warps and releases the vector on ``empty`` (one of its two arrivals a phase). ``REPLICATED``:
    in the prefill's key layout, else in :func:`_vector_layout`."""
    lay: gl.constexpr = _keys_layout() if REPLICATED else _vector_layout(LDST)
    acc = gl.zeros([128], gl.float32, layout=lay)
    for k in range(rounds):
        mbarrier.wait(full, k & 1)
        if TMA:
            if k % 2 == 1:
                acc += tbuf.load(lay)
            else:
                acc += buf.load(lay)
        else:
            acc += buf.load(lay)
        gl.thread_barrier()
        mbarrier.arrive(empty)
    gl.store(out_ptr + W * 128 + gl.arange(0, 128, layout=lay), acc)


@gluon.jit
def handoff2_kernel(
    x_ptr, x_desc, out_ptr, rounds, num_warps: gl.constexpr, FENCE: gl.constexpr,
    REPLICATED: gl.constexpr, TMA: gl.constexpr, LDST: gl.constexpr,
):  # fmt: skip
    """``handoff2*``: the default partition writes, two worker partitions read. ``TMA``: 0 none,
    1 the TMA rounds land in the vector's own buffer, 2 in a buffer of their own (``x_desc``:
    the TMA rounds' source, ``None`` without ``TMA``)."""
    vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    if TMA == 1:
        buf = gl.allocate_shared_memory(gl.float32, [128], VECTOR_TMA_LAYOUT)
        tbuf = buf
    elif TMA == 2:
        buf = gl.allocate_shared_memory(gl.float32, [128], vec)
        tbuf = gl.allocate_shared_memory(gl.float32, [128], VECTOR_TMA_LAYOUT)
    else:
        buf = gl.allocate_shared_memory(gl.float32, [128], vec)
        tbuf = buf
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(empty, count=2)  # one release per reader
    mbarrier.arrive(empty, count=2)  # the vector starts free: the writer's first wait passes
    if TMA:
        fence_async_shared()  # (the initialised barriers before the async proxy's first transaction)
    gl.warp_specialize(
        [
            (_writer2, (buf, tbuf, full, empty, x_ptr, x_desc, rounds, FENCE, REPLICATED, TMA, LDST)),
            (_reader2, (buf, tbuf, full, empty, out_ptr, rounds, 0, REPLICATED, TMA, LDST)),
            (_reader2, (buf, tbuf, full, empty, out_ptr, rounds, 1, REPLICATED, TMA, LDST)),
        ],
        [4, 4],
        [96, 96],
    )


HANDOFF2 = {
    # mode: (FENCE, REPLICATED, TMA, LDST)
    "handoff2": (False, False, 0, False),
    "handoff2-ldst": (False, False, 0, True),
    "handoff2-fence": (True, False, 0, False),
    "handoff2-replicated": (False, True, 0, False),
    "handoff2-tma": (False, False, 1, False),
    "handoff2-tma-apart": (False, False, 2, False),
}
"""The ``handoff2`` modes: each differs from ``handoff2`` in one respect (module docstring)."""
MODES = ("handoff", "handoff-ldst", "alternate", "ring", "ring-wait", *HANDOFF2)


def launch(mode: str, rounds: int, device: str = "cuda") -> Callable[[], bool]:
    """Launch ``mode``'s kernel over ``rounds`` rounds on ``device``; returns the check of its
    values (to call once the kernel has finished)."""
    out = torch.zeros(256, device=device)
    if mode in ("handoff", "handoff-ldst"):
        x = torch.randn(128, device=device)
        probe_kernel[(4,)](x, out, rounds, num_warps=4, LDST=mode == "handoff-ldst")
        return lambda: torch.allclose(out[:128], x * rounds * (rounds + 1) / 2)
    if mode in HANDOFF2:
        fence, replicated, tma_rounds, ldst = HANDOFF2[mode]
        x = torch.randn(128, device=device)
        desc = None
        if tma_rounds:
            # row k: round k's vector, as the writer computes it (x · (k + 1))
            src = (x[None, :] * torch.arange(1, rounds + 1, device=device)[:, None]).reshape(-1)
            desc = TensorDescriptor(src, [rounds * 128], [1], [128], VECTOR_TMA_LAYOUT)
        handoff2_kernel[(2,)](
            x, desc, out, rounds, num_warps=4, FENCE=fence, REPLICATED=replicated, TMA=tma_rounds, LDST=ldst
        )
        # both readers summed every round
        return lambda: torch.allclose(out, (x * rounds * (rounds + 1) / 2).repeat(2), atol=1e-4)
    if mode in ("ring", "ring-wait"):
        src = torch.randn(rounds, 512, device=device)
        out = torch.zeros(512, device=device)
        ring_kernel[(2,)](src, out, rounds, num_warps=4, WAIT=mode == "ring-wait")
        return lambda: torch.allclose(out, src.sum(0), atol=1e-4)
    if mode != "alternate":
        raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    alternate_kernel[(2,)](out, rounds, num_warps=4)
    # round k reads the value k that round k - 1 wrote
    return lambda: out[0].item() == sum(range(2, rounds, 2)) and out[128].item() == sum(range(1, rounds, 2))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "handoff"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    check = launch(mode, rounds)
    torch.cuda.synchronize()
    print("probe", mode, rounds, "values ok" if check() else "VALUES WRONG")


if __name__ == "__main__":
    main()
