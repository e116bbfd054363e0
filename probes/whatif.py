"""What bounds a Gluon decode kernel: time it with one piece of its work taken out.

    python -m probes.whatif [--kernel dual|pingpong|rows] [--variants main ...] [--shapes ...]
    python -m probes.whatif --kernel pingpong --list   # the variants, no GPU needed
    python -m probes.whatif --compile-only             # compile every variant for sm_90, no GPU
    python -m probes.whatif --file my_dual.py --variants main file:my_dual   # a changed copy

Each variant is the source of the kernel's module (``mla/providers/gluon/dual.py``, the
dual-chain fp8 kernel; ``pingpong.py``, the 64-row kernel of 16-bit caches; or
``transposed.py``, the few-rows kernel, here on 16-bit caches) with a few textual edits
(:data:`KERNELS`), or a changed copy of it (``--file``), written to a temporary module and
launched by the provider's own launcher (``mla.providers.gluon.decode``) in place of the kernel
on ``main``. An edit whose text no longer occurs exactly once in the module raises, so a
variant never silently times the unchanged kernel.

Variants that drop work compute wrong outputs on purpose (their ``o err`` column shows it): they
bound what removing that work could gain, they are not candidates. The others (``exact``
in the table) are candidates: they must match the reference like ``main``. Every variant is
timed as CUDA-graph replays of the whole decode call (and per kernel with the torch profiler) on
the kernel's shapes of ``benchmarks/decode.py`` (``H16q1B128S8192``: heads, qlen, batch,
sequence length); ``main`` runs first and last to show the run-to-run spread. Results:
``docs/history/``, "The dual-chain fp8 kernel".
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

import mla.providers.gluon.dual as dual_on_main
import mla.providers.gluon.pingpong as pingpong_on_main
import mla.providers.gluon.transposed as rows_on_main
from benchmarks._common import print_table

Edit = tuple[str, str] | tuple[str, str, int]
"""``(old, new)``: replace the one occurrence of ``old``; ``(old, new, n)``: its ``n`` occurrences."""


def _module_lines(module: ModuleType, first: str, last: str) -> str:
    """The lines of ``module``'s source from the one that starts with ``first`` through the next
    one that starts with ``last`` (leading spaces count): a snippet an edit replaces, read from
    the kernel rather than copied. Raises when either line is gone (the probe then says which)."""
    path = Path(module.__file__ or "")
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(first)), None)
    if start is None:
        raise ValueError(f"no line of {path.name} starts with {first!r}")
    stop = next((i for i in range(start, len(lines)) if lines[i].startswith(last)), None)
    if stop is None:
        raise ValueError(f"no line of {path.name} after {first!r} starts with {last!r}")
    return "".join(lines[start : stop + 1])


def _dual_lines(first: str, last: str) -> str:
    """:func:`_module_lines` of ``dual.py``, the dual-chain kernel."""
    return _module_lines(dual_on_main, first, last)


def _pingpong_lines(first: str, last: str) -> str:
    """:func:`_module_lines` of ``pingpong.py``, the ping-pong kernel."""
    return _module_lines(pingpong_on_main, first, last)


def _rows_lines(first: str, last: str) -> str:
    """:func:`_module_lines` of ``transposed.py``, the few-rows kernel."""
    return _module_lines(rows_on_main, first, last)


_PV = _dual_lines(
    "        al = alpha[None, :]", "        o2e, o2o, o3e, o3o = warpgroup_mma_wait(num_outstanding=0"
)
"""The MMA warpgroup's PV: the four latent boxes read transposed, widened and multiplied."""
# P still feeds the output (its column sums), so nothing upstream of PV becomes dead code; that
# adds one cross-warp reduction a tile, which fixed-row-max bounds.
_NO_PV: list[Edit] = [
    (
        _PV,
        """        mbarrier.arrive(free.index(s))
        o0e = o0e * alpha[None, :] + gl.sum(p, 0)[None, :]
""",
    )
]

_AFTER_LOOP = "    l_i = gl.sum(l_part, 0)\n"
"""The MMA warpgroup's first line after its loop (the row sums across the warps)."""


def _after_loop(code: str) -> Edit:
    """An edit that puts ``code`` right after the MMA warpgroup's loop."""
    return (_AFTER_LOOP, _AFTER_LOOP + code)


