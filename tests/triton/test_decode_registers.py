"""The Triton decode kernel's register budget, from Triton's sm_90 compile on the CPU.

The 16-row bf16 launch (16 heads, qlen 1: the most common decode) sits near the 255-register
limit; a few more live values in its pipelined loop make ptxas spill to local memory, which cost
the block-table form 30-40% of its speed on the H200 once. This test compiles the launches the
heuristic picks over the block table (the engine's form) for sm_90 without a GPU
(:mod:`mla.testing.triton_driver`) and reads the cubin with the ``cuobjdump`` Triton ships: no
stack (spill) bytes, and (``benchmarks/decode.py``'s verify q2 and fp8 launches) a tile loop no
longer than the flat-id kernel's of ``2458cb9`` plus a small margin. The block table first
added per-lane page math and in-cache checks there (verify q2 854 -> 982 instructions, 6%
slower on the H200; fp8 984 -> 1025 and 8 bytes of stack, 3% slower); a tile inside one page
now loads and checks its block id once (813 and 908).
"""

from __future__ import annotations

import glob
import json
import textwrap

import pytest
from sm90_compile import Compiled, compile_cases, mma_loop_lengths, resource_usage, sass_of

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.heavy  # (compiles four launches for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from mla.providers.calls import PagedDecodeCall
    from mla.providers.triton.decode import paged_decode
    from mla.providers.triton.schedule import decode_launch_config

    from mla.testing.triton_driver import stand_in_driver

    heads, qlen, batch, seq = (int(a) for a in sys.argv[1:5])
    fp8 = sys.argv[5] == "1"
    b = 4  # the tensors are never read: a few requests, the launch config of the real batch
    q = torch.zeros(b * qlen, heads, 576, dtype=torch.bfloat16)
    cache = torch.zeros(b * seq + 64, 576, dtype=torch.bfloat16)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    call = PagedDecodeCall(
        q=q, kv_cache=cache, kv_indptr=(torch.arange(b + 1) * seq).to(torch.int32), kv_indices=None,
        block_table=torch.zeros(b, seq // 64, dtype=torch.int32),
        qo_indptr=(torch.arange(b + 1) * qlen).to(torch.int32),
        out=torch.zeros(b * qlen, heads, 512, dtype=torch.bfloat16), lse=torch.zeros(b * qlen, heads),
        max_qlen=qlen, max_seqlen_k=seq, page_size=64, softmax_scale=0.07,
        kv_scale=torch.tensor([0.05]) if fp8 else None)
    config = decode_launch_config(
        batch=batch, rows=heads * qlen, max_seqlen_k=seq, num_sms=132, kv_elem_size=cache.element_size(),
        persistent=False)
    with stand_in_driver(compile_kernels=True):
        paged_decode(call, config=config)
    print(json.dumps(str(config)))
    """
)

CASES = {
    # name: (heads, qlen, batch, seq, fp8 cache, max tile-loop instructions or None)
    "h16": (16, 1, 64, 4096, False, None),
    "h128": (128, 1, 64, 4096, False, None),
    "verify-q2": (16, 2, 64, 4096, False, 870),
    "fp8": (16, 1, 128, 8192, True, 1000),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    """Every launch compiled, in one process (one import of torch and Triton)."""
    cases = {
        name: [str(heads), str(qlen), str(batch), str(seq), "1" if fp8 else "0"]
        for name, (heads, qlen, batch, seq, fp8, _) in CASES.items()
    }
    return compile_cases(SCRIPT, cases, tmp_path_factory.mktemp("decode-registers"))


@pytest.mark.parametrize("case", list(CASES))
def test_block_table_decode_does_not_spill(case: str, compiled: dict[str, Compiled], cuobjdump: str) -> None:
    max_loop = CASES[case][-1]
    config = json.loads(compiled[case].stdout().strip().splitlines()[-1])
    (cubin,) = glob.glob(f"{compiled[case].cache_dir}/*/_mla_decode_kernel.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack == 0, f"{config}: {usage.strip()}"
    if max_loop is not None:
        sass = sass_of(cubin, cuobjdump)
        loops = mma_loop_lengths(sass)
        assert loops, "no MMA loop found in the SASS"
        assert max(loops) <= max_loop, f"{config}: tile loops of {loops} instructions"
