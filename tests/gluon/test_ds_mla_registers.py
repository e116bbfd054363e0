"""The ``fp8_ds_mla`` kernel's registers, spills and shared memory, from Triton's sm_90 compile on
the CPU.

:mod:`mla.providers.gluon.ds_mla_rows` splits a program into a producer partition (gathers and
dequantizes) and one MMA warpgroup, each at a register budget set with ``setmaxnreg``. This test
compiles the launches the planner picks for the sparse attention's 16 heads (and the 32-row and
overlapped variants a launch may name) for sm_90 without a GPU (:mod:`mla.testing.triton_driver`)
and reads the cubin with the ``cuobjdump`` Triton ships: no stack (no spills in either
partition), the MMA warpgroup's ``setmaxnreg`` budget in the SASS, and the shared memory within
the 227 KB a block gets, close to what :func:`~mla.providers.gluon.ds_mla_rows.shared_bytes`
counts.
"""

from __future__ import annotations

import glob
import json
import pathlib
import re
import textwrap

import pytest
from sm90_compile import Compiled, compile_cases, mma_loops, resource_usage, sass_of, wgmma_register_hazards

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

MAX_SHARED = 232448
"""Shared memory an H100/H200 block may take (227 KB)."""
COMPILER_SHARED = 1024
"""Bytes the compiler may add to the kernel's own buffers (its reduction scratch and the
partitions' state)."""

SCRIPT = textwrap.dedent(
    """
    import sys, attrs, torch
    from mla.providers.calls import SparseAttentionCall
    from mla.providers.gluon.decode import sparse_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.testing.triton_driver import stand_in_driver

    RANK, ROPE = 512, 64
    heads, overlap = int(sys.argv[1]), sys.argv[2] == "overlap"
    rows = 256  # the sparse benchmark's B128 q2: one qlen-1 request per row
    config = launch_config(
        batch=rows, rows=heads, max_seqlen_k=2048, num_sms=132, persistent=False, kv_fp8=True,
        ds_mla=True)
    config = attrs.evolve(config, kernel=GluonKernel.DS_MLA, overlap=overlap)
    call = SparseAttentionCall(
        q=torch.zeros(rows, heads, RANK + ROPE, dtype=torch.bfloat16),
        kv_cache=torch.zeros(4096, 656, dtype=torch.uint8),
        slots=torch.zeros(rows, 2048, dtype=torch.int32),
        out=torch.zeros(rows, heads, RANK, dtype=torch.bfloat16), lse=torch.zeros(rows, heads),
        kv_lora_rank=RANK, rope_dim=ROPE, softmax_scale=0.07, kv_scale=None)
    with stand_in_driver(compile_kernels=True):
        sparse_decode(call, config=config)
    print(config)
    """
)