_SOFTMAX = _dual_lines(
    "        visible = gl.expand_dims(n, 1) < gl.expand_dims(limit, 0)",
    "        l_part = l_part * gl.expand_dims(alpha, 0) + p",
)
"""The MMA warpgroup's softmax (against the reference max), which the softmax variants replace."""
_P_STORE = """        p_w.store(p.to(p_w.dtype))
        fence_async_shared()
        gl.thread_barrier()
"""
# The online softmax of the other Gluon kernels: each tile's row max and row sum reduced across
# the warpgroup's warps by the compiler (two barriers each).
_M_INIT = '    m_i = gl.full([NR], float("-inf"), gl.float32, layout=rows_layout)\n'
_ONLINE_SOFTMAX: list[Edit] = [
    (
        "from mla.providers.gluon.kernels import (\n",
        "from mla.providers.gluon.kernels import (\n    _online_softmax,\n",
    ),
    (_M_INIT, _M_INIT + "    l_i = gl.zeros([NR], gl.float32, layout=rows_layout)\n"),
    (
        _SOFTMAX,
        """        p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i, n, key_ok, limit, qk_scale, 0)
"""
        + _P_STORE,
    ),
    (_AFTER_LOOP, ""),
]
# Every row's max taken as 8 (log2 domain) for the whole request: no row-max exchange at all.
# Exact only while no score exceeds it.
_FIXED_ROW_MAX: list[Edit] = [
    (
        _SOFTMAX,
        """        visible = gl.expand_dims(n, 1) < gl.expand_dims(limit, 0)
        if key_ok is not None:
            visible = visible & gl.expand_dims(key_ok, 1)
        p = gl.exp2(gl.where(visible, sc * qk_scale, float("-inf")) - 8.0)
"""
        + _P_STORE
        + """        alpha = gl.full([NR], 1.0, gl.float32, layout=rows_layout)
        l_part = l_part + p
""",
    ),
    _after_loop("    m_i = gl.full([NR], 8.0, gl.float32, layout=rows_layout)\n"),
]

_GATHER = "_gather_tile(kv_ptr, ids, ok, idr, okr, stride_kv, lat_ring, rope_ring, landed, w, L, R)"
_NO_DRAM: list[Edit] = [
    # every tile by the gather, every row masked: cp.async zero-fills the ring, no cache read
    ("        if consecutive & (lo + (t + 1) * BLOCK_N <= hi):", "        if False:"),
    (_GATHER, _GATHER.replace("ok, idr, okr,", "ok & False, idr, okr & False,")),
]

_FREE_THEN_LAST_BOX = _dual_lines(
    "        # Every read of the ring slot is done", "        o3o = warpgroup_mma(v3o"
)
"""The slot's release (a comment, a barrier, the arrive) and the last box's two PV MMAs."""
# The last box's MMAs issued before the slot's release (they read registers and P, not the
# ring). In the sm_90 SASS the compiler then puts one barrier at the loop's top instead of two
# (before P's store and after the arrive): three barriers of the warpgroup a tile, not four.
_RELEASE_AFTER_LAST_MMA: list[Edit] = [
    (
        _FREE_THEN_LAST_BOX,
        "".join(
            _FREE_THEN_LAST_BOX.splitlines(keepends=True)[3:]
            + _FREE_THEN_LAST_BOX.splitlines(keepends=True)[:3]
        ),
    )
]

