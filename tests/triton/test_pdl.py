"""Programmatic dependent launch (:mod:`mla.providers.triton.pdl`): where it is used, and what
the kernels that take part compile to.

On the CPU ``use_pdl`` is off (no CUDA device, and the interpreter in CI). The compile test
builds the top-k passes and the split reduce for sm_90 without a GPU, once with PDL forced on
and once off, and reads Triton's cache: with it on, every kernel waits on
``griddepcontrol.wait``, none releases its dependents early (``griddepcontrol.launch_dependents``)
and each is marked for a PDL launch; with it off no kernel holds a ``griddepcontrol``
instruction. The GPU tests of those kernels (``-m gpu``) run them with PDL on an H100/H200.
"""

from __future__ import annotations

import glob
import json
import pathlib
import textwrap

import pytest
import torch
from sm90_compile import Compiled, compile_cases

from mla.providers.triton import pdl

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import mla.providers.triton.merge as merge
    import mla.providers.triton.pdl as pdl
    import mla.providers.triton.topk as topk
    from mla.testing.triton_driver import stand_in_driver

    on = sys.argv[1] == "on"  # (both cases run in one process: set it either way)
    pdl.use_pdl = lambda device: on
    rows, n = 4, 4096
    with stand_in_driver(compile_kernels=True):
        topk.radix_topk(torch.zeros(rows, n), torch.zeros(rows, 64, dtype=torch.int32), k=64)
        part_o = torch.zeros(2 * rows, 1, 16, 512)
        merge.launch_merge(
            part_o=part_o, part_lse=torch.zeros(2 * rows, 1, 16),
            out=torch.zeros(rows, 16, 512, dtype=torch.bfloat16), lse=torch.zeros(rows, 16), qo_indptr=None,
            split_indptr=torch.arange(rows + 1, dtype=torch.int32) * 2, num_requests=rows, max_qlen=1,
            num_splits=2, num_sms=132)
    """
)
KERNELS = ("_topk_range_kernel", "_topk_histogram_kernel", "_topk_collect_kernel", "_topk_finish_kernel",
           "_merge_splits_kernel")  # fmt: skip


def test_use_pdl_is_off_without_cuda() -> None:
    assert pdl.use_pdl(torch.device("cpu")) is False


def test_use_pdl_is_off_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.use_pdl(torch.device("cuda", 0)) is False


def test_use_pdl_follows_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.use_pdl(torch.device("cuda", 0)) is True
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.use_pdl(torch.device("cuda", 0)) is False


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    pytest.importorskip("triton")
    return compile_cases(SCRIPT, {"on": ["on"], "off": ["off"]}, tmp_path_factory.mktemp("pdl"))


def _kernel_files(case: Compiled, kernel: str) -> tuple[str, dict[str, object]]:
    case.stdout()
    (ptx,) = glob.glob(f"{case.cache_dir}/*/{kernel}.ptx")
    (meta,) = glob.glob(f"{case.cache_dir}/*/{kernel}.json")
    return pathlib.Path(ptx).read_text(), json.loads(pathlib.Path(meta).read_text())


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_wait_for_the_previous_kernel_with_pdl(kernel: str, compiled: dict[str, Compiled]) -> None:
    ptx, meta = _kernel_files(compiled["on"], kernel)
    assert ptx.count("griddepcontrol.wait") == 1
    assert "griddepcontrol.launch_dependents" not in ptx
    assert meta["launch_pdl"] is True
    ptx, meta = _kernel_files(compiled["off"], kernel)
    assert "griddepcontrol" not in ptx
    assert meta["launch_pdl"] is False
