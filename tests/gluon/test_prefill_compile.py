"""The Gluon varlen prefill on a CPU: every kernel variant compiled for sm_90, every launch
recorded (as in ``test_host_launch.py``: a subprocess without the Triton interpreter runs the
launches under the stand-in driver, which runs Triton's compiler for sm_90, ptxas and the
shared-memory limit included, and records each launch instead of making it)."""

from __future__ import annotations

import glob
import json
import pathlib
import textwrap

import pytest
from sm90_compile import resource_usage, run_without_interpreter, sass_of, wgmma_register_hazards

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

pytestmark = pytest.mark.heavy  # (its fixture compiles every variant for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import attrs
    import torch
    from mla.providers.calls import AppendedKeys, VarlenPrefillCall
    from mla.providers.gluon.prefill_launch import PrefillKernel, PrefillLaunchConfig, launch_gluon_prefill
    from mla.providers.gluon.provider import GluonProvider
    from mla.testing.triton_driver import stand_in_driver

    LQ, LK = [100, 1, 0, 257], [300, 50, 10, 257]

    def indptr(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def call(dqk, dv, causal, dtype, heads=4, kv_slices=False, context=False):
        tq, tk = sum(LQ), sum(LK)
        q = torch.zeros(tq, heads, dqk, dtype=dtype)
        out, lse = torch.zeros(tq, heads, dv, dtype=dtype), torch.zeros(tq, heads)
        if context:  # a context chunk's pass: k_nope and v slices of the up-projection, the
            # latent's rope lanes as k_pe, merged into out/lse in place
            up = torch.zeros(tk, heads, dqk - 64 + dv, dtype=dtype)
            latent = torch.zeros(tk, 512 + 64, dtype=dtype)
            return VarlenPrefillCall(
                q=q, k=up[..., : dqk - 64], v=up[..., dqk - 64 :], cu_seqlens_q=indptr(LQ),
                cu_seqlens_k=indptr(LK), out=out, lse=lse, max_seqlen_q=max(LQ), max_seqlen_k=max(LK),
                softmax_scale=0.07, causal=causal, k_pe=latent[:, 512:], prior_out=out, prior_lse=lse)
        if kv_slices:  # k and v as head-dim slices of one [Tk, H, Dqk + Dv] buffer
            kv = torch.zeros(tk, heads, dqk + dv, dtype=dtype)
            k, v = kv[..., :dqk], kv[..., dqk:]
        else:
            k = torch.zeros(tk, heads, dqk, dtype=dtype)
            v = torch.zeros(tk, heads, dv, dtype=dtype)
        return VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=indptr(LQ), cu_seqlens_k=indptr(LK), out=out, lse=lse,
            max_seqlen_q=max(LQ), max_seqlen_k=max(LK), softmax_scale=0.07, causal=causal)

    bf16, fp16 = torch.bfloat16, torch.float16
    PLAIN = PrefillLaunchConfig(kernel=PrefillKernel.PLAIN)
    SPLIT = PrefillLaunchConfig(kernel=PrefillKernel.SPLIT)
    OVERLAP = PrefillLaunchConfig(block_n=64, num_stages=3, kernel=PrefillKernel.OVERLAP)
    PERSISTENT = PrefillLaunchConfig(kernel=PrefillKernel.PERSISTENT)
    cases = {
        # name: (dqk, dv, causal, dtype, write_lse, config)
        "192-causal-lse": (192, 128, True, bf16, True, None),
        "192-full-lse": (192, 128, False, bf16, True, None),
        "192-causal-nolse": (192, 128, True, bf16, False, None),
        "192-causal-fp16": (192, 128, True, fp16, True, None),
        "128-causal-lse": (128, 128, True, bf16, True, None),
        "128-full-nolse": (128, 128, False, fp16, False, None),
        "192-causal-plain": (192, 128, True, bf16, True, PLAIN),
        "128-full-plain": (128, 128, False, bf16, True, PLAIN),
        "192-causal-split": (192, 128, True, bf16, True, SPLIT),
        "192-full-split-nolse": (192, 128, False, bf16, False, SPLIT),
        "128-causal-split-fp16": (128, 128, True, fp16, True, attrs.evolve(SPLIT, num_stages=3)),
        "192-causal-n64": (192, 128, True, bf16, True, PrefillLaunchConfig(block_n=64, num_stages=3)),
        "192-causal-overlap-n64": (192, 128, True, bf16, True, OVERLAP),
        "192-full-overlap-nolse": (192, 128, False, bf16, False, OVERLAP),
        "128-causal-overlap-fp16": (
            128, 128, True, fp16, True, PrefillLaunchConfig(kernel=PrefillKernel.OVERLAP)
        ),
        "192-causal-persistent": (192, 128, True, bf16, True, PERSISTENT),
        "192-full-persistent-nolse": (192, 128, False, bf16, False, PERSISTENT),
        "128-causal-persistent-fp16": (128, 128, True, fp16, True, attrs.evolve(PERSISTENT, num_stages=3)),
    }
    out = {}
    with stand_in_driver(compile_kernels=True) as driver:
        for name, (dqk, dv, causal, dtype, lse, config) in cases.items():
            driver.launches.clear()
            launch_gluon_prefill(call(dqk, dv, causal, dtype), config, write_lse=lse)
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
        # through the provider: the Gluon kernel where the route takes the call
        for name, kwargs in {
            "provider-192": {},
            "provider-h128-slices": {"heads": 128, "kv_slices": True},
            "provider-context": {"heads": 16, "context": True},
        }.items():
            driver.launches.clear()
            causal = not kwargs.get("context", False)  # (a context chunk's pass is not causal)
            GluonProvider(prefill="gluon").varlen_attention(call(192, 128, causal, bf16, **kwargs))
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
        # a context chunk's pass on each layout that takes the chunked-context operands
        for name, config in {"context-split": SPLIT, "context-persistent": PERSISTENT}.items():
            driver.launches.clear()
            launch_gluon_prefill(call(192, 128, False, bf16, heads=16, context=True), config)
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
        # the first chunk's pass with the new tokens' keys appended (causal over them), fresh
        # outputs, through the provider: 128/128 without k_pe too
        for name, (dqk, k_pe) in {"appended-192": (192, True), "appended-128-whole": (128, False)}.items():
            driver.launches.clear()
            chunk = call(dqk, 128, False, bf16, heads=16, context=True)
            if not k_pe:
                chunk = attrs.evolve(chunk, k=torch.zeros(chunk.k.shape[0], 16, dqk, dtype=bf16), k_pe=None)
            new = call(dqk, 128, True, bf16, heads=16)
            keys = AppendedKeys(
                k=new.k[: sum(LQ)], v=new.v[: sum(LQ)], cu_seqlens_k=indptr(LQ), max_seqlen_k=max(LQ))
            fused = attrs.evolve(chunk, appended=keys, causal=True, prior_out=None, prior_lse=None,
                                 out=torch.zeros_like(chunk.out), lse=torch.zeros_like(chunk.lse))
            GluonProvider(prefill="gluon").varlen_attention(fused)
            out[name] = [[l.function[1], list(l.grid)] for l in driver.launches]
            driver.launches.clear()
            launch_gluon_prefill(fused, SPLIT)
            out[f"{name}-split"] = [[l.function[1], list(l.grid)] for l in driver.launches]
    json.dump(out, sys.stdout)
    """
)
KERNEL = "mla_prefill_kernel"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Triton's cache of the compile process: every variant's cubin."""
    return tmp_path_factory.mktemp("prefill-compile")