# QKᵀ in 128-column steps (one latent box each) instead of 64: half the waits of the chain.
_QK_CHUNK_128: list[Edit] = [("QK_CHUNK = gl.constexpr(64)", "QK_CHUNK = gl.constexpr(128)")]
# -- the fp8 widening (cvt.rn.f16x2.e4m3x2: two values an instruction) --------------------------
_PV_CVT = _dual_lines('        f"cvt.rn.f16x2.{fmt} $0, lo;', '        f"cvt.rn.f16x2.{fmt} $1, hi;')
"""PV's two packed conversions in :func:`_split_widen` (even and odd columns)."""
_BYTE_MOVES = "prmt.b32 $0, $2, 0, 0x4140;\\nprmt.b32 $1, $2, 0, 0x4342;"
_FAKE16 = (
    "\n@gluon.jit\ndef _fake16(x):\n"
    "    return gl.inline_asm_elementwise(\n"
    f'        "{_BYTE_MOVES}", "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4\n'
    "    )\n\n"
)
# QKᵀ's K tile "widened" by byte moves (each fp8 byte the low byte of an fp16): wrong values,
# the conversions' cost taken out.
_NO_WIDEN_QK: list[Edit] = [
    ("\n@gluon.jit\ndef _split_widen(", _FAKE16 + "\n@gluon.jit\ndef _split_widen("),
    ("a = _ring_chunk(lat_ring, s * LB, 0).load(a_layout).to(gl.float16)",
     "a = _fake16(_ring_chunk(lat_ring, s * LB, 0).load(a_layout))"),
    ("a = _ring_chunk(lat_ring, s * LB, c).load(a_layout).to(gl.float16)",
     "a = _fake16(_ring_chunk(lat_ring, s * LB, c).load(a_layout))"),
    ("a_r = _paired_k(_row_swizzled(rope_ring.index(s))).load(a_layout).to(gl.float16)",
     "a_r = _fake16(_paired_k(_row_swizzled(rope_ring.index(s))).load(a_layout))"),
]  # fmt: skip
# PV's V boxes "widened" by byte moves: one prmt an output register instead of a cvt.
_NO_WIDEN_PV: list[Edit] = [
    (_PV_CVT, '        "prmt.b32 $0, t, 0, 0x4140;\\n"\n        "prmt.b32 $1, t, 0, 0x4342; }",\n')
]
# e4m3 exactly by integer operations: byte b = s eeee mmm becomes the fp16 s 0eeee mmm0000000,
# the value times 2**-8 (((b + (b & 0x80)) << 7) carries the sign to bit 15); the accumulators
# are scaled by 2**8 at the end.
_INT_EVEN = (
    '        "prmt.b32 u, $2, 0, 0x4240;\\nand.b32 m, u, 0x00800080;\\n"\n'
    '        "add.u32 u, u, m;\\nshl.b32 $0, u, 7;\\n"\n'
)
_INT_ODD = (
    '        "prmt.b32 u, $2, 0, 0x4341;\\nand.b32 m, u, 0x00800080;\\n"\n'
    '        "add.u32 u, u, m;\\nshl.b32 $1, u, 7; }",\n'
)
_PIECES = "    pieces = (o0e, o0o, o1e, o1o, o2e, o2o, o3e, o3o)\n"
_INT_REGISTERS: Edit = ('"{ .reg .b32 t; .reg .b16 lo, hi;', '"{ .reg .b32 t, u, m; .reg .b16 lo, hi;')
"""The two registers the integer widening adds to :func:`_split_widen`'s PTX."""
_PV_INT_WIDEN: list[Edit] = [
    _INT_REGISTERS,
    (_PV_CVT, _INT_EVEN + _INT_ODD),
    (
        _PIECES,
        "    pieces = (\n"
        "        o0e * 256.0, o0o * 256.0, o1e * 256.0, o1o * 256.0,\n"
        "        o2e * 256.0, o2o * 256.0, o3e * 256.0, o3o * 256.0,\n"
        "    )\n",
    ),
]
# Half of PV's widening by integer operations (the even columns), half by cvt (the odd ones).
_PV_HALF_INT_WIDEN: list[Edit] = [
    _INT_REGISTERS,
    (_PV_CVT, _INT_EVEN + _PV_CVT.splitlines(keepends=True)[1]),
    (_PIECES, "    pieces = (o0e * 256.0, o0o, o1e * 256.0, o1o, o2e * 256.0, o2o, o3e * 256.0, o3o)\n"),
]
# The loader reads token ids two tiles ahead instead of one (their load's latency under the
# cache traffic hidden behind two tiles).
_IDS_ONE_AHEAD = _dual_lines(
    "    ids, ok = _tile_ids(index_base, lo, hi, 0, id_limit, BLOCK_N, rows, PAGE_SIZE)",
    "            index_base, lo, hi, t + 1, id_limit,",
)
"""The loader's ids of tile 0 before its loop through those of tile ``t + 1`` (both copy layouts)
in it."""
_IDS_TWO_AHEAD: list[Edit] = [
    (
        # the ids of tiles 0 and 1 before the loop, those of t + 2 in it
        _IDS_ONE_AHEAD,
        _IDS_ONE_AHEAD.replace("t + 1,", "t + 2,").replace(
            "    for t in range(n_tiles):\n",
            "    ids1, ok1 = _tile_ids(index_base, lo, hi, 1, id_limit, BLOCK_N, rows, PAGE_SIZE)\n"
            "    idr1, okr1 = _tile_ids(\n"
            "        index_base, lo, hi, 1, id_limit, BLOCK_N, gl.SliceLayout(1, rope_ld), PAGE_SIZE\n"
            "    )\n"
            "    for t in range(n_tiles):\n",
        ),
    ),
    (
        "        ids, ok, idr, okr = nids, nok, nidr, nokr\n",
        "        ids, ok, idr, okr = ids1, ok1, idr1, okr1\n"
        "        ids1, ok1, idr1, okr1 = nids, nok, nidr, nokr\n",
    ),
]
# Every whole tile by TMA without checking that its 64 cache rows are consecutive (one
# cross-warp reduction of the loader a tile fewer): exact only where they are, as on the
# benchmark's 64-token pages.
# (The check also sends a tile with an id outside the cache to the gather; the benchmark has none.)
_NO_CONSECUTIVE_CHECK: list[Edit] = [
    (_dual_lines("        consecutive = ", "        consecutive = "), "        consecutive = True\n")
]
# QKᵀ as fp8 wgmma reading K straight from the ring (no ldmatrix, no conversion). Each query row
# is scaled by a power of two s (its largest value near 224) and split into four e4m3 parts,
# q·s = p0 + p1 + p2 + p3 (each part the rounding of what the ones before leave): the error is
# below 2**-10 an element, under the fp16 query's own rounding. The parts are stacked as the 64
# rows of the wgmma B operand, so one m64n64 fp8 wgmma a ring box gives all four partial
# scores, summed per row after it; 1/s scales the scores. fp8 wgmma sums with less than fp32
# precision (about 14 bits), so the scores move more than with fp16 MMAs: on the H200
# (2026-12-02) it ran about 3% faster than main at B128 S8192 with an LSE error of 1.05e-3
# against main's 1.9e-6 (docs/history/, "Measured on 2026-12-02").
_QUERY_PARTS_FN = """
@gluon.jit
def _query_fp8_parts(q_nope_smem, q_pe_smem, q8_lat, q8_rope, qs_smem, L: gl.constexpr):
    \"\"\"The fp16 query rows (cache column order) scaled by a power of two each and split into four
    e4m3 parts, part k in rows ``[k·rows, (k+1)·rows)`` of ``q8_lat`` (a ``[4·rows, 128]`` box a
    128 latent columns) and ``q8_rope``; each row's ``1 / scale`` into ``qs_smem``.\"\"\"
    LB: gl.constexpr = L // BOX_COLS
    NR: gl.constexpr = q_nope_smem.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    lay_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    xr = q_pe_smem.load(lay_r).to(gl.float32)
    amax = gl.convert_layout(gl.max(gl.abs(xr), 1), gl.SliceLayout(1, lay))
    for b in gl.static_range(LB):
        x = q_nope_smem.slice(b * BOX_COLS, BOX_COLS, dim=1).load(lay).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(x), 1))
    e = gl.floor(gl.log2(224.0 / gl.where(amax > 0.0, amax, 1.0)))
    scale = gl.exp2(gl.minimum(gl.maximum(e, -30.0), 30.0))
    for b in gl.static_range(LB):
        r = q_nope_smem.slice(b * BOX_COLS, BOX_COLS, dim=1).load(lay).to(gl.float32)
        r = r * gl.expand_dims(scale, 1)
        for k in gl.static_range(4):
            part = r.to(gl.float8e4nv)
            q8_lat.index(b).slice(k * NR, NR, dim=0).store(part)
            r = r - part.to(gl.float32)
    r = xr * gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(1, lay_r)), 1)
    for k in gl.static_range(4):
        part = r.to(gl.float8e4nv)
        q8_rope.slice(k * NR, NR, dim=0).store(part)
        r = r - part.to(gl.float32)
    qs_smem.store(gl.convert_layout(1.0 / scale, gl.BlockedLayout([1], [32], [4], [0])))

"""
_QUERY_IN_PAIRED_ORDER = _dual_lines("    _query_to_smem(\n", "    fence_async_shared()\n")
_QK_FROM_REGISTERS = _dual_lines(
    "        a = _ring_chunk(lat_ring, s * LB, 0).load(a_layout).to(gl.float16)",
    "        sc, a_r = warpgroup_mma_wait(num_outstanding=0, deps=(sc, a_r))",
)
_QK_FP8_RING: list[Edit] = [
    ("\n@gluon.jit\ndef _box_pairs(", _QUERY_PARTS_FN + "\n@gluon.jit\ndef _box_pairs("),
    (
        _QUERY_IN_PAIRED_ORDER,
        _QUERY_IN_PAIRED_ORDER.replace("H, NR, L, R, True,", "H, NR, L, R, False,").replace(
            "    fence_async_shared()\n",
            "    gl.thread_barrier()\n"
            "    q8_lat = gl.allocate_shared_memory(\n"
            "        gl.float8e4nv, [L // BOX_COLS, 4 * NR, BOX_COLS], LAT_BOX_LAYOUT\n"
            "    )\n"
            "    q8_rope = gl.allocate_shared_memory(gl.float8e4nv, [4 * NR, R], ROPE_BOX_LAYOUT)\n"
            "    qs_smem = gl.allocate_shared_memory(\n"
            "        gl.float32, [NR], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])\n"
            "    )\n"
            "    _query_fp8_parts(q_nope_smem, q_pe_smem, q8_lat, q8_rope, qs_smem, L)\n"
            "    fence_async_shared()\n",
        ),
    ),
    (
        # the MMA warpgroups' arguments (the tuple and its unpacking)
        "        q_nope_smem, q_pe_smem, lat_ring, rope_ring, id_ring, p_smem,",
        "        q8_lat, q8_rope, qs_smem, lat_ring, rope_ring, id_ring, p_smem,",
        2,
    ),
    (
        _QK_FROM_REGISTERS,
        """        s4: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 4 * NR, 32]
        )
        acc = gl.zeros([BLOCK_N, 4 * NR], gl.float32, layout=s4)
        for b in gl.static_range(LB):
            k_box = lat_ring.index(s * LB + b)
            acc = warpgroup_mma(k_box, q8_lat.index(b).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(rope_ring.index(s), q8_rope.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        sc = gl.convert_layout(gl.sum(gl.reshape(acc, [BLOCK_N, 4, NR]), 1), st_layout)
        sc = sc * gl.expand_dims(qs_smem.load(rows_layout), 0)
""",
    ),
]
Variants = dict[str, tuple[bool, list[Edit], str]]
"""name -> (exact, edits of the module's source, what the variant does)."""

