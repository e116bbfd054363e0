"""The Triton decode kernel's register budget, from Triton's sm_90 compile on the CPU.

The 16-row bf16 launch (16 heads, qlen 1: the most common decode) sits near the 255-register
limit; a few more live values in its pipelined loop make ptxas spill to local memory, which cost
the block-table form 30-40% of its speed on the H200 once. This test compiles the launches the
heuristic picks for 16 and 128 heads over the block table (the engine's form) for sm_90 without
a GPU (:mod:`mla.testing.triton_driver`) and reads the cubin's resource usage with the
``cuobjdump`` Triton ships: no stack (spill) bytes.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import subprocess
import textwrap

import pytest
from sm90_compile import run_without_interpreter

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from mla.providers.calls import PagedDecodeCall
    from mla.providers.triton.decode import paged_decode
    from mla.providers.triton.schedule import decode_launch_config
    from mla.testing.triton_driver import stand_in_driver

    heads, batch, seq = int(sys.argv[1]), 4, 4096
    q = torch.zeros(batch, heads, 576, dtype=torch.bfloat16)
    cache = torch.zeros(batch * seq + 64, 576, dtype=torch.bfloat16)
    call = PagedDecodeCall(
        q=q, kv_cache=cache, kv_indptr=(torch.arange(batch + 1) * seq).to(torch.int32), kv_indices=None,
        block_table=torch.zeros(batch, seq // 64, dtype=torch.int32),
        qo_indptr=torch.arange(batch + 1).to(torch.int32),
        out=torch.zeros(batch, heads, 512, dtype=torch.bfloat16), lse=torch.zeros(batch, heads), max_qlen=1,
        max_seqlen_k=seq, page_size=64, softmax_scale=0.07, kv_scale=None)
    config = decode_launch_config(
        batch=64, rows=heads, max_seqlen_k=seq, num_sms=132, kv_elem_size=2, persistent=False)
    with stand_in_driver(compile_kernels=True):
        paged_decode(call, config=config)
    print(json.dumps(str(config)))
    """
)


def _cuobjdump() -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        pytest.skip("this Triton build ships no cuobjdump")
    return path


@pytest.mark.parametrize("heads", [16, 128], ids=lambda h: f"h{h}")
def test_block_table_decode_does_not_spill(
    heads: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuobjdump = _cuobjdump()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    config = json.loads(run_without_interpreter(["-c", SCRIPT, str(heads)]).strip().splitlines()[-1])
    (cubin,) = glob.glob(f"{tmp_path}/*/_mla_decode_kernel.cubin")
    done = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True)
    stack = re.search(r"STACK:(\d+)", done.stdout)
    assert stack is not None, done.stdout
    assert int(stack.group(1)) == 0, f"{config}: {done.stdout.strip()}"
