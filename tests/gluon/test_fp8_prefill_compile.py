"""The Gluon fp8 varlen prefill on a CPU: every variant compiled for sm_90 (Triton's compiler and
ptxas, the shared-memory limit included, under :mod:`mla.testing.triton_driver`'s stand-in
driver, in a process without the Triton interpreter), each launch recorded, and the cubin read
with the ``cuobjdump`` Triton ships: no stack or local memory (no spills) and the tile loops
on fp8 ``wgmma`` (``QGMMA ... E4M3.E4M3``: QKᵀ and PV, nothing widened to 16 bits).

At ``1cf15b5`` (192/128, 128-key tiles, 4 stages): the producer kernel's consumer warps run at
240 registers (``setmaxnreg``) and the plain kernel at 242, no stack, 205 KB of shared memory.

The split layout (``PrefillKernel.SPLIT``, :mod:`mla.providers.gluon.prefill_fp8_split`): its two
consumer warpgroups at ``FP8_SPLIT_CONSUMER_REGS`` (224) registers, the 4-warp producer (TMA and
the V transpose) at what is left (56), no stack; 218 KiB of shared memory at 192/128 with 4
stages (Triton's count: 223,616 bytes). Its persistent form (``PrefillKernel.PERSISTENT``,
:mod:`mla.providers.gluon.prefill_fp8_persistent`, one program per SM) keeps the same budgets.
"""

from __future__ import annotations

import glob
import json
import re
import textwrap

