"""The racecheck probes (``probes/ws_mbarrier_probe.py``) on the CPU, run on demand (``python -m
pytest -q probes``), not in CI: every mode's kernel compiles for sm_90 (Triton's launch path under
:func:`mla.testing.triton_driver.stand_in_driver`, in a process without the Triton interpreter),
and into the shared-memory instructions that its docstring says the mode isolates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    r"""
    import glob, json, os, re, sys, traceback
    from mla.testing.triton_driver import stand_in_driver
    from probes import ws_mbarrier_probe as probe

    root = sys.argv[1]
    out = {}
    with stand_in_driver() as driver:
        for mode in probe.MODES:
            os.environ["TRITON_CACHE_DIR"] = os.path.join(root, mode)  # (read at each compile)
            driver.launches.clear()
            try:
                probe.launch(mode, 4, "cpu")
            except Exception:
                out[mode] = {"error": traceback.format_exc()}
                continue
            ptx = "".join(open(p).read() for p in glob.glob(os.path.join(root, mode, "*", "*.ptx")))
            # the opcodes of its instructions, but for the warp specialisation's own state (at
            # constant addresses of global_smem)
            lines = [line for line in ptx.splitlines() if "global_smem+" not in line]
            found = (re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", line) for line in lines)
            ops = sorted({m.group(1) for m in found if m})
            out[mode] = {"kernels": [l.function[1] for l in driver.launches], "ops": ops}
    print(json.dumps(out))
    """
)

MATRIX = ("stmatrix.sync.aligned.m8n8.x1.shared.b16", "ldmatrix.sync.aligned.m8n8.x1.shared.b16")
LDST = ("st.shared.b32", "ld.shared.b32")
FENCE = "fence.proxy.async.shared::cta"
TMA = "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"

# mode: (its kernel, instructions it must have, instructions it must not have)
EXPECTED = {
    "handoff": ("probe_kernel", MATRIX, LDST),
    "handoff-ldst": ("probe_kernel", LDST, MATRIX),
    "alternate": ("alternate_kernel", MATRIX, ()),
    "ring": ("ring_kernel", ("cp.async.cg.shared.global",), ("cp.async.wait_group",)),
    "ring-wait": ("ring_kernel", ("cp.async.cg.shared.global", "cp.async.wait_group"), ()),
    "handoff2": ("handoff2_kernel", MATRIX, (*LDST, FENCE, TMA)),
    "handoff2-ldst": ("handoff2_kernel", LDST, (*MATRIX, FENCE, TMA)),
    "handoff2-fence": ("handoff2_kernel", (*MATRIX, FENCE), (*LDST, TMA)),
    "handoff2-replicated": ("handoff2_kernel", ("st.shared.b32", "ld.shared.v2.b32"), (*MATRIX, FENCE, TMA)),
    "handoff2-tma": ("handoff2_kernel", (*MATRIX, TMA, "mbarrier.arrive.expect_tx.shared.b64"), LDST),
    "handoff2-tma-apart": ("handoff2_kernel", (*MATRIX, TMA, "mbarrier.arrive.expect_tx.shared.b64"), LDST),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every mode launched once under the stand-in driver (compiled for sm_90, each into a
    Triton cache of its own): its kernels' names and its PTX opcodes, or its traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = tmp_path_factory.mktemp("ws_mbarrier_probe")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_every_mode_is_checked(compiled: dict[str, dict[str, object]]) -> None:
    assert sorted(compiled) == sorted(EXPECTED)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_every_mode_compiles_for_sm90(compiled: dict[str, dict[str, object]], mode: str) -> None:
    """The mode's kernel compiles for sm_90, with the shared-memory instructions that make the
    mode differ from its neighbours (``stmatrix``/``ldmatrix`` against ``st.shared``/``ld.shared``,
    the fence, the TMA)."""
    result = compiled[mode]
    assert "error" not in result, result.get("error")
    kernel, present, absent = EXPECTED[mode]
    assert result["kernels"] == [kernel]
    ops = set(result["ops"])  # type: ignore[call-overload]
    assert set(present) <= ops, sorted(set(present) - ops)
    assert not set(absent) & ops, sorted(set(absent) & ops)