@pytest.fixture(scope="module")
def launches(cache_dir: pathlib.Path) -> dict[str, list[list[object]]]:
    stdout = run_without_interpreter(["-c", SCRIPT], cache_dir=cache_dir)
    result: dict[str, list[list[object]]] = json.loads(stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "case",
    [
        "192-causal-plain",
        "128-full-plain",
        "192-causal-split",
        "192-full-split-nolse",
        "128-causal-split-fp16",
        "192-causal-n64",
        "192-causal-overlap-n64",
        "192-full-overlap-nolse",
        "128-causal-overlap-fp16",
    ],
)
def test_every_one_tile_layout_compiles_and_launches(
    launches: dict[str, list[list[object]]], case: str
) -> None:
    # One program per (128-row query tile, request, head): 3 tiles (257 rows) x 4 requests x 4 heads.
    assert launches[case] == [[KERNEL, [3 * 4 * 4, 1, 1]]]


@pytest.mark.parametrize(
    "case",
    [
        "192-causal-persistent",
        "192-full-persistent-nolse",
        "128-causal-persistent-fp16",
        # the default launch (no config): the persistent layout
        "192-causal-lse",
        "192-full-lse",
        "192-causal-nolse",
        "192-causal-fp16",
        "128-causal-lse",
        "128-full-nolse",
        "provider-192",
    ],
)
def test_the_persistent_kernel_compiles_and_launches_one_program_per_sm(
    launches: dict[str, list[list[object]]], case: str
) -> None:
    # 48 query tiles over the recorder's 8 "SMs" (num_sms off a CUDA device)
    assert launches[case] == [["mla_prefill_persistent_kernel", [8, 1, 1]]]


