# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""How fast can a program gather ``fp8_ds_mla`` rows into shared memory, by ``cp.async`` or by TMA?

    python -m probes.row_gather                  # GPU: a table, a row a method
    python -m probes.row_gather --compile-only   # CPU: every method compiled for sm_90

An ``fp8_ds_mla`` row is 656 bytes (512 e4m3 latent values, 4 float32 scales, 64 bf16 rope
values), so a row starts 16-byte aligned and crosses a 128-byte line boundary wherever it is.
The sparse decode kernels gather rows with ``cp.async``, 16 bytes a thread, a warp across a
row's 512 latent bytes. An Nsight Compute profile of the 16-row kernel (H100, 2026-12-06, H16
B128 q2, top-k 2048) counted 2.6 times the ideal L1 shared-memory wavefronts and 1.5 times the
ideal L2 sectors on those copies, 8 times on the 16-byte scale copies, with the L1/shared pipe
66% busy. Hopper's TMA copies a box of a row instead (the cache as ``[rows, 82]`` int64), issued
by one thread and counted on an mbarrier.

Each method gathers every query's ``TOPK`` rows in ``CHUNK``-row chunks through a ring of
``SLOTS`` chunks, one program a query (the 16-row kernel's schedule), and folds a few bytes of
each landed chunk into a checksum (so no copy is dead):

* ``cpasync``: the kernels' gather (latent ``[CHUNK, 512]``, rope ``[CHUNK, 128]``, scales
  ``[CHUNK, 16]``, 16 bytes a thread), 8 warps;
* ``tma-row``: one TMA copy a row, a ``[1, 128]`` int64 box whose columns past the 82 of the
  tensor are zero-filled, not read (Gluon's shapes are powers of two), into 1024-byte shared
  rows;
* ``tma-parts``: three TMA copies a row, latent ``[1, 64]``, scales ``[1, 2]`` and rope
  ``[1, 16]`` int64, into three rings (where the kernels want them apart).

A slot of ``-1`` (a pad; ``--pads`` of them, spread at random) reads nothing: ``cp.async``
masks it, TMA takes row ``-1``, outside the tensor, and zero-fills it (its bytes still count on
the chunk's mbarrier, which the TMA gather of ``probes/candidates/rows-tma-gather.patch`` relies
on: a wrong count hangs the method). The methods' checksums must agree with the one torch
computes. Bytes = queries x ``TOPK`` x 656.
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROW_BYTES = 656
"""Bytes of an ``fp8_ds_mla`` row (512 + 4·4 + 64·2)."""
WORDS = ROW_BYTES // 8
"""The row as int64 words (82)."""
TOPK = 2048
CHUNK = 32
SLOTS = 3
WARPS = 8
PLAIN = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)


@gluon.jit
def _checksum(slot, ROWS: gl.constexpr, COLS: gl.constexpr):
    """The sum of the first int32 of each of the slot's ``ROWS`` rows (a ``[ROWS, COLS]``
    int64 view), as int64."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [gl.num_warps(), 1], [1, 0])
    first = slot.slice(0, 1, dim=1).load(layout)
    return gl.sum(gl.sum(first & 0xFFFFFFFF, axis=1), axis=0)


@gluon.jit
def _copy_part(dst, kv_ptr, slot_ptr, FIRST: gl.constexpr, LD: gl.constexpr, ROW_BYTES: gl.constexpr):
    """``cp.async`` bytes ``[FIRST, FIRST + width)`` of the rows ``slot_ptr[0:rows]`` into ``dst``
    (``[rows, width]`` uint8, copy layout ``LD``); a ``-1`` slot's row is zero-filled, not read."""
    rows = gl.arange(0, dst.shape[0], layout=gl.SliceLayout(1, LD))
    cols = gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LD))
    tok = gl.load(slot_ptr + rows).to(gl.int64)
    ptrs = kv_ptr + tok[:, None] * ROW_BYTES + FIRST + cols[None, :]
    async_copy.async_copy_global_to_shared(dst, ptrs, mask=(tok >= 0)[:, None])


