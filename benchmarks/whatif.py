"""What bounds a Gluon decode kernel: time it with one piece of its work taken out.

    python benchmarks/whatif.py [--kernel dual|pingpong] [--variants main ...] [--shapes ...]
    python benchmarks/whatif.py --kernel pingpong --list   # the variants, no GPU needed
    python benchmarks/whatif.py --compile-only             # compile every variant for sm_90, no GPU

Each variant is the source of the kernel's module (``mla/providers/gluon/dual.py``, the
dual-chain fp8 kernel, or ``pingpong.py``, the 64-row kernel of 16-bit caches) with a few
textual edits (:data:`KERNELS`), written to a temporary module and launched by the provider's
own launcher (``mla.providers.gluon.decode``) in place of the kernel on ``main``. An edit whose
text no longer occurs exactly once in the module raises, so a variant never silently times the
unchanged kernel.

Variants that drop work compute wrong outputs on purpose (their ``o err`` column shows it): they
bound what removing that work could gain, they are not candidates. The others (``exact``
in the table) are candidates: they must match the reference like ``main``. Every variant is
timed as CUDA-graph replays of the whole decode call (and per kernel with the torch profiler) on
the kernel's shapes of ``benchmarks/decode.py`` (``H16q1B128S8192``: heads, qlen, batch,
sequence length); ``main`` runs first and last to show the run-to-run spread. Results:
``docs/performance.md``, "The dual-chain fp8 kernel".
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table

import mla.providers.gluon.dual as dual_on_main
import mla.providers.gluon.pingpong as pingpong_on_main

Edit = tuple[str, str] | tuple[str, str, int]
"""``(old, new)``: replace the one occurrence of ``old``; ``(old, new, n)``: its ``n`` occurrences."""

_V_STORE_0 = """        v_w.slice(0, QK_CHUNK, dim=1).store(a)
"""
_V_STORE_C = """            v_w.slice(c * QK_CHUNK, QK_CHUNK, dim=1).store(a)
"""
_PV = """        acc = warpgroup_mma(v_w.permute((1, 0)), p_w, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
"""
_NO_V_STORE: list[Edit] = [(_V_STORE_0, ""), (_V_STORE_C, "")]
# P still feeds the output (its column sums), so nothing upstream of PV becomes dead code; that
# adds one cross-warp reduction a tile, which fixed-row-max bounds.
_NO_PV: list[Edit] = [(_PV, "        acc = acc + gl.sum(p, 0)[None, :]\n")]

_SOFTMAX_CALL = """        p, alpha, m_i, l_i = _online_softmax(
            sc, m_i, l_i, t * BLOCK_N + lo + offs_n, hi, row_limit, qk_scale, 0
        )
"""
"""The MMA warpgroup's softmax step, which the softmax variants replace."""
_KEYS_VISIBLE = """        keys = gl.expand_dims(t * BLOCK_N + lo + offs_n, 1)
        visible = (keys < hi) & (keys < gl.expand_dims(row_limit, 0))
"""
"""The first lines of :func:`.kernels._online_softmax`, spelled out where a variant replaces it."""
_AFTER_LOOP = "    # Warpgroup 1 hands its output"
"""The MMA warpgroup's first line after its loop."""


def _after_loop(code: str) -> Edit:
    """An edit that puts ``code`` right after the MMA warpgroup's loop."""
    return (_AFTER_LOOP, code + _AFTER_LOOP)


_L_PART: Edit = (
    """    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
""",
    """    s_zero = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
    l_part = gl.zeros([BLOCK_N, NR], gl.float32, layout=st_layout)
""",
)
"""Per-thread partial row sums, ``[keys, rows]`` like the scores."""

_GATHER = "_gather_tile(kv_ptr, ids, ok, idr, okr, stride_kv, lat_ring, rope_ring, landed, w, L, R)"
_NO_DRAM: list[Edit] = [
    # every tile by the gather, every row masked: cp.async zero-fills the ring, no cache read
    ("        if consecutive & (lo + (t + 1) * BLOCK_N <= hi):", "        if False:"),
    (_GATHER, _GATHER.replace("ok, idr, okr,", "ok & False, idr, okr & False,")),
]

# PV of tile t stays in flight until the next tile of the warpgroup has its first K chunk in
# registers (the wait moves before the first V store, which overwrites the tile PV reads). An
# in-flight accumulator cannot enter the loop as a plain tensor, so a first PV of zeros (V and P
# zero-filled, exact) starts it in flight.
_PV_DEFERRED: list[Edit] = [
    (
        """    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    for t in range(W, n_tiles, 2):
""",
        """    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    for c in gl.static_range(L // QK_CHUNK):
        v_w.slice(c * QK_CHUNK, QK_CHUNK, dim=1).store(gl.zeros([BLOCK_N, QK_CHUNK], gl.float16, zero_layout))
    p_w.store(gl.zeros([BLOCK_N, NR], gl.float16, zero_layout))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(v_w.permute((1, 0)), p_w, acc, is_async=True)
    for t in range(W, n_tiles, 2):
""",
    ),
    (
        _V_STORE_0,
        """        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
"""
        + _V_STORE_0,
    ),
    (
        _PV,
        """        acc = warpgroup_mma(v_w.permute((1, 0)), p_w, acc, is_async=True)
""",
    ),
    _after_loop("    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n"),
]

# Each thread keeps its own partial row sums ([keys, rows], like the scores) and the rows are
# summed across the warps once, after the loop: one cross-warp reduction per tile instead of two.
_ROW_SUM_DEFERRED: list[Edit] = [
    _L_PART,
    (
        _SOFTMAX_CALL,
        _KEYS_VISIBLE
        + """        sc = gl.where(visible, sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - gl.expand_dims(m_use, 0))
        m_i = m_new
        l_part = l_part * gl.expand_dims(alpha, 0) + p
""",
    ),
    _after_loop("    l_i = gl.sum(l_part, 0)\n"),
]

# Every row's max taken as 8 (log2 domain) for the whole request: no cross-warp reduction in
# the loop (the row sums as in row-sum-deferred). Exact only while no score exceeds it.
_FIXED_ROW_MAX: list[Edit] = [
    _L_PART,
    (
        _SOFTMAX_CALL,
        _KEYS_VISIBLE
        + """        p = gl.exp2(gl.where(visible, sc * qk_scale, float("-inf")) - 8.0)
        alpha = gl.full([NR], 1.0, gl.float32, layout=rows_layout)
        l_part = l_part + p
""",
    ),
    _after_loop(
        "    l_i = gl.sum(l_part, 0)\n    m_i = gl.full([NR], 8.0, gl.float32, layout=rows_layout)\n"
    ),
]

# Two QKᵀ chunks in flight instead of one (the wait before the next chunk's read lets two
# register operands stay live).
_QK_DEPTH_2: list[Edit] = [
    (
        "sc, a = warpgroup_mma_wait(num_outstanding=1, deps=(sc, a))",
        "sc, a = warpgroup_mma_wait(num_outstanding=2, deps=(sc, a))",
    )
]

# The softmax's two cross-warp reductions a tile (row max, row sum) each with one barrier of the
# warpgroup instead of the compiler's two: every warp stores its rows' partial max (then sum) in
# a slot of its own, one barrier, every thread reads the four slots. One buffer each suffices:
# a buffer is written again only after the other reduction's barrier, which every warp passes
# after its reads of it.
_ONE_BARRIER_REDUCTIONS: list[Edit] = [
    (
        """    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, NR], p_layout)
""",
        """    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, NR], p_layout)
    red_smem = gl.allocate_shared_memory(
        gl.float32, [2 * 2 * 4 * NR], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    )
""",
    ),
    # the buffer joins the MMA warpgroups' argument tuple (built and unpacked: two occurrences)
    ("v_wide, p_smem, merge_ptr,", "v_wide, p_smem, red_smem, merge_ptr,", 2),
    (
        _SOFTMAX_CALL,
        _KEYS_VISIBLE
        + """        sc = gl.where(visible, sc * qk_scale, float("-inf"))
        # red_smem: [warpgroup, max | sum, warp, row] floats; each warp writes its own slot
        red_rows = red_smem.reshape([2 * 2 * 4, NR])
        red_rows.slice(W * 8, 4, dim=0).store(gl.max(gl.reshape(sc, [4, BLOCK_N // 4, NR]), 1))
        gl.thread_barrier()
        r0, r1, r2, r3 = _red_slots(red_smem, W, 0, NR, rows_layout)
        m_new = gl.maximum(gl.maximum(m_i, gl.maximum(r0, r1)), gl.maximum(r2, r3))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - gl.expand_dims(m_use, 0))
        m_i = m_new
        red_rows.slice(W * 8 + 4, 4, dim=0).store(gl.sum(gl.reshape(p, [4, BLOCK_N // 4, NR]), 1))
        gl.thread_barrier()
        r0, r1, r2, r3 = _red_slots(red_smem, W, 1, NR, rows_layout)
        l_i = l_i * alpha + ((r0 + r1) + (r2 + r3))
""",
    ),
]

_ONE_BARRIER_REDUCTIONS.append(
    (
        """@gluon.jit
def _tile_ids(""",
        """@gluon.jit
def _red_slots(red_smem, W: gl.constexpr, K: gl.constexpr, NR: gl.constexpr, layout: gl.constexpr):
    base: gl.constexpr = (W * 2 + K) * 4 * NR
    return (
        red_smem.slice(base, NR).load(layout),
        red_smem.slice(base + NR, NR).load(layout),
        red_smem.slice(base + 2 * NR, NR).load(layout),
        red_smem.slice(base + 3 * NR, NR).load(layout),
    )


@gluon.jit
def _tile_ids(""",
    )
)

Variants = dict[str, tuple[bool, list[Edit], str]]
"""name -> (exact, edits of the module's source, what the variant does)."""

# The loader, not the MMA warpgroups, widens each tile's latent part into the fp16 V tile (in
# the natural column order; the output store then undoes no permutation): a second read of the
# fp8 ring, off the warpgroups' chains. vbar[w]: warpgroup w's PV of its last tile is done (the
# V tile is free); vbar[2 + w]: the loader has written warpgroup w's next V tile.
_LOADER_WIDENS_V: list[Edit] = [
    *_NO_V_STORE,
    (
        """    merged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
""",
        """    merged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(vbar.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.arrive(vbar.index(i))
""",
    ),
    (
        "                    rope_ring, landed, free, L, R, BLOCK_N,\n",
        "                    rope_ring, landed, free, v_wide, vbar, L, R, BLOCK_N,\n",
    ),
    (
        """    kv_ptr, lat_desc, rope_desc, index_base, lo, hi, stride_kv, lat_ring, rope_ring, landed, free,
    L: gl.constexpr,""",
        """    kv_ptr, lat_desc, rope_desc, index_base, lo, hi, stride_kv, lat_ring, rope_ring, landed, free,
    v_wide, vbar, L: gl.constexpr,""",
    ),
    (
        """        ids, ok, idr, okr = nids, nok, nidr, nokr
""",
        """        ids, ok, idr, okr = nids, nok, nidr, nokr
        if t > 0:
            _widen_v(lat_ring, v_wide, landed, vbar, t - 1, L)
    if n_tiles > 0:
        _widen_v(lat_ring, v_wide, landed, vbar, n_tiles - 1, L)
""",
    ),
    (
        """@gluon.jit
def _loader(""",
        """@gluon.jit
def _widen_v(lat_ring, v_wide, landed, vbar, t, L: gl.constexpr):
    w = t % 2
    phase = (t // 2) & 1
    LB: gl.constexpr = L // BOX_COLS
    HALF: gl.constexpr = BOX_COLS // 2
    ld: gl.constexpr = _box_copy_layout(HALF)
    mbarrier.wait(landed.index(w), phase)
    mbarrier.wait(vbar.index(w), phase)
    v_w = v_wide.index(w)
    for b in gl.static_range(LB):
        box = _row_swizzled(lat_ring.index(w * LB + b))
        for h in gl.static_range(2):
            x = box.slice(h * HALF, HALF, dim=1).load(ld)
            v_w.slice(b * BOX_COLS + h * HALF, HALF, dim=1).store(x.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(vbar.index(2 + w))


@gluon.jit
def _loader(""",
    ),
    ("merge_ptr, landed, free, merged,", "merge_ptr, landed, free, merged, vbar,", 2),
    (
        _PV,
        """        mbarrier.wait(vbar.index(2 + W), (t // 2) & 1)
"""
        + _PV
        + """        gl.thread_barrier()
        mbarrier.arrive(vbar.index(W))
""",
    ),
    ("            st_layout, True,\n", "            st_layout, False,\n"),
]

DUAL_VARIANTS: Variants = {
    "main": (True, [], "the kernel on main"),
    "no-v-store": (False, _NO_V_STORE, "the widened K chunks are not stored as the fp16 V tile"),
    "no-pv": (False, _NO_PV, "no Oᵀ += Vᵀ·Pᵀ"),
    "no-v-path": (False, _NO_V_STORE + _NO_PV, "neither the V store nor PV"),
    "no-dram": (
        False,
        _NO_DRAM,
        "the loader zero-fills the ring (cp.async of masked rows) instead of reading the cache",
    ),
    "no-dram-no-v-path": (False, _NO_DRAM + _NO_V_STORE + _NO_PV, "both of the above"),
    "pv-deferred": (
        True,
        _PV_DEFERRED,
        "PV of a tile in flight until the warpgroup's next tile is in registers",
    ),
    "no-dram-pv-deferred": (False, _NO_DRAM + _PV_DEFERRED, "no-dram with pv-deferred"),
    "row-sum-deferred": (
        True,
        _ROW_SUM_DEFERRED,
        "per-thread row sums, reduced across warps once at the end",
    ),
    "qk-depth-2": (True, _QK_DEPTH_2, "two QKᵀ chunks in flight instead of one"),
    "one-barrier-reductions": (
        True,
        _ONE_BARRIER_REDUCTIONS,
        "the softmax's cross-warp reductions with one barrier each",
    ),
    "pv-deferred+one-barrier": (
        True,
        _PV_DEFERRED + _ONE_BARRIER_REDUCTIONS,
        "pv-deferred and one-barrier-reductions together",
    ),
    "loader-widens-v": (
        True,
        _LOADER_WIDENS_V,
        "the loader widens the V tile (the MMA warpgroups store none)",
    ),
    "loader-widens-v+one-barrier": (
        True,
        _LOADER_WIDENS_V + _ONE_BARRIER_REDUCTIONS,
        "loader-widens-v and one-barrier-reductions together",
    ),
    "fixed-row-max": (False, _FIXED_ROW_MAX, "a fixed row max (no cross-warp reduction in the loop)"),
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
    (
        "    sc = warpgroup_mma(q_nope_smem.slice(C * CHUNK, CHUNK, dim=1), k, sc, use_acc=USE_ACC, "
        "is_async=True)\n    if C == CHUNKS - 1:\n"
        "        sc = warpgroup_mma(q_pe_smem, rope.permute((1, 0)), sc, is_async=True)\n",
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


KERNELS = {
    "dual": Kernel(
        dual_on_main, "mla_decode_dual_kernel", DUAL_VARIANTS, ("H16q1B128S8192", "H16q1B64S4096"), "fp8",
        {"fp8": True, "dual": True},
    ),
    "pingpong": Kernel(
        pingpong_on_main, "mla_decode_pingpong_kernel", PINGPONG_VARIANTS,
        ("H16q4B64S4096", "H128q1B64S4096"), "bf16", {"fp8": False, "pingpong": True},
    ),
}  # fmt: skip


def variant_source(kernel: Kernel, name: str) -> str:
    """The kernel module's source with variant ``name``'s edits; each edited text must occur as
    many times as its edit says (once unless it says otherwise)."""
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
    stem = f"{kernel.name}_{name}".replace("-", "_").replace("+", "_")
    path = os.path.join(workdir, f"{stem}.py")
    Path(path).write_text(variant_source(kernel, name))
    spec = importlib.util.spec_from_file_location(f"whatif_{stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.name)


def compile_only(kernel: Kernel, names: list[str]) -> None:
    """Compile every variant for sm_90 on this machine (no GPU): shared memory, HGMMA, STSM and
    spill-store counts."""
    import gluon_compile

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            setattr(gluon_compile, kernel.name, load_variant(kernel, name, workdir))
            compiled = gluon_compile.compile_variant(block_n=64, stages=2, **kernel.compile_options)
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


def run(kernel: Kernel, names: list[str], shapes: list[str]) -> None:
    import torch
    from _common import bench_graph_us
    from decode import Problem, Shape
    from gluon_dev import kernel_times

    from mla.providers.gluon import decode as gluon_decode
    from mla.providers.gluon.planner import launch_config
    from mla.providers.triton.decode import num_sms

    device = torch.device("cuda")
    on_main = getattr(gluon_decode, kernel.name)
    rows: list[dict[str, Any]] = []
    order = ["main", *[n for n in names if n != "main"], "main"]
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
                    parts = " ".join(f"{k}={v:.1f}" for k, v in kernel_times(step).items())
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
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--compile-only", action="store_true", help="compile the variants for sm_90 (no GPU)")
    args = ap.parse_args()
    kernel = KERNELS[args.kernel]
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
    run(kernel, names, args.shapes or list(kernel.shapes))


if __name__ == "__main__":
    main()
