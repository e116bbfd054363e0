"""The probes' own checks, on the CPU, run on demand (``python -m pytest -q probes``), not in CI.

* ``probes/whatif.py`` edits the Gluon kernels' source: every edit must still apply, and every
  variant compile. When a kernel changes, an edit whose snippet is gone would make the variant
  time the unchanged kernel; the probe refuses that, and this says so before a GPU session is
  spent on it.
* The split reduce folded into the few-rows kernel (``mla.providers.gluon.fold``) must not push
  it into local memory (a whole ``rows × chunk`` piece in registers at once did: up to 2,950
  spill loads at 32 rows and two splits).

Compiling for sm_90 needs no GPU, only a process without the Triton interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from probes import row_gather, tree_ab, whatif
from probes.gluon_compile import sass_of_cubin

ROOT = Path(__file__).resolve().parent.parent


def run_without_interpreter(
    args: list[str], *, timeout: float = 900, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> str:
    """``python args...`` from ``cwd`` (the repository root) without ``TRITON_INTERPRET``, ``env``
    added to the environment; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


CASES = [(kernel, name) for kernel, spec in sorted(whatif.KERNELS.items()) for name in spec.variants]


@pytest.mark.parametrize(("kernel", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_every_edit_applies_once(kernel: str, name: str) -> None:
    spec = whatif.KERNELS[kernel]
    source = whatif.variant_source(spec, name)
    ast.parse(source)
    original = Path(spec.module.__file__).read_text()
    assert (source == original) == (name == "main")


@pytest.mark.parametrize("kernel", sorted(whatif.KERNELS))
def test_every_variant_compiles_for_sm90(kernel: str) -> None:
    """An edit can apply and still not compile (a name it relies on gone from the kernel): every
    variant must compile for sm_90 and fit an SM's shared memory."""
    stdout = run_without_interpreter(["-m", "probes.whatif", "--kernel", kernel, "--compile-only"])
    for name in whatif.KERNELS[kernel].variants:
        assert re.search(rf"\|\s*{re.escape(name)}\s*\|", stdout), stdout


def test_an_edit_that_no_longer_applies_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = whatif.KERNELS["dual"]
    gone = [("this text is not in dual.py", "")]
    monkeypatch.setitem(spec.variants, "gone", (True, gone, "an edit of a removed snippet"))
    with pytest.raises(ValueError, match=r"occurs 0 times in dual\.py"):
        whatif.variant_source(spec, "gone")


def test_an_edit_must_apply_as_often_as_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = whatif.KERNELS["dual"]
    twice = [("def mla_decode_dual_kernel(", "def mla_decode_dual_kernel(", 2)]
    monkeypatch.setitem(spec.variants, "twice", (True, twice, "an edit of a snippet that occurs once"))
    with pytest.raises(ValueError, match=r"occurs 1 times in dual\.py \(expected 2\)"):
        whatif.variant_source(spec, "twice")


def test_a_shape_label_is_parsed_or_refused() -> None:
    assert whatif.parse_shape("H16q4B64S4096") == (16, 4, 64, 4096)
    with pytest.raises(ValueError, match="H<heads>q<qlen>B<batch>S<seqlen>"):
        whatif.parse_shape("B64S4096")


SPILL_SCRIPT = """
import json, sys
from probes.gluon_compile import compile_variant, instruction_counts, sass_of

out = {}
for rows, fp8, splits in [(16, False, 2), (16, False, 128), (32, False, 2), (32, True, 128), (64, False, 2)]:
    kernel = compile_variant(fp8=fp8, block_n=64, stages=2, rows=rows, fold=splits)
    name = f"rows{rows}-{'fp8' if fp8 else 'bf16'}-fold{splits}"
    out[name] = instruction_counts(sass_of(kernel), ["LDL", "STL"])
json.dump(out, sys.stdout)
"""


def test_folded_kernels_compile_without_spills() -> None:
    counts = json.loads(run_without_interpreter(["-c", SPILL_SCRIPT]).strip().splitlines()[-1])
    assert counts == {name: {"LDL": 0, "STL": 0} for name in counts}
    assert len(counts) == 5


def test_tree_ab_applies_only_the_mla_part_of_a_patch(tmp_path: Path) -> None:
    """``probes.tree_ab make`` copies ``mla/`` and applies a patch's ``mla/`` files to the copy
    (its other files left out), and refuses a patch that changes nothing under ``mla/``."""
    init = (ROOT / "mla" / "__init__.py").read_text().splitlines(keepends=True)
    readme = (ROOT / "README.md").read_text().splitlines(keepends=True)

    def section(path: str, lines: list[str]) -> str:
        return (
            f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,1 +1,2 @@\n"
            f"{' ' + lines[0]}+# tree_ab\n"
        )

    both = tmp_path / "both.patch"
    both.write_text(section("README.md", readme) + section("mla/__init__.py", init))
    tree_ab.make(tmp_path / "trees", ["plain", f"changed={both}"])
    changed = (tmp_path / "trees" / "changed" / "mla" / "__init__.py").read_text()
    assert changed.splitlines()[1] == "# tree_ab"
    assert (tmp_path / "trees" / "plain" / "mla" / "__init__.py").read_text() == "".join(init)
    outside = tmp_path / "outside.patch"
    outside.write_text(section("README.md", readme))
    with pytest.raises(SystemExit, match="no change under mla/"):
        tree_ab.make(tmp_path / "trees", [f"none={outside}"])


def test_tree_ab_table_keeps_a_column_per_tree_and_round() -> None:
    """Each tree and round is a column of its own, a wrong output shows ``wrong`` (or its time
    marked ``(wrong)`` when timed unchecked), and two trees of one name are refused before
    anything runs."""
    good = {"us": 10.0, "TFLOP/s": 5.0}
    bad = {"us": float("nan"), "TFLOP/s": float("nan")}
    timed_wrong = {"us": 8.0, "TFLOP/s": 6.0, "ok": False}
    table = tree_ab._table(
        {"a r1": {"s": good}, "b r1": {"s": bad}, "a r2": {"s": good}, "c": {"s": timed_wrong}}
    )
    assert table == [
        {
            "shape": "s",
            "a r1": "10.0 µs 5.0",
            "b r1": "wrong",
            "a r2": "10.0 µs 5.0",
            "c": "8.0 µs 6.0 (wrong)",
        }
    ]
    with pytest.raises(SystemExit, match="two trees named 'main'"):
        tree_ab.run("fp8-prefill", [Path("x/main"), Path("y/main")], timeout=1.0)


@pytest.mark.parametrize(
    "patch", sorted((ROOT / "probes").glob("[bct]*/*.patch")), ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_bound_and_candidate_patches_still_apply(patch: Path, tmp_path: Path) -> None:
    """Every patch of ``probes/bounds/``, ``probes/candidates/`` and ``probes/timeline/`` applies to
    this checkout's ``mla/`` (``tree_ab make`` raises where a hunk no longer does), so a bound or a
    candidate is never timed on a tree it did not change; a patch whose first line reads ``# on top of:
    BASE`` applies on top of ``BASE`` (in the same directory, itself on top of its own base)."""
    stack = [patch]
    while (first := stack[0].read_text().splitlines()[0]).startswith("# on top of: "):
        stack.insert(0, patch.parent / first.removeprefix("# on top of: ").split()[0])
    tree_ab.make(tmp_path / "trees", [f"{patch.stem}={'+'.join(map(str, stack))}"])
    assert (tmp_path / "trees" / patch.stem / "mla").is_dir()


def _compiled_in_tree(tree: Path, script: str, cache: Path, kernel: str) -> str:
    """The sm_90 SASS of ``kernel``, compiled (and only compiled) by ``script`` in a process whose
    ``mla`` is ``tree``'s, into the Triton cache ``cache``; exactly one such cubin."""
    run_without_interpreter(
        ["-c", script],
        timeout=600,
        cwd=tree,
        env={"PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)]), "TRITON_CACHE_DIR": str(cache)},
    )
    (cubin,) = list(cache.rglob(f"{kernel}.cubin"))
    return sass_of_cubin(cubin)


def test_fp8_timeline_stamped_tree_compiles_for_sm90(tmp_path: Path) -> None:
    """``probes.fp8_timeline make`` builds the stamped tree; its persistent fp8 prefill compiles for
    sm_90 with the four clock reads of each consumer warpgroup's two tile loops (unmasked, masked)."""
    from probes import fp8_timeline

    fp8_timeline.main(["make", str(tmp_path / "trees")])
    tree = tmp_path / "trees" / "stamps"
    script = (
        "import torch\n"
        "from mla.testing.triton_driver import stand_in_driver\n"
        "from benchmarks.prefill import Case\n"
        "with stand_in_driver(compile_kernels=True):\n"
        "    Case(2, 2, 256, device='cpu').run_gluon_fp8()\n"
    )
    sass = _compiled_in_tree(tree, script, tmp_path / "cache", "mla_fp8_prefill_persistent_kernel")
    assert sass.count("SR_CLOCKLO") == 16


def test_fp8_timeline_stages_and_overlap_of_made_up_stamps() -> None:
    """``summarize``: the medians of each stage and the share of warpgroup 0's softmax time that
    warpgroup 1's overlaps, on stamps of two warpgroups 30 clocks apart (a program without
    stamps counts nothing)."""
    import numpy as np

    from probes.fp8_timeline import summarize

    stamps = np.zeros((2, 2, 8, 4), dtype=np.int64)
    for w, start in ((0, 1000), (1, 1030)):
        for g in range(5):
            t = start + 100 * g
            stamps[0, w, g] = [t, t + 10, t + 60, t + 80]
    row = summarize(stamps)
    assert row == {"qk": 10.0, "softmax": 50.0, "pv": 20.0, "gap": 20.0, "period": 100.0, "both": 0.4}


@pytest.mark.parametrize(
    ("patch", "heads", "kernel", "clocks"),
    [
        ("sparse-heads-stamps", 128, "mla_decode_ds_mla_heads_kernel", 12),
        ("sparse-rows-stamps", 16, "mla_decode_ds_mla_kernel", 9),
    ],
    ids=["heads", "rows"],
)
def test_sparse_timeline_stamped_trees_compile_for_sm90(
    patch: str, heads: int, kernel: str, clocks: int, tmp_path: Path
) -> None:
    """Each stamped ``fp8_ds_mla`` kernel (``probes/timeline/sparse-*-stamps.patch`` on a copy of
    ``mla/``) compiles for sm_90 at the sparse benchmark's B128 q2 with its clock reads, no
    register spills (a spilling stamped kernel would time another kernel) and each partition's
    ``setmaxnreg`` kept."""
    tree_ab.main(["make", str(tmp_path / "trees"), f"stamps=probes/timeline/{patch}.patch"])
    tree = tmp_path / "trees" / "stamps"
    script = (
        "import torch\n"
        "from mla.providers.calls import SparseAttentionCall\n"
        "from mla.providers.gluon.decode import sparse_decode\n"
        "from mla.providers.gluon.planner import launch_config\n"
        "from mla.testing.triton_driver import stand_in_driver\n"
        f"h = {heads}\n"
        "config = launch_config(batch=256, rows=h, max_seqlen_k=2048, num_sms=132, persistent=False,\n"
        "                       kv_fp8=True, ds_mla=True)\n"
        "call = SparseAttentionCall(q=torch.zeros(256, h, 576, dtype=torch.bfloat16),\n"
        "    kv_cache=torch.zeros(4096, 656, dtype=torch.uint8),\n"
        "    slots=torch.zeros(256, 2048, dtype=torch.int32),\n"
        "    out=torch.zeros(256, h, 512, dtype=torch.bfloat16), lse=torch.zeros(256, h), kv_lora_rank=512,\n"
        "    rope_dim=64, softmax_scale=0.07, kv_scale=None)\n"
        "with stand_in_driver(compile_kernels=True):\n"
        "    sparse_decode(call, config=config)\n"
    )
    sass = _compiled_in_tree(tree, script, tmp_path / "cache", kernel)
    assert sass.count("SR_CLOCKLO") == clocks
    # (the 64-row producer keeps a few bytes on its stack, as on main)
    assert sass.count("STL ") <= 2, "the stamped kernel spills"
    assert "USETMAXREG.TRY_ALLOC" in sass


def test_sparse_timeline_stages_of_made_up_stamps() -> None:
    """``probes.sparse_timeline.summarize``: each stage's median and percentiles in clocks over all
    tiles but each program's first, signed (an end before its start is negative), across the
    clock register's wrap; a program of fewer than 3 tiles counts nothing."""
    import numpy as np

    from probes.sparse_timeline import HEADS_STAGES, ROWS_STAGES, summarize

    stamps = np.zeros((3, 64, 16), dtype=np.int64)
    for t in range(6):
        base = 2**32 - 1000 + 500 * t  # wraps after tile 1
        stamps[0, t, :] = [(base + 10 * e) % 2**32 for e in range(16)]
        stamps[1, t, :] = [(base + 20 * e) % 2**32 for e in range(16)]
    stamps[2, :2, :] = 7  # two tiles: left out
    rows = summarize(stamps, "rows")
    assert list(rows) == list(ROWS_STAGES)
    assert rows["mma: QKᵀ"] == [15.0, 10.0, 20.0]
    assert rows["mma: period"] == [500.0, 500.0, 500.0]
    assert rows["mma at the tile to the tile announced"] == [165.0, 110.0, 220.0]
    heads = summarize(stamps, "heads")
    assert list(heads) == list(HEADS_STAGES)
    assert heads["scores at the tile to the tile announced"] == [180.0, 120.0, 240.0]
    # stamp 14 of a tile to stamp 9 of the next: 500 - 5 * 10 (or 5 * 20) clocks
    assert heads["producer: next tile's copies issued to its first pair landed"] == [425.0, 400.0, 450.0]
    stamps[:2, 1, 3] = (stamps[:2, 1, 2] - 5) % 2**32  # an end before its start
    assert summarize(stamps, "rows")["mma: softmax and Pᵀ published"][1] == -5.0
    with pytest.raises(ValueError, match="3 tiles"):
        summarize(stamps[2:], "rows")


def test_row_gather_methods_compile_for_sm90() -> None:
    """Every gather method of ``probes.row_gather`` compiles for sm_90 (TMA boxes of an int64
    view of the byte rows; the ``cp.async`` gather of the kernels)."""
    stdout = run_without_interpreter(["-m", "probes.row_gather", "--compile-only"])
    for method in ("cpasync", "tma-row", "tma-parts"):
        assert f"{method} [" in stdout, stdout


def test_operations_on_one_allocation_meet_at_a_barrier() -> None:
    """``probes.membar_copies``: Triton's barrier analysis puts a ``bar.sync`` between two copies
    into one allocation and none between copies into two; the same for mbarrier waits; two
    elected arrivals always meet at one (the 64-row ``fp8_ds_mla`` kernel's barrier allocations
    and its candidate pair copies rely on the first two)."""
    stdout = run_without_interpreter(["-m", "probes.membar_copies"])
    counts = [line.split("|")[-2].strip() for line in stdout.splitlines() if "allocation" in line]
    assert counts == ["1", "0", "1", "0", "1", "1"], stdout


def test_row_gather_checksum_is_the_sum_of_each_rows_first_word() -> None:
    """The checksum the methods are checked against, on a tiny cache (CPU): a ``-1`` slot adds
    nothing."""
    cache = torch.zeros(4, row_gather.ROW_BYTES, dtype=torch.uint8)
    cache.view(torch.int32)[:, 0] = torch.tensor([1, 2, -1, 7], dtype=torch.int32)
    slots = torch.tensor([[0, 1, 1, -1], [2, 3, 0, -1]], dtype=torch.int32)
    assert row_gather.expected(cache, slots).tolist() == [5, 0xFFFFFFFF + 7 + 1]


def test_ncu_stalls_splits_partitions_at_their_register_budgets() -> None:
    """Each ``setmaxnreg`` starts a partition's stretch, named by its budget and by whether it
    issues ``wgmma`` (8-bit ``QGMMA`` included); without any, the ``wgmma`` clusters split it."""
    from probes.ncu_stalls import partitions

    source = [
        "MOV R1, c[0x0][0x28]",
        "USETMAXREG.DEALLOC.CTAPOOL 0x78",
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0",
        "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], R24",
        "USETMAXREG.DEALLOC.CTAPOOL 0x38",
        "LDS.U8 R4, [R4+UR21]",
    ]
    assert partitions(source) == [
        ("other, entry", 0, 1),
        ("other, 120 registers", 1, 2),
        ("MMA, 224 registers", 2, 4),
        ("other, 56 registers", 4, 6),
    ]
    plain = ["MOV R1, R2", "HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0", *["FADD R3, R3, R4"] * 300]
    assert partitions(plain) == [("MMA partition 0", 0, 201), ("default partition", 201, 302)]
    assert partitions(plain[:3]) == [("MMA partition 0", 0, 3), ("default partition", 3, 3)]
