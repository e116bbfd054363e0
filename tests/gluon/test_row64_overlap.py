"""The overlapped loop of the Gluon 64-row decode kernel (``GluonLaunchConfig(overlap=True)``) on
a CPU: compiled for sm_90 (Triton's compiler and ptxas under the stand-in driver, in a process
without the interpreter) over a 16-bit cache, a per-tensor fp8 cache and ``fp8_ds_mla`` rows,
and its SASS read with ``cuobjdump``.

The loop issues tile ``t``'s ``P·V``, widens (or takes) tile ``t + 1`` while it runs, issues tile
``t + 1``'s ``QKᵀ`` and waits for both before the back edge. Waiting at the loop's top instead
left a ``wgmma`` reading ``P`` from registers in flight across the back edge, and ptxas then
serialised every ``wgmma`` of the kernel (a wait behind each one: 74 waits for the loop's 38
``wgmma`` at 32-token tiles). Each MMA loop must wait once.
"""

from __future__ import annotations

import glob
import textwrap

import pytest
from sm90_compile import Compiled, compile_cases, mma_loops, sass_of, wgmma_register_hazards

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (compiles three launches for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import sys
    import attrs, torch
    from mla.providers.calls import PagedDecodeCall, SparseAttentionCall
    from mla.providers.gluon.decode import paged_decode, sparse_decode
    from mla.providers.gluon.planner import GluonKernel, launch_config
    from mla.testing.triton_driver import stand_in_driver

    RANK, ROPE, heads, b, seq = 512, 64, 64, 4, 2048
    cache_kind, block_n, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    q = torch.zeros(b, heads, RANK + ROPE, dtype=torch.bfloat16)
    out, lse = torch.zeros(b, heads, RANK, dtype=torch.bfloat16), torch.zeros(b, heads)
    ds_mla, fp8 = cache_kind == "ds_mla", cache_kind != "bf16"
    config = launch_config(batch=b, rows=heads, max_seqlen_k=seq, num_sms=132, persistent=False,
                           kv_fp8=fp8, ds_mla=ds_mla)
    config = attrs.evolve(config, kernel=GluonKernel.ROW64, overlap=True, block_n=block_n, num_stages=stages)
    with stand_in_driver(compile_kernels=True):
        if ds_mla:
            sparse_decode(SparseAttentionCall(
                q=q, kv_cache=torch.zeros(4096, 656, dtype=torch.uint8),
                slots=torch.zeros(b, seq, dtype=torch.int32), out=out, lse=lse, kv_lora_rank=RANK,
                rope_dim=ROPE, softmax_scale=0.07, kv_scale=None,
                lengths=torch.full((b,), seq, dtype=torch.int32)), config=config)
        else:
            cache = torch.zeros(b * seq, RANK + ROPE, dtype=torch.bfloat16)
            paged_decode(PagedDecodeCall(
                q=q, kv_cache=cache.to(torch.float8_e4m3fn) if fp8 else cache,
                kv_indptr=(torch.arange(b + 1) * seq).to(torch.int32), kv_indices=None,
                block_table=torch.zeros(b, seq // 64, dtype=torch.int32),
                qo_indptr=torch.arange(b + 1).to(torch.int32), out=out, lse=lse, max_qlen=1,
                max_seqlen_k=seq, page_size=64, softmax_scale=0.07,
                kv_scale=torch.tensor([0.05]) if fp8 else None), config=config)
    print(config)
    """
)
CASES = {
    # name: (cache, block_n, num_stages): the configs that fit in shared memory at 64 rows
    "bf16": ("bf16", 32, 4),
    "fp8": ("fp8", 32, 4),
    "ds_mla-3": ("ds_mla", 32, 3),
    "ds_mla-4": ("ds_mla", 32, 4),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    cases = {name: [cache, str(block_n), str(stages)] for name, (cache, block_n, stages) in CASES.items()}
    return compile_cases(SCRIPT, cases, tmp_path_factory.mktemp("row64-overlap"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_loop_waits_once_a_tile(compiled: dict[str, Compiled], cuobjdump: str, case: str) -> None:
    config = compiled[case].stdout().strip().splitlines()[-1]
    (cubin,) = glob.glob(f"{compiled[case].cache_dir}/*/mla_decode_kernel.cubin")
    sass = sass_of(cubin, cuobjdump)
    loops = mma_loops(sass)
    assert len(loops) == 1, (config, [len(body) for body in loops])
    (body,) = loops
    mmas = [i for i, t in enumerate(body) if "HGMMA" in t]
    waits = [i for i, t in enumerate(body) if "WARPGROUP.DEPBAR" in t]
    assert len(waits) == 1, f"{config}: {len(waits)} waits for {len(mmas)} wgmma (serialised)"
    # this tile's P·V is issued, then the next tile is widened or taken (a barrier), then its QKᵀ
    first_barrier = next(i for i, t in enumerate(body) if "BAR.SYNC" in t and i > mmas[0])
    assert any(i > first_barrier for i in mmas), config
    assert waits[0] > mmas[-1], config
    # P stays in its registers, untouched, while its P·V runs under the next tile's work
    assert wgmma_register_hazards(sass) == [], config