DUAL_VARIANTS: Variants = {
    "main": (True, [], "the kernel on main"),
    "no-pv": (False, _NO_PV, "no Oᵀ += Vᵀ·Pᵀ (nor its reads of the ring)"),
    "no-dram": (
        False,
        _NO_DRAM,
        "the loader zero-fills the ring (cp.async of masked rows) instead of reading the cache",
    ),
    "no-dram-no-pv": (False, _NO_DRAM + _NO_PV, "both of the above"),
    "online-softmax": (
        True,
        _ONLINE_SOFTMAX,
        "the online softmax of the other kernels (compiler reductions across the warps)",
    ),
    "release-after-last-mma": (
        True,
        _RELEASE_AFTER_LAST_MMA,
        "the slot released after the last box's MMAs are issued (one compiler barrier fewer)",
    ),
    "qk-chunk-128": (True, _QK_CHUNK_128, "QKᵀ in 128-column steps (half the waits)"),
    "release+qk-chunk-128": (
        True,
        _RELEASE_AFTER_LAST_MMA + _QK_CHUNK_128,
        "release-after-last-mma and qk-chunk-128 together",
    ),
    "fixed-row-max": (False, _FIXED_ROW_MAX, "a fixed row max (no row-max exchange)"),
    "no-widen-qk": (False, _NO_WIDEN_QK, "QKᵀ's K tile by byte moves, not conversions (wrong values)"),
    "no-widen-pv": (False, _NO_WIDEN_PV, "PV's V boxes by byte moves, not conversions (wrong values)"),
    "no-widen": (False, _NO_WIDEN_QK + _NO_WIDEN_PV, "both of the above"),
    "pv-int-widen": (True, _PV_INT_WIDEN, "PV's e4m3 widening by integer operations (exact, e4m3 only)"),
    "ids-two-ahead": (True, _IDS_TWO_AHEAD, "the loader reads token ids two tiles ahead, not one"),
    "no-consecutive-check": (
        False,
        _NO_CONSECUTIVE_CHECK,
        "every whole tile by TMA, unchecked (exact on 64-token pages only)",
    ),
    "qk-fp8-ring": (
        True,
        _QK_FP8_RING,
        "QKᵀ as fp8 wgmma on the ring (the query in four e4m3 parts; ~3% faster, LSE error 1e-3)",
    ),
    "pv-half-int-widen": (
        True,
        _PV_HALF_INT_WIDEN,
        "PV's even columns widened by integer operations, the odd ones by cvt (e4m3 only)",
    ),
}