CASES = [(16, False), (16, True), (32, True)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    """Every launch compiled, in one process (one import of torch and Triton)."""
    cases = {
        f"{heads}-{overlap}": [str(heads), "overlap" if overlap else "serial"] for heads, overlap in CASES
    }
    return compile_cases(SCRIPT, cases, tmp_path_factory.mktemp("ds-mla"))


@pytest.mark.heavy
@pytest.mark.parametrize(("heads", "overlap"), CASES)
def test_ds_mla_kernel_has_no_spills_and_fits(
    heads: int, overlap: bool, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    from mla.providers.gluon import ds_mla_rows

    case = compiled[f"{heads}-{overlap}"]
    config = case.stdout().strip().splitlines()[-1]
    (cubin,) = glob.glob(f"{case.cache_dir}/*/mla_decode_ds_mla_kernel.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack == 0, f"{config}: {usage.strip()}"
    sass = sass_of(cubin, cuobjdump)
    # (no register of a wgmma read or written while it is in flight)
    assert wgmma_register_hazards(sass) == [], config
    assert "LDL" not in sass, config
    assert "STL" not in sass, config
    regs = ds_mla_rows.MMA_REGS if heads == 16 else ds_mla_rows.MMA_REGS_32
    # The MMA warpgroup asks for its budget (the producer gets the rest of the register file).
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, {regs:#x}\b", sass), config
    shared = json.loads(pathlib.Path(cubin).with_suffix(".json").read_text())["shared"]
    own = ds_mla_rows.shared_bytes(heads, ds_mla_rows.RINGS[heads])
    assert own <= shared <= min(own + COMPILER_SHARED, MAX_SHARED), (config, shared, own)
    # The producer widens each chunk in one store (two stores into one allocation meet at a
    # barrier): at 16 rows (32-row chunks) its tile loop meets at 7 warpgroup barriers, where
    # 16-row steps took 9; at 32 rows (four 16-row chunks a tile) at 13.
    producer = sass[sass.rindex("USETMAXREG.DEALLOC") :]
    (tile_loop,) = mma_loops(producer, mma=("STS.128",))
    assert sum(t.startswith("BAR.SYNC") for t in tile_loop) == {16: 7, 32: 13}[heads], config
    # The MMA warpgroup keeps the softmax's row sums as per-thread partial terms (summed once, after
    # the last tile): its key-tile loop meets at 3 warpgroup barriers, where summing each tile's
    # P across the keys' warps took 6.
    (mma_loop,) = mma_loops(sass)
    assert sum(t.startswith("BAR.SYNC") for t in mma_loop) == 3, config


HEADS_SCRIPT = SCRIPT.replace("config = attrs.evolve(config, kernel=GluonKernel.DS_MLA, overlap=overlap)", "")


@pytest.fixture(scope="module")
def compiled_heads(tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """The launch the planner picks for 128 heads (the 64-row ``fp8_ds_mla`` kernel)."""
    cases = {"h128": ["128", "serial"]}
    return compile_cases(HEADS_SCRIPT, cases, tmp_path_factory.mktemp("ds-mla-heads"))["h128"]


@pytest.mark.heavy
def test_ds_mla_heads_kernel_keeps_its_register_budgets(compiled_heads: Compiled, cuobjdump: str) -> None:
    """:mod:`mla.providers.gluon.ds_mla_heads` at 128 heads: each warpgroup asks for its
    ``setmaxnreg`` budget (when one partition needs more than its budget, ptxas drops every
    ``setmaxnreg`` and the whole program runs at 168 registers a thread, which spilled 368 bytes),
    next to no stack (a few bytes of the producer's), no wgmma register hazards, the shared
    memory within a block's, the producer's conversions after its wait for the ring slot, its
    staged chunks read back before the barrier that precedes their bf16 stores, and its rows'
    scales in 16-byte loads."""
    from mla.providers.gluon import ds_mla_heads

    config = compiled_heads.stdout().strip().splitlines()[-1]
    assert "DS_MLA_HEADS" in config, config
    (cubin,) = glob.glob(f"{compiled_heads.cache_dir}/*/mla_decode_ds_mla_heads_kernel.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack <= 16, f"{config}: {usage.strip()}"
    sass = sass_of(cubin, cuobjdump)
    assert wgmma_register_hazards(sass) == [], config
    for regs in (ds_mla_heads.SCORE_REGS, ds_mla_heads.OUTPUT_REGS):
        assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, {regs:#x}\b", sass), (config, regs)
    shared = json.loads(pathlib.Path(cubin).with_suffix(".json").read_text())["shared"]
    assert shared <= MAX_SHARED, shared
    # The producer's first e4m3 conversion (its bytes sign-extended into bf16 lanes, a prmt with
    # selector 0x9180) comes after its first wait on a ring slot's barrier, and the conversions
    # are the bit moves and bf16x2 multiplies, no e4m3 → f16 → f32 chain.
    producer = sass[sass.rindex("USETMAXREG.DEALLOC") :]
    assert producer.index("SYNCS.PHASECHK") < producer.index("0x9180"), config
    assert "HMUL2.BF16" in producer, config
    assert "F2FP.F16.E4M3" not in producer, config
    # Its chunks land as 16-byte copies; each chunk's words are read back (16-byte loads) before
    # the producer's warps meet, and its bf16 values written (16-byte stores) after.
    assert "LDGSTS.E.BYPASS.128" in producer, config
    # A row's four tile scales come in one 16-byte load (4-byte loads remain for the token ids:
    # 12 in the producer, where four loads a row took 44).
    assert producer.count("LDG.E.128") == 8, config
    assert producer.count("LDG.E ") <= 12, config
    first_store = producer.index("STS.128")
    assert producer.index("LDS.128") < producer.rindex("BAR.SYNC", 0, first_store) < first_store, config


@pytest.mark.heavy
def test_ds_mla_heads_releases_without_a_barrier(compiled_heads: Compiled, cuobjdump: str) -> None:
    """The MMA warpgroups of :mod:`mla.providers.gluon.ds_mla_heads` release their ring-slot halves and
    the P buffer with an arrival from each thread (``cp.async.mbarrier.arrive.noinc``,
    ``kernels._release``), with no warpgroup barrier before it: a key tile's loop meets at 3
    barriers in the scores warpgroup (the one with exponentials; 7 when one thread arrived after a
    barrier and it waited on each chunk's barrier of one allocation) and 1 in the output
    warpgroup (3 before)."""
    (cubin,) = glob.glob(f"{compiled_heads.cache_dir}/*/mla_decode_ds_mla_heads_kernel.cubin")
    loops = mma_loops(sass_of(cubin, cuobjdump), ("GMMA",))
    counts = sorted(
        (
            any("MUFU.EX2" in t for t in body),
            sum(t.startswith("BAR.SYNC") for t in body),
            sum(t.startswith("ARRIVES.LDGSTSBAR") for t in body),
        )
        for body in loops
    )
    # (exponentials, barriers, per-thread arrivals): output warpgroup, then scores warpgroup
    assert counts == [(False, 1, 2), (True, 3, 1)]


def test_ring_shapes_fit_and_never_deadlock() -> None:
    """The launcher's ring shapes fit a block's shared memory and pass ``ring_ok``, which refuses
    exactly the shapes whose producer would wait for a rope tile the MMA frees only after a tile
    the producer has yet to widen (found by a model of the two partitions' waits)."""
    from mla.providers.gluon.ds_mla_rows import RINGS, DsMlaRings, ring_ok, shared_bytes

    for rows, rings in RINGS.items():
        assert ring_ok(rings), rings
        assert shared_bytes(rows, rings) + COMPILER_SHARED <= MAX_SHARED, rings
    for deadlocks in [(16, 6, 2, 2), (32, 4, 2, 2), (64, 3, 2, 2)]:
        assert not ring_ok(DsMlaRings(*deadlocks)), deadlocks
    for fine in [(32, 3, 2, 2), (16, 5, 2, 2), (64, 2, 2, 2), (16, 6, 3, 2), (32, 2, 2, 2)]:
        assert ring_ok(DsMlaRings(*fine)), fine
    assert not ring_ok(DsMlaRings(48, 3, 3, 2))  # not whole chunks per tile