@gluon.jit
def cpasync_gather_kernel(kv_ptr, slots_ptr, out_ptr, TOPK: gl.constexpr, CHUNK: gl.constexpr,
                          SLOTS: gl.constexpr, ROW_BYTES: gl.constexpr):  # fmt: skip
    """Program ``q`` gathers the rows ``slots[q, :]`` of the byte cache ``kv_ptr`` (uint8
    ``[rows, ROW_BYTES]``) by ``cp.async``; ``out[q]``: the checksum."""
    q = gl.program_id(0)
    warps: gl.constexpr = gl.num_warps()
    lat_ld: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [warps, 1], [1, 0])
    rope_ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])
    scale_ld: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [warps, 1], [1, 0])
    lat = gl.allocate_shared_memory(gl.uint8, [SLOTS, CHUNK, 512], PLAIN)
    rope = gl.allocate_shared_memory(gl.uint8, [SLOTS, CHUNK, 128], PLAIN)
    scale = gl.allocate_shared_memory(gl.uint8, [SLOTS, CHUNK, 16], PLAIN)
    total = gl.to_tensor(0).to(gl.int64)
    N: gl.constexpr = TOPK // CHUNK
    for c in range(N + SLOTS - 1):
        if c < N:
            s = c % SLOTS
            base = slots_ptr + q * TOPK + c * CHUNK
            _copy_part(lat.index(s), kv_ptr, base, 0, lat_ld, ROW_BYTES)
            _copy_part(rope.index(s), kv_ptr, base, 528, rope_ld, ROW_BYTES)
            _copy_part(scale.index(s), kv_ptr, base, 512, scale_ld, ROW_BYTES)
        async_copy.commit_group()
        if c >= SLOTS - 1:
            async_copy.wait_group(SLOTS - 1)
            gl.thread_barrier()
            done = (c - (SLOTS - 1)) % SLOTS
            total += _checksum(lat.index(done)._reinterpret(gl.int64, [CHUNK, 64], PLAIN), CHUNK, 64)
            gl.thread_barrier()
    gl.store(out_ptr + q, total)


