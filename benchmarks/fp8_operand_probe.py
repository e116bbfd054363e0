"""Compile probe: how Triton lowers a transposed fp8 wgmma register operand (no GPU needed).

The dual-chain kernel (``mla/providers/gluon/dual.py``) stored every widened tile as an fp16 V
tile that ``Oᵀ += Vᵀ·Pᵀ`` read from shared memory: about half of the shared-memory traffic of
a tile. Taking ``Vᵀ`` from registers instead reads the fp8 ring a second time, transposed:
each thread needs two adjacent tokens (rows of the ring) of one latent column. This probe
compiles that read for sm_90 (a ``[128, 64]`` block of ``Vᵀ`` from a 128-byte-swizzled fp8 box,
four ``k=16`` wgmmas) and counts the shared-memory instructions, in two column orders:

* ``plain``: ``Vᵀ`` as it is;
* ``paired``: the latent columns reordered within each 16 (``16b + 2j + e → 16b + 8e + j``) so
  a thread's rows ``r`` and ``r + 8`` are two adjacent bytes of one ring row, the layout
  ``ldmatrix.trans`` delivers.

    python benchmarks/fp8_operand_probe.py

Triton 3.6 (2026-12-01): ``plain`` 64 one-byte loads per thread, ``paired`` 32 two-byte loads
and 148 byte permutes per thread, ``ldmatrix`` in neither; the non-transposed QKᵀ operand of
the dual-chain kernel gets ``ldmatrix`` (``benchmarks/gluon_compile.py --dual --sass``). The
way that does get ``ldmatrix.trans`` is the one the dual-chain kernel now takes: the box read as
16-bit pairs of fp8 values (``dual._box_pairs``) and split into even and odd columns in
registers (``dual._split_widen``).
"""

from __future__ import annotations

import collections
import os
import re
import sys

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

from gluon_compile import sass_of

BOX = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


@gluon.jit
def _paired_rows(x):
    """``x`` ``[kv, d]`` with the columns of each 16 reordered: ``16b + 2j + e → 16b + 8e + j``."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    return x.reshape([rows, cols // 16, 8, 2]).permute((0, 1, 3, 2)).reshape([rows, cols])


@gluon.jit
def probe_kernel(kv_ptr, p_ptr, out_ptr, PAIRED: gl.constexpr):
    ring = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], BOX)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, ld))
    ring.store(gl.load(kv_ptr + r[:, None] * 128 + c[None, :]))
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    p_smem = gl.allocate_shared_memory(
        gl.float16, [64, 16], gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    )
    pl: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    pr = gl.arange(0, 64, layout=gl.SliceLayout(1, pl))
    pc = gl.arange(0, 16, layout=gl.SliceLayout(0, pl))
    p_smem.store(gl.load(p_ptr + pr[:, None] * 16 + pc[None, :]))
    fence_async_shared()
    gl.thread_barrier()
    # The same bytes as a row-swizzled layout, which can be reshaped and sliced.
    same: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    view = ring._reinterpret(gl.float8e4nv, [64, 128], same)
    if PAIRED:
        view = _paired_rows(view)
    vt = view.permute((1, 0))
    acc = gl.zeros([128, 16], gl.float32, layout=acc_layout)
    for k in gl.static_range(4):
        a = vt.slice(k * 16, 16, dim=1).load(a_layout).to(gl.float16)
        acc = warpgroup_mma(a, p_smem.slice(k * 16, 16, dim=0), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    o_r = gl.arange(0, 128, layout=gl.SliceLayout(1, acc_layout))
    o_c = gl.arange(0, 16, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + o_r[:, None] * 16 + o_c[None, :], acc)


def shared_instructions(paired: bool) -> dict[str, int]:
    """Per-thread counts of the shared-memory loads, byte permutes and fp8 conversions."""
    src = GluonASTSource(
        probe_kernel,
        signature={"kv_ptr": "*fp8e4nv", "p_ptr": "*fp16", "out_ptr": "*fp32", "PAIRED": "constexpr"},
        constexprs={"PAIRED": paired},
    )
    sass = sass_of(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))
    ops = re.findall(r"\b(LDSM[.A-Z0-9_]*|LDS[.A-Z0-9_]*|PRMT|F2FP\.F16\.E4M3[.A-Z0-9_]*)", sass)
    return dict(collections.Counter(ops))


def main() -> None:
    for paired in (False, True):
        print("paired" if paired else "plain ", shared_instructions(paired))


if __name__ == "__main__":
    main()