# -- the ping-pong kernel (64 rows, 16-bit caches) ---------------------------------------------

_PP_LATENT_COPY = "(dst, kv_row + (C * CHUNK + cols)[None, :], mask=ok[:, None])"
_PP_ROPE_COPY = "(rope_slot, kv_row + (L + cr)[None, :], mask=ok[:, None])"
_PP_NO_DRAM: list[Edit] = [
    # every row masked: cp.async zero-fills the ring, no cache read
    (_PP_LATENT_COPY, _PP_LATENT_COPY.replace("mask=ok[:, None]", "mask=ok[:, None] & False")),
    (_PP_ROPE_COPY, _PP_ROPE_COPY.replace("mask=ok[:, None]", "mask=ok[:, None] & False")),
]
# The chunk waits stay (they pace the ring); the scores stay zero.
_PP_NO_QK: list[Edit] = [
    # a chunk's MMA, and the rope part's with the last chunk (in _chunk_scores)
    (
        _pingpong_lines("    sc = warpgroup_mma(q_nope_smem.slice(", "        sc = warpgroup_mma(q_pe_smem,"),
        "",
    )
]
# P is still published and rounded; neither P·V (own tile from registers, other tile from
# shared memory) runs.
_PP_NO_PV: list[Edit] = [
    ("    acc = warpgroup_mma(gl.convert_layout(p16, P_LAYOUT), v, acc, is_async=True)\n", ""),
    ("    acc = warpgroup_mma(p_smem, v, acc, is_async=True)\n", ""),
]

PINGPONG_VARIANTS: Variants = {
    "main": (True, [], "the kernel on main"),
    "no-dram": (False, _PP_NO_DRAM, "the loader zero-fills the ring instead of reading the cache"),
    "no-qk": (False, _PP_NO_QK, "no S = q·Kᵀ (the chunk waits stay)"),
    "no-pv": (False, _PP_NO_PV, "no P·V"),
    "no-dram-no-pv": (False, _PP_NO_DRAM + _PP_NO_PV, "both"),
}


@attrs.frozen
class Kernel:
    """A Gluon decode kernel the script can vary: its module, its name there (and in the
    launcher's module), its variants, default shapes, cache dtype and compile options."""

    module: ModuleType
    name: str
    variants: Variants
    shapes: tuple[str, ...]
    kv: str
    compile_options: dict[str, bool]
    files: dict[str, Path] = attrs.field(factory=dict)
    """Variants that are whole files (``--file``): a copy of the kernel's module with changes."""


# -- the few-rows kernel (16 or 32 rows, one warpgroup; 16-bit caches here) ---------------------