@gluon.jit
def tma_gather_kernel(lat_desc, scale_desc, rope_desc, slots_ptr, out_ptr, TOPK: gl.constexpr,
                      CHUNK: gl.constexpr, SLOTS: gl.constexpr, PARTS: gl.constexpr):  # fmt: skip
    """Program ``q`` gathers the rows ``slots[q, :]`` by TMA (the descriptors: the cache as
    int64 ``[rows, 82]``): ``PARTS == 1``, one copy a row (``lat_desc``'s box ``[1, COLS]``, the
    columns past 82 zero-filled); ``PARTS == 3``, three a row (latent ``[1, 64]`` at word 0,
    scales ``[1, 2]`` at word 64, rope ``[1, 16]`` at word 66) into three rings. ``out[q]``:
    the checksum."""
    q = gl.program_id(0)
    COLS: gl.constexpr = lat_desc.block_shape[1]
    lat = gl.allocate_shared_memory(gl.int64, [SLOTS, CHUNK, COLS], lat_desc.layout)
    scale = gl.allocate_shared_memory(gl.int64, [SLOTS, CHUNK, 2], scale_desc.layout)
    rope = gl.allocate_shared_memory(gl.int64, [SLOTS, CHUNK, 16], rope_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(bars.index(i), count=1)
    ROW_TX: gl.constexpr = COLS * 8 if PARTS == 1 else (64 + 2 + 16) * 8
    total = gl.to_tensor(0).to(gl.int64)
    N: gl.constexpr = TOPK // CHUNK
    for c in range(N + SLOTS - 1):
        if c < N:
            s = c % SLOTS
            mbarrier.expect(bars.index(s), CHUNK * ROW_TX)
            for r in gl.static_range(CHUNK):
                tok = gl.load(slots_ptr + q * TOPK + c * CHUNK + r)
                tma.async_copy_global_to_shared(
                    lat_desc, [tok, 0], bars.index(s), lat.index(s).slice(r, 1, dim=0)
                )
                if PARTS == 3:
                    tma.async_copy_global_to_shared(
                        scale_desc, [tok, 64], bars.index(s), scale.index(s).slice(r, 1, dim=0)
                    )
                    tma.async_copy_global_to_shared(
                        rope_desc, [tok, 66], bars.index(s), rope.index(s).slice(r, 1, dim=0)
                    )
        if c >= SLOTS - 1:
            done = c - (SLOTS - 1)
            mbarrier.wait(bars.index(done % SLOTS), (done // SLOTS) & 1)
            total += _checksum(lat.index(done % SLOTS), CHUNK, COLS)
            # every thread's reads of the slot are done before the next copies into it
            gl.thread_barrier()
            fence_async_shared()
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(bars.index(i))
    gl.store(out_ptr + q, total)


def launch(method: str, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """Gather with ``method`` (:data:`METHODS`): ``cache`` uint8 ``[rows, 656]``, ``slots`` int32
    ``[queries, TOPK]``, ``out`` int64 ``[queries]``."""
    grid = (slots.shape[0],)
    if method == "cpasync":
        cpasync_gather_kernel[grid](cache, slots, out, TOPK, CHUNK, SLOTS, ROW_BYTES, num_warps=WARPS)
        return
    words = cache.view(torch.int64)
    shape, strides = list(words.shape), [WORDS, 1]

    def box(cols: int) -> TensorDescriptor:
        return TensorDescriptor(words, shape, strides, [1, cols], BOX_LAYOUT)

    if method == "tma-row":
        one = box(128)
        tma_gather_kernel[grid](one, box(2), box(16), slots, out, TOPK, CHUNK, SLOTS, 1, num_warps=WARPS)
    else:
        tma_gather_kernel[grid](box(64), box(2), box(16), slots, out, TOPK, CHUNK, SLOTS, 3, num_warps=WARPS)


METHODS = ("cpasync", "tma-row", "tma-parts")
"""The gather methods (module docstring)."""


def expected(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The checksum torch computes: per query, the sum of each gathered row's first int32 (as
    an unsigned value); a ``-1`` slot adds 0."""
    first = cache.view(torch.int32)[:, 0].to(torch.int64) & 0xFFFFFFFF
    picked = first[slots.long().clamp(min=0)]
    return torch.where(slots >= 0, picked, 0).sum(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile every method for sm_90 (CPU)")
    parser.add_argument("--queries", type=int, default=256, help="queries (programs; default 256: B128 q2)")
    parser.add_argument("--context", type=int, default=32768, help="tokens a request (default 32768)")
    parser.add_argument("--pads", type=float, default=1 / 16, help="share of -1 slots (default 1/16)")
    args = parser.parse_args()
    if args.compile_only:
        from mla.testing.triton_driver import stand_in_driver

        cache = torch.zeros(4 * 64, ROW_BYTES, dtype=torch.uint8)
        slots = torch.zeros(2, TOPK, dtype=torch.int32)
        out = torch.zeros(2, dtype=torch.int64)
        with stand_in_driver(compile_kernels=True) as driver:
            for method in METHODS:
                driver.launches.clear()
                launch(method, cache, slots, out)
                print(method, [str(launch_.function) for launch_ in driver.launches])
        return
    from benchmarks._common import bench_us, print_table

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    requests = max(1, args.queries // 2)
    cache = torch.randint(0, 256, (requests * args.context, ROW_BYTES), generator=gen, device=device,
                          dtype=torch.uint8)  # fmt: skip
    request = torch.arange(args.queries, device=device) // 2
    picks = torch.randint(0, args.context, (args.queries, TOPK), generator=gen, device=device)
    slots = (request[:, None] * args.context + picks).int()
    pad = torch.rand(slots.shape, generator=gen, device=device) < args.pads
    slots = torch.where(pad, -1, slots)
    want = expected(cache, slots)
    gbytes = args.queries * TOPK * ROW_BYTES / 1e9
    rows = []
    for method in METHODS:
        out = torch.full((args.queries,), -1, dtype=torch.int64, device=device)
        try:
            launch(method, cache, slots, out)
            torch.cuda.synchronize()
        except Exception as error:  # a method the GPU refuses (e.g. an alignment fault) is reported
            rows.append({"method": method, "µs": "-", "TB/s": "-", "checksum": type(error).__name__})
            continue
        ok = bool(torch.equal(out, want))

        def run(method: str = method, out: torch.Tensor = out) -> None:
            launch(method, cache, slots, out)

        us = bench_us(run) if ok else math.nan
        rows.append({"method": method, "µs": f"{us:.1f}", "TB/s": f"{gbytes / us * 1e3:.2f}",
                     "checksum": "ok" if ok else "wrong"})  # fmt: skip
        print(rows[-1], flush=True)
    print_table(rows, title=f"{args.queries} queries x {TOPK} rows of {ROW_BYTES} bytes ({gbytes:.3f} GB)")


if __name__ == "__main__":
    main()