def test_strided_kv_slices_and_128_heads_run_on_the_gluon_kernel(
    launches: dict[str, list[list[object]]],
) -> None:
    assert launches["provider-h128-slices"] == [["mla_prefill_persistent_kernel", [8, 1, 1]]]


def test_the_chunked_context_form_runs_on_the_gluon_kernel(launches: dict[str, list[list[object]]]) -> None:
    """A context chunk's pass (``k`` and ``v`` slices of the up-projection, the latent's rope
    lanes as ``k_pe``, merged into ``out``/``lse`` in place) compiles and launches on the
    split layout (one program per query tile, request and head) and on the persistent one."""
    assert launches["context-split"] == [[KERNEL, [3 * 4 * 16, 1, 1]]]
    assert launches["context-persistent"] == [["mla_prefill_persistent_kernel", [8, 1, 1]]]


def test_appended_keys_run_as_one_pass_on_the_split_layouts(launches: dict[str, list[list[object]]]) -> None:
    """A context chunk's call with the new tokens' keys appended (``AppendedKeys``): one launch
    of the persistent layout through the provider (its default), with ``k_pe`` (192/128) and
    with whole keys (128/128), and of the split layout when its launch config asks for it."""
    for name in ("appended-192", "appended-128-whole"):
        assert launches[name] == [["mla_prefill_persistent_kernel", [8, 1, 1]]]
        assert launches[f"{name}-split"] == [[KERNEL, [3 * 4 * 16, 1, 1]]]


def test_no_register_of_a_wgmma_is_touched_before_its_wait(
    launches: dict[str, list[list[object]]], cache_dir: pathlib.Path, cuobjdump: str
) -> None:
    """Every compiled variant (the layouts, head dims, dtypes and forms above): P·V's register-A
    operand and the accumulators stay untouched while their ``wgmma`` is in flight
    (:func:`sm90_compile.wgmma_register_hazards`)."""
    cubins = sorted(glob.glob(f"{cache_dir}/*/mla_prefill*_kernel.cubin"))
    assert len(cubins) >= len(launches) // 2, cubins  # (the provider cases reuse compiled variants)
    hazards = {pathlib.Path(c).parent.name: wgmma_register_hazards(sass_of(c, cuobjdump)) for c in cubins}
    assert {k: v for k, v in hazards.items() if v} == {}


def test_the_persistent_kernel_keeps_nothing_in_local_memory(
    launches: dict[str, list[list[object]]], cache_dir: pathlib.Path, cuobjdump: str
) -> None:
    """Every compiled variant of the persistent layout has no stack: no spill, and no value the
    partitions reload from local memory at each query tile (the grid size is read where it is
    used, :func:`mla.providers.gluon.prefill_rounds._grid`)."""
    cubins = sorted(glob.glob(f"{cache_dir}/*/mla_prefill_persistent_kernel.cubin"))
    assert cubins, launches
    stacks = {pathlib.Path(c).parent.name: resource_usage(c, cuobjdump) for c in cubins}
    assert {k: usage for k, (stack, usage) in stacks.items() if stack} == {}