# Every tile's ids and rows past ``hi`` as far as the loads know: cp.async zero-fills the ring,
# nothing is read from the cache (the softmax still masks by the real ``hi``).
_ROWS_NO_DRAM: list[Edit] = [
    # the ids of the first tiles and those tiles, before the loop; the later tiles and their ids,
    # by the refill in the 16-bit path of the loop (the ids then zero-filled: id 0 for the key
    # check, inside the cache)
    ("_issue_ids(index_base, idx_ring, j, lo, hi,", "_issue_ids(index_base, idx_ring, j, lo, lo,"),
    ("kv_ptr, idx_ring, st, lo, hi, id_limit,", "kv_ptr, idx_ring, st, lo, lo, id_limit,"),
    (
        "kv_ptr, idx_ring, index_base, t, lo, hi, id_limit,",
        "kv_ptr, idx_ring, index_base, t, lo, lo, id_limit,",
    ),
]
_ROWS_SOFTMAX = _rows_lines(
    "        p, alpha, m_i, l_i = _online_softmax(", "        acc = acc * alpha[None, :]"
)
"""The few-rows kernel's online softmax step and its rescale of the output."""
_ROWS_EPILOGUE = "    # -- epilogue ----"
# Every row's max taken as 8 (log2 domain): no cross-warp row max (the row sum's stays). Exact
# only while no score exceeds it.
_ROWS_FIXED_ROW_MAX: list[Edit] = [
    (
        _ROWS_SOFTMAX,
        # the masks of _online_softmax (keys past the rows' limit, ids outside the cache)
        """        visible = gl.expand_dims(n, 1) < gl.expand_dims(limit, 0)
        if key_ok is not None:
            visible = visible & gl.expand_dims(key_ok, 1)
        p = gl.exp2(gl.where(visible, sc * qk_scale, float("-inf")) - 8.0)
        l_i = l_i + gl.sum(p, 0)
""",
    ),
    (
        _ROWS_EPILOGUE,
        "    m_i = gl.full([NR], 8.0, gl.float32, layout=gl.SliceLayout(0, st_layout))\n" + _ROWS_EPILOGUE,
    ),
]
# L2 prefetch two tiles ahead of the tile being computed (the ring's own cp.async covers one):
# the ids of tile t + 2 + 1 are loaded into registers one tile before their prefetch.
_ROWS_PREFETCH_HELPERS = """

@gluon.jit
def _l2_prefetch_tile(kv_ptr, first, last, stride_kv, ROWS: gl.constexpr, ROW_BYTES: gl.constexpr):
    if last == first + ROWS - 1:  # consecutive rows: one bulk prefetch of the whole tile, by thread 0
        addr = (kv_ptr + first.to(gl.int64) * stride_kv).to(gl.int64, bitcast=True)
        span = (ROWS - 1) * stride_kv * (kv_ptr.dtype.element_ty.primitive_bitwidth // 8) + ROW_BYTES
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;\\n"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2;\\nmov.b32 $0, 0; }",
            "=r,l,r", [addr, span], dtype=gl.int32, is_pure=False, pack=1,
        )


@gluon.jit
def _l2_prefetch_lines(kv_ptr, ids, valid, stride_kv, LINES: gl.constexpr, LAYOUT: gl.constexpr):
    line = gl.arange(0, 16, layout=gl.SliceLayout(0, LAYOUT))
    base = (kv_ptr + ids.to(gl.int64) * stride_kv).to(gl.int64, bitcast=True)
    addr = base[:, None] + (line * 128).to(gl.int64)[None, :]
    ok = valid[:, None] & (line < LINES)[None, :]
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0;\\n@p prefetch.global.L2 [$1];\\nmov.b32 $0, 0; }",
        "=r,l,r", [addr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1,
    )


@gluon.jit(do_not_specialize=["num_splits"])"""
_ROWS_KERNEL_DEF = '\n\n@gluon.jit(do_not_specialize=["num_splits"])'
_ROWS_LOOP = """    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    for t in range(n_tiles):"""
_ROWS_TAKE = _rows_lines("            k_lat, k_rope = _take_tile(", "            )  # fmt: skip")
"""The 16-bit path's take of tile ``t`` (refill, wait, MMA operands)."""


def _rows_prefetch(setup: str, per_tile: str) -> list[Edit]:
    """The few-rows kernel with :data:`_ROWS_PREFETCH_HELPERS`, ``setup`` before its tile loop
    and ``per_tile`` after each 16-bit tile is taken. The prefetches read the tiles' ids as flat
    token ids (the probe's launches: no block table)."""
    return [
        (_ROWS_KERNEL_DEF, _ROWS_PREFETCH_HELPERS),
        (_ROWS_LOOP, _ROWS_LOOP.replace("    for t", setup + "    for t")),
        (_ROWS_TAKE, _ROWS_TAKE + per_tile),
    ]


