"""The Gluon fp8 varlen prefill on an H100/H200 against the float64 torch reference on the
dequantized inputs.

Drives :func:`~mla.providers.gluon.prefill_fp8_launch.launch_gluon_fp8_prefill` directly (the
plain, producer and split warp layouts and the split layout's persistent form, 192/128 and
128/128, causal and not, 1/16/128 heads, LSE on and off, bf16/fp16/fp32 outputs) and the gluon
provider (its default ``fp8_prefill="gluon"``: its plan, the route, the contract's NaN rules,
CUDA graph capture). Batches hold empty and
one-token requests, requests with more queries than keys, and lengths that are not tile
multiples. Outputs are NaN-poisoned before each run. Run:
``pytest -m gpu tests/gluon/test_gpu_gluon_fp8_prefill.py`` (skipped without a Hopper GPU).

Tolerance: P is quantized to e4m3 for the fp8 ``P·V`` (:mod:`~mla.providers.gluon.prefill_fp8`),
which costs about 2-2.5% relative output error on these random inputs (a float64 emulation of
that quantization gave 1.9-2.5%); the Triton fp8 kernel (P in fp16) is held to 2e-2, this one to
:data:`OUT_TOL`. The LSE comes from the fp32 scores and the fp32 row sums: it is held to the
Triton kernel's 2e-3.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from varlen_batches import VARLEN_BATCHES

from mla.core.platform import detect_platform
from mla.providers import get_provider
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall
from mla.providers.gluon import GluonProvider
from mla.providers.gluon.prefill_fp8_launch import (
    GluonFp8PrefillPlan,
    fp8_prefill_route,
    launch_gluon_fp8_prefill,
    plan_gluon_fp8_prefill,
)
from mla.providers.gluon.prefill_launch import PrefillKernel, PrefillLaunchConfig
from mla.providers.quant import quantize_per_tensor
from mla.tools.reference import reference_prefill

pytestmark = pytest.mark.gpu

BATCHES = VARLEN_BATCHES
OUT_TOL = 4e-2
"""Relative output error (norm) allowed: P in e4m3 (see the module docstring)."""
LSE_TOL = 2e-3
E4M3 = torch.float8_e4m3fn
CONFIGS = {
    "producer": PrefillLaunchConfig(num_stages=4),
    "plain": PrefillLaunchConfig(num_stages=4, kernel=PrefillKernel.PLAIN),
    # (4 stages: the most that fit at 192/128 with the transposed V ring)
    "split": PrefillLaunchConfig(num_stages=4, kernel=PrefillKernel.SPLIT),
    "persistent": PrefillLaunchConfig(num_stages=4, kernel=PrefillKernel.PERSISTENT),
}


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    support = get_provider("gluon").availability()
    if not support:
        pytest.skip(f"the gluon provider is unavailable here: {support}")


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _call(
    batch: str, heads: int, dqk: int, causal: bool, seed: int, out_dtype: torch.dtype = torch.bfloat16,
    schedule: object = None,
) -> Fp8PrefillCall:  # fmt: skip
    lengths_q, lengths_k = BATCHES[batch]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens, keys = sum(lengths_q), sum(lengths_k)
    raw = [
        torch.randn(n, heads, d, device="cuda", generator=gen).bfloat16()
        for n, d in ((tokens, dqk), (keys, dqk), (keys, 128))
    ]
    (q, qs), (k, ks), (v, vs) = (quantize_per_tensor(x, E4M3) for x in raw)
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    if schedule is None:
        plan_call = Fp8PrefillPlanCall(
            cu_seqlens_q_cpu=cu_q.cpu(), cu_seqlens_k_cpu=cu_k.cpu(), num_heads=heads, causal=causal,
            platform=detect_platform(), device=q.device,
        )  # fmt: skip
        schedule = plan_gluon_fp8_prefill(plan_call, None)
    return Fp8PrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        out=torch.full((tokens, heads, 128), math.nan, dtype=out_dtype, device="cuda"),
        lse=torch.full((tokens, heads), math.nan, device="cuda"), schedule=schedule,
        softmax_scale=dqk**-0.5, q_scale=qs, k_scale=ks, v_scale=vs, causal=causal,
    )  # fmt: skip


def _dequantized(call: Fp8PrefillCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = ((call.q, call.q_scale), (call.k, call.k_scale), (call.v, call.v_scale))
    q, k, v = (x.double() * s.double() for x, s in pairs)
    return q, k, v


def _check(call: Fp8PrefillCall, *, lse_written: bool = True) -> float:
    """Asserts the contract against the reference; returns the relative output error."""
    q, k, v = _dequantized(call)
    ref_out, ref_lse = reference_prefill(
        q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, softmax_scale=call.softmax_scale, causal=call.causal
    )  # fmt: skip
    out64, lse64 = call.out.cpu().double(), call.lse.cpu().double()
    assert not torch.isnan(out64).any(), "unwritten (or NaN) output rows"
    err = float((out64 - ref_out).norm() / ref_out.norm().clamp_min(1e-30))
    assert err < OUT_TOL, f"relative output error {err:.3g}"
    finite = torch.isfinite(ref_lse)
    assert bool((out64[~finite] == 0).all()), "rows without keys must be 0"
    if not lse_written:
        assert bool(torch.isnan(lse64).all()), "the LSE was written without being asked for"
        return err
    assert not torch.isnan(lse64).any(), "unwritten lse rows"
    assert torch.equal(torch.isfinite(lse64), finite), "rows without keys must have lse = -inf"
    assert bool((lse64[~finite] == -math.inf).all())
    if bool(finite.any()):
        assert float((lse64[finite] - ref_lse[finite]).abs().max()) < LSE_TOL
    return err


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_prefill_matches_reference(batch: str, causal: bool, heads: int, config: str) -> None:
    if heads == 128 and batch == "long":
        pytest.skip("the float64 reference is slow at this size; 128 heads run the other batches")
    call = _call(batch, heads, 192, causal, seed=heads + len(batch))
    assert fp8_prefill_route(call)[0] == "gluon"
    launch_gluon_fp8_prefill(call, CONFIGS[config])
    _check(call)


VARIANTS = {
    # name: (dqk, out dtype, config)
    "d128": (128, torch.bfloat16, None),
    "d128-plain": (128, torch.bfloat16, CONFIGS["plain"]),
    "d128-split": (128, torch.bfloat16, CONFIGS["split"]),
    "split-stages-2": (192, torch.bfloat16, PrefillLaunchConfig(num_stages=2, kernel=PrefillKernel.SPLIT)),
    "split-n64": (192, torch.bfloat16, attrs.evolve(CONFIGS["split"], block_n=64)),
    "split-fp32-out": (192, torch.float32, CONFIGS["split"]),
    "d128-persistent": (128, torch.bfloat16, CONFIGS["persistent"]),
    "persistent-stages-2": (192, torch.bfloat16, attrs.evolve(CONFIGS["persistent"], num_stages=2)),
    "persistent-n64": (192, torch.bfloat16, attrs.evolve(CONFIGS["persistent"], block_n=64)),
    "persistent-fp16-out": (192, torch.float16, CONFIGS["persistent"]),
    "fp16-out": (192, torch.float16, None),
    "fp32-out": (192, torch.float32, None),
    "stages-2": (192, torch.bfloat16, PrefillLaunchConfig(num_stages=2)),
    "n64": (192, torch.bfloat16, PrefillLaunchConfig(block_n=64, num_stages=4)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("batch", ["mixed", "long"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_launch_variant_matches_reference(variant: str, batch: str, causal: bool) -> None:
    dqk, out_dtype, config = VARIANTS[variant]
    call = _call(batch, 3, dqk, causal, seed=11, out_dtype=out_dtype)
    launch_gluon_fp8_prefill(call, config)
    _check(call)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_lse_is_written_only_when_asked(causal: bool, config: str) -> None:
    call = _call("mixed", 4, 192, causal, seed=2)
    launch_gluon_fp8_prefill(call, CONFIGS[config], write_lse=False)
    _check(call, lse_written=False)


@pytest.mark.parametrize("causal", [True, False])
def test_default_provider_plans_and_runs_the_gluon_kernel(causal: bool) -> None:
    """``GluonProvider()`` (``fp8_prefill="gluon"``): its plan wraps the Triton plan, the call runs on
    the Gluon kernel and matches; the Triton fp8 kernel on the same inputs stays within its own
    2e-2 (P in fp16), the Gluon kernel within :data:`OUT_TOL` (P in e4m3)."""
    provider = GluonProvider()
    lengths_q, lengths_k = BATCHES["mixed"]
    heads = 16
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    plan = provider.plan_fp8_prefill(
        Fp8PrefillPlanCall(
            cu_seqlens_q_cpu=cu_q.cpu(), cu_seqlens_k_cpu=cu_k.cpu(), num_heads=heads, causal=causal,
            platform=detect_platform(), device=torch.device("cuda"),
        )
    )  # fmt: skip
    assert isinstance(plan, GluonFp8PrefillPlan)
    call = _call("mixed", heads, 192, causal, seed=4, schedule=plan)
    provider.fp8_prefill(call)
    gluon_err = _check(call)
    triton_call = _call("mixed", heads, 192, causal, seed=4, schedule=plan.triton)
    GluonProvider(fp8_prefill="triton").fp8_prefill(triton_call)
    triton_err = _check(triton_call)
    assert triton_err < 2e-2
    print(f"relative output error: gluon (P e4m3) {gluon_err:.4f}, triton (P fp16) {triton_err:.4f}")


@pytest.mark.parametrize("poisoned", ["kv", "v"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_nan_key_stays_in_the_rows_that_see_it(causal: bool, config: str, poisoned: str) -> None:
    """A NaN key (k and v, or only its value row: then only the kernel's per-key flags of a
    masked tile, or the unmasked P·V, can carry it) of request 1 shows in the rows that see it
    and never in requests 0 and 2 (whose tiles run into request 1's rows). Request 1's earlier
    rows (causal: the key's tile is a diagonal tile of theirs) stay finite on the layouts that
    clean every masked tile; the split and persistent layouts clean only tiles reaching past the
    request's keys, so there a later key of the row's own request may reach it as ``0·NaN``."""
    lengths = [33, 140, 7]
    gen = torch.Generator(device="cuda").manual_seed(9)
    tokens, heads = sum(lengths), 4
    raw = [torch.randn(tokens, heads, d, device="cuda", generator=gen) for d in (192, 192, 128)]
    bad = 33 + 70  # request 1's key 70
    raw[2][bad] = math.nan
    if poisoned == "kv":
        raw[1][bad] = math.nan
    (q, qs), (k, ks), (v, vs) = (quantize_per_tensor(x, E4M3) for x in raw)
    assert torch.isnan(v[bad].float()).all()
    assert bool(torch.isnan(k[bad].float()).all()) == (poisoned == "kv")
    cu = _indptr(lengths)
    plan = GluonFp8PrefillPlan(
        triton=None, max_seqlen_q=140, num_heads=heads, num_tokens=tokens, num_kv_tokens=tokens, causal=causal
    )
    call = Fp8PrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu,
        out=torch.full((tokens, heads, 128), math.nan, dtype=torch.bfloat16, device="cuda"),
        lse=torch.full((tokens, heads), math.nan, device="cuda"), schedule=plan, softmax_scale=192**-0.5,
        q_scale=qs, k_scale=ks, v_scale=vs, causal=causal,
    )  # fmt: skip
    launch_gluon_fp8_prefill(call, CONFIGS[config])
    sees = torch.zeros(tokens, dtype=torch.bool)
    sees[(bad if causal else 33) : 33 + 140] = True
    q64, k64, v64 = _dequantized(call)
    k64[bad], v64[bad] = 0, 0
    ref_out, _ref_lse = reference_prefill(q64, k64, v64, cu, cu, softmax_scale=192**-0.5, causal=causal)
    keep = ~sees
    if config in ("split", "persistent"):
        keep[33 : 33 + 140] = False  # (request 1's own rows: see the docstring)
    out_c = call.out.cpu()
    assert torch.isfinite(out_c[keep].float()).all()
    assert torch.isfinite(call.lse.cpu()[keep]).all()
    err = float((out_c[keep].double() - ref_out[keep]).norm() / ref_out[keep].norm())
    assert err < OUT_TOL
    assert torch.isnan(out_c[sees].float()).any(dim=-1).all(), "a NaN a row does see must show"


def test_fp8_prefill_captures_in_a_cuda_graph() -> None:
    """No host sync inside the launch (the scales are read on the device): it records into a
    CUDA graph and replays correctly."""
    call = _call("mixed", 8, 192, True, seed=6)
    launch_gluon_fp8_prefill(call)  # compile outside the capture
    torch.cuda.synchronize()
    call.out.fill_(math.nan)
    call.lse.fill_(math.nan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_gluon_fp8_prefill(call)
    graph.replay()
    torch.cuda.synchronize()
    _check(call)
