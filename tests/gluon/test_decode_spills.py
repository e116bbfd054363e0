"""Spills and loop length of the Gluon few-rows and dual-chain decode kernels, from Triton's sm_90
compile on the CPU.

Since the kernels read the block table (``2458cb9`` read flat ids), every key's id was re-read
from global memory for the in-cache check and each id went through per-row index math; on the
H200 the verify q2 launch (32-row tiles, the transposed few-rows kernel) ran 2.6% and the fp8
launch (16-row tiles, the dual-chain kernel) 1.4% slower. The check now reads the id ring in
shared memory, and a tile inside one page (non-persistent launches, 64-token pages) reads and
checks its block id once. This test compiles the launches ``benchmarks/decode.py`` times there
(the planner's configs for B64 S4096 H16 qlen 2 and B128 S8192 H16 fp8, non-persistent) over the
block table and over flat ids, and bounds the cubin's stack and the instructions of its MMA tile
loops (``cuobjdump -sass``: a backward branch over wgmma instructions) with the ``cuobjdump``
Triton ships. ``2458cb9``: few-rows 250 registers, no stack, a 1184-instruction loop;
dual-chain 168 registers (``setmaxnreg``), 16 bytes of stack (its MMA loops spill nothing; the
loader runs at 40 registers), MMA loops of 816 and 813. Before this fix: few-rows loops of
1336 (table) / 1327 (flat), dual-chain 32 bytes of stack (table) and loops of 834. Now:
few-rows 242 (table) / 255 (flat) registers, no stack, loops of 1087 / 1174; dual-chain 16
(table) / 24 (flat: the loader's id-ring copy) bytes, loops of 820 / 822.
"""

from __future__ import annotations

import glob
import textwrap

import pytest
from sm90_compile import (
    Compiled,
    compile_cases,
    mma_loop_lengths,
    resource_usage,
    sass_of,
    wgmma_register_hazards,
)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (compiles four launches for sm_90 in a process of its own)

CASES = {
    # kernel: (cubin name, heads, qlen, batch, seq, fp8 cache, max stack bytes, max loop length)
    "rows": ("mla_decode_rows_kernel", 16, 2, 64, 4096, False, 0, 1200),
    "dual": ("mla_decode_dual_kernel", 16, 1, 128, 8192, True, 24, 830),
}

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from mla.providers.calls import PagedDecodeCall
    from mla.providers.gluon.decode import paged_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.testing.triton_driver import stand_in_driver

    RANK, ROPE = 512, 64
    kernel, keys = sys.argv[1], sys.argv[2]
    heads, qlen, batch, seq = (int(a) for a in sys.argv[3:7])
    fp8 = sys.argv[7] == "1"
    b = 4  # the tensors are never read: a few requests, the benchmark's launch config
    cache = torch.zeros(b * seq + 64, RANK + ROPE, dtype=torch.bfloat16)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    table = keys == "table"
    call = PagedDecodeCall(
        q=torch.zeros(b * qlen, heads, RANK + ROPE, dtype=torch.bfloat16), kv_cache=cache,
        kv_indptr=(torch.arange(b + 1) * seq).to(torch.int32),
        kv_indices=None if table else torch.zeros(b * seq, dtype=torch.int32),
        block_table=torch.zeros(b, seq // 64, dtype=torch.int32) if table else None,
        qo_indptr=(torch.arange(b + 1) * qlen).to(torch.int32),
        out=torch.zeros(b * qlen, heads, RANK, dtype=torch.bfloat16), lse=torch.zeros(b * qlen, heads),
        max_qlen=qlen, max_seqlen_k=seq, page_size=64, softmax_scale=0.07,
        kv_scale=torch.tensor([0.05]) if fp8 else None)
    config = launch_config(
        batch=batch, rows=heads * qlen, max_seqlen_k=seq, num_sms=132, persistent=False, kv_fp8=fp8)
    assert config.kernel == GluonKernel(kernel), config
    with stand_in_driver(compile_kernels=True):
        paged_decode(call, config=config)
    print(config)
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    """Every (kernel, keys) launch compiled, in one process (one import of torch and Triton)."""
    cases = {}
    for kernel, (_, heads, qlen, batch, seq, fp8, _, _) in CASES.items():
        for keys in ("table", "flat"):
            args = [kernel, keys, str(heads), str(qlen), str(batch), str(seq), "1" if fp8 else "0"]
            cases[f"{kernel}-{keys}"] = args
    return compile_cases(SCRIPT, cases, tmp_path_factory.mktemp("decode-spills"))


@pytest.mark.parametrize("keys", ["table", "flat"])
@pytest.mark.parametrize("kernel", sorted(CASES))
def test_decode_spills_stay_at_the_flat_id_kernels(
    kernel: str, keys: str, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    name, _, _, _, _, _, max_stack, max_loop = CASES[kernel]
    case = compiled[f"{kernel}-{keys}"]
    config = case.stdout().strip().splitlines()[-1]
    (cubin,) = glob.glob(f"{case.cache_dir}/*/{name}.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack <= max_stack, f"{keys} {config}: {usage.strip()}"
    sass = sass_of(cubin, cuobjdump)
    loops = mma_loop_lengths(sass)
    assert loops, "no MMA loop found in the SASS"
    assert max(loops) <= max_loop, f"{keys} {config}: MMA loops of {loops} instructions"


@pytest.mark.parametrize("keys", ["table", "flat"])
@pytest.mark.parametrize("kernel", sorted(CASES))
def test_no_register_of_a_wgmma_is_touched_before_its_wait(
    kernel: str, keys: str, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    """The dual-chain kernel's register-A products (fp8 V widened in registers) and both kernels'
    accumulators: no instruction reads or writes them while their ``wgmma`` is in flight
    (:func:`sm90_compile.wgmma_register_hazards`)."""
    (cubin,) = glob.glob(f"{compiled[f'{kernel}-{keys}'].cache_dir}/*/{CASES[kernel][0]}.cubin")
    assert wgmma_register_hazards(sass_of(cubin, cuobjdump)) == []
