"""The Gluon ping-pong decode kernel's spills, from Triton's sm_90 compile on the CPU.

The kernel's MMA warpgroups run at their ``setmaxnreg`` budget and ptxas spills a few loop
invariants of the second one to local memory (88 bytes of stack, as the kernel before the key
check had). When they read the key ids from global memory for the key check (a 64-bit address
per key and thread), the stack doubled (160-168 bytes, more reloads in the loop) and the 64-row
cases ran 5% (block table) and 20% (flat ids) slower on the H200; the ids now come through a
shared-memory ring the loader fills (one word a tile inside a page, 0 for a block inside the
cache: with the cache's bound live in the loop the stack was 104 bytes). This test compiles
the launch the planner picks for 128 heads (B64 S4096, non-persistent) over the block table and
over flat ids for sm_90 without a GPU (:mod:`mla.testing.triton_driver`) and bounds the cubin's
stack with the ``cuobjdump`` Triton ships, and reads from its SASS that the 16-bit output leaves
with 16-byte stores (staged through shared memory; the accumulator layout alone gives a thread
pairs of columns: 4-byte stores, each half a sector).
"""

from __future__ import annotations

import glob
import re
import textwrap

import pytest
from sm90_compile import Compiled, compile_cases, resource_usage, sass_of, wgmma_register_hazards

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (compiles two launches for sm_90 in a process of its own)

MAX_STACK = 88
"""Bytes of stack (spills) allowed: 88 with the id ring's word, 96-104 with the cache's bound in
the MMA loops, 160-168 with the global re-read."""

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from mla.providers.gluon.decode import launch_gluon_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.providers.triton.decode_launch import BlockTableKeys, DecodeInputs
    from mla.testing.triton_driver import stand_in_driver

    RANK, ROPE, heads, batch, seq = 512, 64, 128, 4, 4096
    table = sys.argv[1] == "table"
    q = torch.zeros(batch, heads, RANK + ROPE, dtype=torch.bfloat16)
    cache = torch.zeros(batch * seq + 64, RANK + ROPE, dtype=torch.bfloat16)
    keys = (torch.zeros(batch, seq // 64, dtype=torch.int32) if table
            else torch.zeros(batch * seq, dtype=torch.int32))
    config = launch_config(
        batch=64, rows=heads, max_seqlen_k=seq, num_sms=132, persistent=False, kv_fp8=False)
    assert config.kernel == GluonKernel.PINGPONG, config
    inputs = DecodeInputs(
        q[..., :RANK], q[..., RANK:], cache, (torch.arange(batch + 1) * seq).to(torch.int32), keys,
        torch.arange(batch + 1).to(torch.int32), batch, 1, seq, 0.07, None,
        torch.zeros(batch, heads, RANK, dtype=torch.bfloat16), torch.zeros(batch, heads), None,
        BlockTableKeys(64, None) if table else None)
    with stand_in_driver(compile_kernels=True):
        launch_gluon_decode(inputs, config)
    print(config)
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    """Both launches compiled, in one process (one import of torch and Triton)."""
    return compile_cases(SCRIPT, {"table": ["table"], "flat": ["flat"]}, tmp_path_factory.mktemp("pingpong"))


@pytest.mark.parametrize("keys", ["table", "flat"])
def test_pingpong_decode_spills_stay_small(keys: str, compiled: dict[str, Compiled], cuobjdump: str) -> None:
    config = compiled[keys].stdout().strip().splitlines()[-1]
    (cubin,) = glob.glob(f"{compiled[keys].cache_dir}/*/mla_decode_pingpong_kernel.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    assert stack <= MAX_STACK, f"{keys} {config}: {usage.strip()}"


@pytest.mark.parametrize("keys", ["table", "flat"])
def test_pingpong_output_leaves_in_16_byte_stores(
    keys: str, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    (cubin,) = glob.glob(f"{compiled[keys].cache_dir}/*/mla_decode_pingpong_kernel.cubin")
    sass = sass_of(cubin, cuobjdump)
    wide = len(re.findall(r"STG\.E\.128 ", sass))
    # A thread of each MMA warpgroup stores 256 bytes of its 64x256 bf16 half: 16 stores of 16
    # bytes in each warpgroup's code (128 STG.E of 4 bytes without the staging).
    assert wide >= 2 * 16, f"{keys}: {wide} STG.E.128 in the SASS"


@pytest.mark.parametrize("keys", ["table", "flat"])
def test_pingpong_touches_no_wgmma_register_before_its_wait(
    keys: str, compiled: dict[str, Compiled], cuobjdump: str
) -> None:
    """Its P·V reads P from registers while the other products run: no instruction touches a
    product's registers before the wait that retires it (:func:`sm90_compile.wgmma_register_hazards`)."""
    (cubin,) = glob.glob(f"{compiled[keys].cache_dir}/*/mla_decode_pingpong_kernel.cubin")
    assert wgmma_register_hazards(sass_of(cubin, cuobjdump)) == []