_ROWS_PREFETCH_TILE = _rows_prefetch(
    """    gl.static_assert(PAGE_SIZE == 0, "the prefetch reads flat token ids")
    ROW_BYTES: gl.constexpr = (L + R) * kv_dtype.primitive_bitwidth // 8
    pf0 = lo + 2 * BLOCK_N
    pf_first = gl.load(index_base + pf0, mask=pf0 < hi, other=0)
    pf_last = gl.load(index_base + pf0 + BLOCK_N - 1, mask=pf0 + BLOCK_N - 1 < hi, other=-1)
""",
    """            _l2_prefetch_tile(kv_ptr, pf_first, pf_last, stride_kv, BLOCK_N, ROW_BYTES)
            pf0 = lo + (t + 3) * BLOCK_N
            pf_first = gl.load(index_base + pf0, mask=pf0 < hi, other=0)
            pf_last = gl.load(index_base + pf0 + BLOCK_N - 1, mask=pf0 + BLOCK_N - 1 < hi, other=-1)
""",
)
_ROWS_PREFETCH_LINES = _rows_prefetch(
    """    gl.static_assert(PAGE_SIZE == 0, "the prefetch reads flat token ids")
    LINES: gl.constexpr = ((L + R) * kv_dtype.primitive_bitwidth // 8 + 127) // 128
    pf_layout: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])
    offs_pf = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pf_layout))
    pf_n = lo + 2 * BLOCK_N + offs_pf
    pf_ids = gl.load(index_base + pf_n, mask=pf_n < hi, other=0)
""",
    """            pf_n = lo + (t + 2) * BLOCK_N + offs_pf
            _l2_prefetch_lines(kv_ptr, pf_ids, pf_n < hi, stride_kv, LINES, pf_layout)
            pf_n = pf_n + BLOCK_N
            pf_ids = gl.load(index_base + pf_n, mask=pf_n < hi, other=0)
""",
)
ROWS_VARIANTS: Variants = {
    "main": (True, [], "the kernel on main"),
    "no-dram": (False, _ROWS_NO_DRAM, "the ring zero-filled by masked cp.async, no cache read"),
    "fixed-row-max": (False, _ROWS_FIXED_ROW_MAX, "a fixed row max (no cross-warp row max)"),
    "l2-prefetch-tile": (
        True,
        _ROWS_PREFETCH_TILE,
        "16-bit ring: L2 asked for tile t+2 at tile t (one bulk prefetch of consecutive rows)",
    ),
    "l2-prefetch-lines": (
        True,
        _ROWS_PREFETCH_LINES,
        "16-bit ring: L2 asked for tile t+2 at tile t (prefetch.global.L2 per 128-byte line)",
    ),
}

KERNELS = {
    "dual": Kernel(
        dual_on_main, "mla_decode_dual_kernel", DUAL_VARIANTS, ("H16q1B128S8192", "H16q1B64S4096"), "fp8",
        {"fp8": True, "dual": True},
    ),
    "pingpong": Kernel(
        pingpong_on_main, "mla_decode_pingpong_kernel", PINGPONG_VARIANTS,
        ("H16q4B64S4096", "H128q1B64S4096"), "bf16", {"fp8": False, "pingpong": True},
    ),
    "rows": Kernel(
        rows_on_main, "mla_decode_rows_kernel", ROWS_VARIANTS, ("H16q1B1S65536", "H16q1B64S4096"), "bf16",
        {"fp8": False, "rows": 16},
    ),
}  # fmt: skip


def variant_source(kernel: Kernel, name: str) -> str:
    """The kernel module's source with variant ``name``'s edits; each edited text must occur as
    many times as its edit says (once unless it says otherwise)."""
    if name in kernel.files:
        return kernel.files[name].read_text()
    path = Path(kernel.module.__file__ or "")
    source = path.read_text()
    for old, new, *times in kernel.variants[name][1]:
        expected = times[0] if times else 1
        count = source.count(old)
        if count != expected:
            raise ValueError(
                f"variant {name!r}: an edit's text occurs {count} times in {path.name} "
                f"(expected {expected}):\n{old}"
            )
        source = source.replace(old, new)
    return source