import pytest
from sm90_compile import Compiled, compile_cases, mma_loops, resource_usage, sass_of, wgmma_register_hazards

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (compiles every variant for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import attrs
    import torch
    from mla.providers.calls import Fp8PrefillCall
    from mla.providers.gluon.prefill_fp8_launch import (
        GluonFp8PrefillPlan, fp8_prefill_config, launch_gluon_fp8_prefill)
    from mla.providers.gluon.prefill_fp8 import mla_fp8_prefill_kernel
    from mla.providers.gluon.prefill_fp8_persistent import mla_fp8_prefill_persistent_kernel
    from mla.providers.gluon.prefill_launch import PrefillKernel
    from mla.providers.gluon.provider import GluonProvider
    from mla.testing.triton_driver import stand_in_driver

    LQ, LK = [100, 1, 0, 257], [300, 50, 10, 257]
    dqk, causal, lse = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
    kernel, via, stages, block_n = sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7])

    def indptr(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    heads, dv, f8 = 4, 128, torch.float8_e4m3fn
    tq, tk = sum(LQ), sum(LK)
    plan = GluonFp8PrefillPlan(
        triton=None, max_seqlen_q=max(LQ), num_heads=heads, num_tokens=tq, num_kv_tokens=tk, causal=causal)
    call = Fp8PrefillCall(
        q=torch.zeros(tq, heads, dqk, dtype=f8), k=torch.zeros(tk, heads, dqk, dtype=f8),
        v=torch.zeros(tk, heads, dv, dtype=f8), cu_seqlens_q=indptr(LQ), cu_seqlens_k=indptr(LK),
        out=torch.zeros(tq, heads, dv, dtype=torch.bfloat16), lse=torch.zeros(tq, heads), schedule=plan,
        softmax_scale=0.07, q_scale=torch.ones(()), k_scale=torch.ones(()), v_scale=torch.ones(()),
        causal=causal)
    config = attrs.evolve(fp8_prefill_config(dqk, dv), kernel=PrefillKernel[kernel])
    if stages:  # (0: the default config's)
        config = attrs.evolve(config, num_stages=stages, block_n=block_n)
    # (the cases share a process: compile each into its own cache dir, launching on this driver)
    mla_fp8_prefill_kernel.device_caches.clear()
    mla_fp8_prefill_persistent_kernel.device_caches.clear()
    with stand_in_driver(compile_kernels=True) as driver:
        if via == "provider":
            GluonProvider(fp8_prefill="gluon").fp8_prefill(call)
        else:
            launch_gluon_fp8_prefill(call, config, write_lse=lse)
        print(json.dumps([[l.function[1], list(l.grid)] for l in driver.launches]))
    """
)
KERNEL = "mla_fp8_prefill_kernel"
CASES = {
    # name: (dqk, causal, write_lse, kernel, via[, stages, block_n]: the default config's without)
    "192-causal-lse": (192, True, True, "PRODUCER", "launcher"),
    "192-causal-nolse": (192, True, False, "PRODUCER", "launcher"),
    "192-full-lse": (192, False, True, "PRODUCER", "launcher"),
    "192-full-nolse": (192, False, False, "PRODUCER", "launcher"),
    "128-causal-lse": (128, True, True, "PRODUCER", "launcher"),
    "128-causal-nolse": (128, True, False, "PRODUCER", "launcher"),
    "128-full-lse": (128, False, True, "PRODUCER", "launcher"),
    "128-full-nolse": (128, False, False, "PRODUCER", "launcher"),
    "192-causal-plain": (192, True, True, "PLAIN", "launcher"),
    "128-full-plain-nolse": (128, False, False, "PLAIN", "launcher"),
    "provider-192": (192, True, True, "PERSISTENT", "provider"),  # (the default launch)
    # the split layout (4 stages: the most that fit at 192/128)
    "192-causal-split-lse": (192, True, True, "SPLIT", "launcher"),
    "192-causal-split-nolse": (192, True, False, "SPLIT", "launcher"),
    "192-full-split-lse": (192, False, True, "SPLIT", "launcher"),
    "192-full-split-nolse": (192, False, False, "SPLIT", "launcher"),
    "128-causal-split-lse": (128, True, True, "SPLIT", "launcher"),
    "128-causal-split-nolse": (128, True, False, "SPLIT", "launcher"),
    "128-full-split-lse": (128, False, True, "SPLIT", "launcher"),
    "128-full-split-nolse": (128, False, False, "SPLIT", "launcher"),
    "192-causal-split-2stages": (192, True, True, "SPLIT", "launcher", 2, 128),
    "128-causal-split-5stages": (128, True, True, "SPLIT", "launcher", 5, 128),
    "192-causal-split-n64": (192, True, True, "SPLIT", "launcher", 4, 64),
    # the split layout, persistent
    "192-causal-persistent-lse": (192, True, True, "PERSISTENT", "launcher"),
    "192-full-persistent-nolse": (192, False, False, "PERSISTENT", "launcher"),
    "128-causal-persistent-lse": (128, True, True, "PERSISTENT", "launcher"),
    "192-causal-persistent-2stages": (192, True, True, "PERSISTENT", "launcher", 2, 128),
    "192-causal-persistent-n64": (192, True, True, "PERSISTENT", "launcher", 4, 64),
}
SPLIT_CASES = sorted(name for name, case in CASES.items() if case[3] in ("SPLIT", "PERSISTENT"))
PERSISTENT_KERNEL = "mla_fp8_prefill_persistent_kernel"


def _kernel(case: str) -> str:
    """The kernel a case launches."""
    return PERSISTENT_KERNEL if CASES[case][3] == "PERSISTENT" else KERNEL


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compiled]:
    cases = {
        name: [str(dqk), str(int(causal)), str(int(lse)), kernel, via, *map(str, (*config, 0, 0)[:2])]
        for name, (dqk, causal, lse, kernel, via, *config) in CASES.items()
    }
    return compile_cases(SCRIPT, cases, tmp_path_factory.mktemp("fp8-prefill"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_fp8_prefill_variant_compiles_without_spills(
    compiled: dict[str, Compiled], cuobjdump: str, case: str
) -> None:
    launches = json.loads(compiled[case].stdout().strip().splitlines()[-1])
    # One program per (128-row query tile, request, head): 3 tiles (257 rows) x 4 requests x 4 heads;
    # the persistent layout one per SM (the stand-in driver's 8).
    programs = 8 if _kernel(case) == PERSISTENT_KERNEL else 3 * 4 * 4
    assert launches == [[_kernel(case), [programs, 1, 1]]]
    (cubin,) = glob.glob(f"{compiled[case].cache_dir}/*/{_kernel(case)}.cubin")
    stack, usage = resource_usage(cubin, cuobjdump)
    local = re.search(r"LOCAL:(\d+)", usage)
    assert local is not None, usage
    assert (stack, int(local.group(1))) == (0, 0), f"spills: {usage.strip()}"
    sass = sass_of(cubin, cuobjdump)
    mmas = set(re.findall(r"\b([A-Z]GMMA\.\S+)", sass))
    assert mmas, "no wgmma in the SASS"
    assert all(".E4M3.E4M3" in mma for mma in mmas), f"not every wgmma is an e4m3 one: {sorted(mmas)}"


def _sass(compiled: Compiled, cuobjdump: str, kernel: str = KERNEL) -> str:
    (cubin,) = glob.glob(f"{compiled.cache_dir}/*/{kernel}.cubin")
    return sass_of(cubin, cuobjdump)


def _softmax_loops(compiled: Compiled, cuobjdump: str, case: str) -> list[list[str]]:
    """The loops of the case's kernel that issue ``wgmma``s and exponentials (its consumers' key
    tiles; :func:`sm90_compile.mma_loops`), once the case compiled."""
    compiled.stdout()  # (asserts that the case compiled)
    loops = mma_loops(_sass(compiled, cuobjdump, _kernel(case)), ("GMMA",))
    return [body for body in loops if any("MUFU.EX2" in t for t in body)]


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_layout_register_budgets(compiled: dict[str, Compiled], cuobjdump: str, case: str) -> None:
    """The split layout launches 4 warps (its producer) and two 4-warp consumer partitions:
    ``setmaxnreg`` gives each consumer warpgroup ``FP8_SPLIT_CONSUMER_REGS`` and the producer
    what is left of the register file (56 of 504 - 2 x 224), with no spills (the test above)."""
    from mla.providers.gluon.prefill_fp8_launch import SPLIT_V_LANDING, fp8_shared_bytes
    from mla.providers.gluon.prefill_fp8_split import FP8_SPLIT_CONSUMER_REGS, V_LANDING
    from mla.providers.gluon.prefill_launch import PrefillKernel, PrefillLaunchConfig

    compiled[case].stdout()  # (asserts that the case compiled)
    sass = _sass(compiled[case], cuobjdump, _kernel(case))
    (meta_path,) = glob.glob(f"{compiled[case].cache_dir}/*/{_kernel(case)}.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["num_warps"] == 4 + 2 * 4  # (the launch's 4 and two 4-warp partitions)
    # the host's count (what the launcher checks against the limit) is Triton's, but for alignment
    assert V_LANDING.value == SPLIT_V_LANDING
    dqk, _causal, _lse, kernel, _via, *config = CASES[case]
    stages, block_n = config or (4, 128)
    counted = fp8_shared_bytes(
        dqk, 128, PrefillLaunchConfig(block_n=block_n, num_stages=stages, kernel=PrefillKernel[kernel])
    )
    assert 0 <= meta["shared"] - counted <= 1024, (meta["shared"], counted)
    allocs = [int(x, 16) for x in re.findall(r"SETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", sass)]
    deallocs = [int(x, 16) for x in re.findall(r"SETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass)]
    # (each partition first gives registers back to 120, then the consumers take theirs)
    assert allocs.count(FP8_SPLIT_CONSUMER_REGS.value) == 2, sorted(set(allocs))
    producer = min(deallocs)
    assert producer == 504 - 2 * FP8_SPLIT_CONSUMER_REGS.value, sorted(set(deallocs))
    # the consumers' wgmmas: QKᵀ (M 64, N = block_n) and P·V (M 64, N = Dv = 128), e4m3 only
    mmas = set(re.findall(r"\b([A-Z]GMMA\.64x\d+x32\.\S+)", sass))
    assert mmas, "no M-64 wgmma"
    assert all(".E4M3.E4M3" in mma for mma in mmas), sorted(mmas)


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_layout_p_becomes_the_operand_without_shuffles(
    compiled: dict[str, Compiled], cuobjdump: str, case: str
) -> None:
    """The split layout's consumers read the keys of ``P·V`` in the order of
    ``prefill_fp8_parts._pv_key_order`` (the producer writes V^T in it), in which the fp32
    scores' registers already hold the 8-bit operand's 4-key groups: no key loop moves P between
    threads (``SHFL.IDX``; the row maxima and sums still use ``SHFL.BFLY``). In natural key order
    each step shuffled 16 times."""
    loops = _softmax_loops(compiled[case], cuobjdump, case)
    # two consumers: unmasked and masked tiles (persistent: each pair inside its query-tile loop)
    outer = 2 if _kernel(case) == PERSISTENT_KERNEL else 0
    assert len(loops) == 4 + outer, [len(body) for body in loops]
    for body in sorted(loops, key=len)[:4]:
        assert not [t for t in body if t.startswith("SHFL.IDX")]
        assert any(t.startswith("SHFL.BFLY") for t in body)


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_register_of_a_wgmma_is_touched_before_its_wait(
    compiled: dict[str, Compiled], cuobjdump: str, case: str
) -> None:
    """P·V's register-A operand (P in e4m3) and the accumulators of every variant stay untouched
    while their ``wgmma`` is in flight (:func:`sm90_compile.wgmma_register_hazards`)."""
    assert wgmma_register_hazards(_sass(compiled[case], cuobjdump, _kernel(case))) == []