def load_variant(kernel: Kernel, name: str, workdir: str) -> Any:
    """Variant ``name``'s kernel (its module is a file under ``workdir``: Gluon reads a kernel's
    source)."""
    stem = f"{kernel.name}_{name}".replace("-", "_").replace("+", "_").replace(":", "_")
    path = os.path.join(workdir, f"{stem}.py")
    Path(path).write_text(variant_source(kernel, name))
    spec = importlib.util.spec_from_file_location(f"whatif_{stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.name)


MAX_SHARED_BYTES = 227 * 1024
"""Shared memory one block may use on an H100/H200."""


def compile_variant(kernel: Kernel, name: str, workdir: str) -> Any:
    """Variant ``name`` compiled for sm_90 on this machine (no GPU needed): Triton's compiled
    kernel, with its metadata and cubin."""
    from probes import gluon_compile

    on_main = getattr(gluon_compile, kernel.name)
    setattr(gluon_compile, kernel.name, load_variant(kernel, name, workdir))
    try:
        return gluon_compile.compile_variant(block_n=64, stages=2, **kernel.compile_options)
    finally:
        setattr(gluon_compile, kernel.name, on_main)


def compile_only(kernel: Kernel, names: list[str]) -> None:
    """Compile every variant for sm_90 on this machine (no GPU): shared memory, HGMMA, STSM and
    spill-store counts. A variant over :data:`MAX_SHARED_BYTES` is an error."""
    from probes import gluon_compile

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            compiled = compile_variant(kernel, name, workdir)
            if compiled.metadata.shared > MAX_SHARED_BYTES:
                raise ValueError(
                    f"variant {name!r} takes {compiled.metadata.shared} B of shared memory; an "
                    f"H100/H200 block may use {MAX_SHARED_BYTES}"
                )
            counts = gluon_compile.instruction_counts(
                gluon_compile.sass_of(compiled), ("HGMMA", "STSM", "STL")
            )
            rows.append(
                {
                    "variant": name,
                    "shared B": compiled.metadata.shared,
                    "HGMMA": counts["HGMMA"],
                    "STSM": counts["STSM"],
                    "spill stores": counts["STL"],
                }
            )
    print_table(rows, title=f"{kernel.name} what-if variants, compiled for sm_90")


def parse_shape(label: str) -> tuple[int, int, int, int]:
    """``H16q4B64S4096`` -> (heads, qlen, batch, sequence length)."""
    m = re.fullmatch(r"H(\d+)q(\d+)B(\d+)S(\d+)", label)
    if m is None:
        raise ValueError(
            f"shape {label!r}: write it as H<heads>q<qlen>B<batch>S<seqlen>, e.g. H16q1B128S8192"
        )
    heads, qlen, batch, seq = (int(g) for g in m.groups())
    return heads, qlen, batch, seq


def run(
    kernel: Kernel, names: list[str], shapes: list[str], *, repeat: int = 1, with_kernel_times: bool = True
) -> None:
    """Time ``names`` on each of ``shapes``: ``main`` first and last, the whole order ``repeat``
    times in one process (the spread between rounds is the noise to judge a variant against), each
    variant's result checked against the reference before it is timed."""
    import torch

    from benchmarks._common import bench_graph_us
    from benchmarks.decode import Problem, Shape
    from mla.providers.gluon import decode as gluon_decode
    from mla.providers.gluon.planner import launch_config
    from mla.providers.triton.decode import num_sms
    from probes.gluon_dev import kernel_times

    device = torch.device("cuda")
    on_main = getattr(gluon_decode, kernel.name)
    rows: list[dict[str, Any]] = []
    order = ["main", *[n for n in names if n != "main"]] * repeat + ["main"]
    with tempfile.TemporaryDirectory() as workdir:
        kernels = {name: load_variant(kernel, name, workdir) for name in set(order)}
        for label in shapes:
            heads, qlen, batch, seq = parse_shape(label)
            problem = Problem(Shape("whatif", heads, qlen, batch, seq, kv=kernel.kv), device)
            config = launch_config(
                batch=batch, rows=heads * qlen, max_seqlen_k=seq, num_sms=num_sms(device), persistent=False,
                kv_fp8=kernel.kv == "fp8",
            )  # fmt: skip
            for name in order:
                setattr(gluon_decode, kernel.name, kernels[name])

                def step(p: Any = problem, c: Any = config) -> None:
                    gluon_decode.paged_decode(p.paged_call(), config=c)

                try:
                    o_err, lse_err = problem.check(step)
                    us = bench_graph_us(step)
                    times = kernel_times(step) if with_kernel_times else {}
                    parts = " ".join(f"{k}={v:.1f}" for k, v in times.items())
                except Exception as exc:  # a variant that fails to compile or run
                    o_err, lse_err, us, parts = (
                        math.inf,
                        math.inf,
                        math.nan,
                        f"{type(exc).__name__}: {exc}"[:200],
                    )
                finally:
                    setattr(gluon_decode, kernel.name, on_main)
                rows.append(
                    {"shape": f"{label} k{config.num_splits}", "variant": name,
                     "exact": kernel.variants[name][0], "o err": o_err, "lse err": lse_err, "graph us": us,
                     "kernels us": parts}
                )  # fmt: skip
                print(rows[-1], flush=True)
            del problem
            torch.cuda.empty_cache()
    print_table(rows, title=f"{kernel.name} what-if variants ({kernel.kv} cache, graph replay)")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--kernel", choices=list(KERNELS), default="dual")
    ap.add_argument("--variants", nargs="*", help="default: all of the kernel's")
    ap.add_argument("--shapes", nargs="*", help="H<heads>q<qlen>B<batch>S<seqlen>; default: the kernel's")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the variants in one process")
    ap.add_argument(
        "--no-kernel-times", action="store_true", help="graph replay only (no profiler in the process)"
    )
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--compile-only", action="store_true", help="compile the variants for sm_90 (no GPU)")
    ap.add_argument(
        "--file", nargs="*", default=[], type=Path,
        help="a copy of the kernel's module with changes, timed as variant 'file:<stem>'",
    )  # fmt: skip
    args = ap.parse_args()
    kernel = KERNELS[args.kernel]
    files = {f"file:{path.stem}": path for path in args.file}
    kernel = attrs.evolve(
        kernel,
        files=files,
        variants={**kernel.variants, **{n: (True, [], f"the kernel of {p}") for n, p in files.items()}},
    )
    names = args.variants or list(kernel.variants)
    unknown = sorted(set(names) - set(kernel.variants))
    if unknown:
        ap.error(f"--variants: {unknown} are not variants of {args.kernel} ({', '.join(kernel.variants)})")
    if args.list:
        print_table([{"variant": n, "exact": v[0], "what": v[2]} for n, v in kernel.variants.items()])
        return
    for name in names:  # every edit applies before anything runs
        variant_source(kernel, name)
    if args.compile_only:
        compile_only(kernel, names)
        return
    if args.repeat < 1:
        ap.error(f"--repeat: {args.repeat} rounds; give 1 or more")
    run(
        kernel, names, args.shapes or list(kernel.shapes), repeat=args.repeat,
        with_kernel_times=not args.no_kernel_times,
    )  # fmt: skip


if __name__ == "__main__":
    main()
