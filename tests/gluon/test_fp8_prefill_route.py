"""Host side of the Gluon fp8 varlen prefill on a CPU: which calls the Gluon fp8 kernel takes
(:func:`~mla.providers.gluon.prefill_fp8_launch.fp8_prefill_route`), its plan and launch
config, and the gluon provider's ``fp8_prefill`` option: the default (``"gluon"``) plans around
the Triton plan and runs the calls the route declines on the Triton kernels (in the
interpreter); ``"triton"`` plans and runs every fp8 prefill on them."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.core.platform import simulated_platform
from mla.providers.calls import Fp8PrefillCall, Fp8PrefillPlanCall
from mla.providers.gluon import GluonProvider, prefill_fp8_launch
from mla.providers.gluon.prefill_fp8_launch import (
    GluonFp8PrefillPlan,
    fp8_prefill_config,
    fp8_prefill_route,
    fp8_shared_bytes,
    launch_gluon_fp8_prefill,
    plan_gluon_fp8_prefill,
)
from mla.providers.gluon.prefill_launch import SHARED_MEMORY_BYTES, PrefillKernel, PrefillLaunchConfig
from mla.providers.quant import quantize_per_tensor
from mla.providers.triton.fp8_prefill import Fp8PrefillPlan
from mla.providers.triton.fp8_prefill import plan_fp8_prefill as triton_plan_fp8_prefill
from mla.tools.reference import reference_prefill

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
CU_Q = [0, 3, 3, 8]
CU_K = [0, 5, 6, 8]


def _plan(heads: int = 4, causal: bool = True, tokens: int = 8, keys: int = 8) -> GluonFp8PrefillPlan:
    return GluonFp8PrefillPlan(
        triton=None, max_seqlen_q=5, num_heads=heads, num_tokens=tokens, num_kv_tokens=keys, causal=causal
    )


def _call(dqk: int = 192, dv: int = 128, **change: object) -> Fp8PrefillCall:
    heads = 4
    fields: dict[str, object] = {
        "q": torch.zeros(8, heads, dqk, dtype=E4M3),
        "k": torch.zeros(8, heads, dqk, dtype=E4M3),
        "v": torch.zeros(8, heads, dv, dtype=E4M3),
        "cu_seqlens_q": torch.tensor(CU_Q, dtype=torch.int32),
        "cu_seqlens_k": torch.tensor(CU_K, dtype=torch.int32),
        "out": torch.zeros(8, heads, dv, dtype=torch.bfloat16),
        "lse": torch.zeros(8, heads),
        "schedule": _plan(),
        "softmax_scale": 0.1,
        "q_scale": torch.ones(()),
        "k_scale": torch.ones(1),
        "v_scale": torch.ones(()),
        "causal": True,
    }
    fields.update(change)
    return Fp8PrefillCall(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dqk", "dv"), [(192, 128), (128, 128)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_takes_e4m3_mla_dims(dqk: int, dv: int, out_dtype: torch.dtype) -> None:
    call = _call(dqk, dv, out=torch.zeros(8, 4, dv, dtype=out_dtype))
    kernel, why = fp8_prefill_route(call)
    assert kernel == "gluon", why
    assert f"{dqk}/{dv}" in why


def test_route_takes_head_dim_slices_of_one_buffer() -> None:
    kv = torch.zeros(8, 4, 320, dtype=E4M3)  # v starts 192 bytes into each head: 16-byte aligned
    kernel, why = fp8_prefill_route(_call(k=kv[..., :192], v=kv[..., 192:]))
    assert kernel == "gluon", why


def _misaligned() -> torch.Tensor:
    return torch.zeros(8 * 4 * 192 + 8, dtype=E4M3)[8:].view(8, 4, 192)


E5M2 = torch.float8_e5m2


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"schedule": object()}, "not a GluonFp8PrefillPlan"),
        ({"q": torch.zeros(8, 4, 192, dtype=E5M2)}, "query dtype torch.float8_e5m2"),
        ({"q": torch.zeros(8, 4, 192, dtype=torch.bfloat16)}, "query dtype torch.bfloat16"),
        ({"v": torch.zeros(8, 4, 128, dtype=E5M2)}, "mixed dtypes"),
        ({"q": torch.zeros(8, 4, 96, dtype=E4M3), "k": torch.zeros(8, 4, 96, dtype=E4M3)}, "dims 96/128"),
        ({"v": torch.zeros(8, 4, 64, dtype=E4M3), "out": torch.zeros(8, 4, 64, dtype=BF16)}, "192/64"),
        ({"k": torch.zeros(0, 4, 192, dtype=E4M3), "v": torch.zeros(0, 4, 128, dtype=E4M3)}, "no keys"),
        ({"out": torch.zeros(8, 4, 128, dtype=torch.float64)}, "output dtype"),
        ({"q_scale": torch.ones(2)}, "q_scale is not a one-element float32"),
        ({"k_scale": torch.ones((), dtype=torch.float64)}, "k_scale is not a one-element float32"),
        ({"v_scale": torch.ones((), device="meta")}, "v_scale is not a one-element float32"),
        ({"q": torch.zeros(8, 4, 200, dtype=E4M3)[..., :192]}, "head stride (200 elements)"),
        ({"q": torch.zeros(8, 4, 208, dtype=E4M3)[..., :192]}, None),  # 208-byte heads: aligned
        ({"k": torch.zeros(8, 4 * 192 + 8, dtype=E4M3)[:, :768].view(8, 4, 192)}, "token stride"),
        ({"v": torch.zeros(8, 128, 4, dtype=E4M3).transpose(1, 2)}, "last dim is not contiguous"),
        ({"k": _misaligned()}, "not 16-byte aligned"),
    ],
    ids=[
        "not-a-gluon-plan", "e5m2", "bf16", "mixed", "dims-96", "dv-64", "no-keys", "fp64-out",
        "scale-numel", "scale-dtype", "scale-device", "odd-head-stride", "padded-heads", "odd-token-stride",
        "strided-last-dim", "misaligned-base",
    ],
)  # fmt: skip
def test_route_sends_other_calls_to_triton(change: dict[str, Any], why: str | None) -> None:
    kernel, reason = fp8_prefill_route(attrs.evolve(_call(), **change))
    if why is None:
        assert kernel == "gluon", reason
    else:
        assert kernel == "triton", reason
        assert why in reason


def test_default_configs_fit_in_shared_memory() -> None:
    # the split layout's persistent form, 4 stages (MAX_STAGES) at both head dims
    for dqk in (192, 128):
        config = fp8_prefill_config(dqk, 128)
        assert config == PrefillLaunchConfig(block_n=128, num_stages=4, kernel=PrefillKernel.PERSISTENT)
        assert fp8_shared_bytes(dqk, 128, config) <= SHARED_MEMORY_BYTES
    assert fp8_shared_bytes(192, 128, PrefillLaunchConfig(num_stages=5)) > SHARED_MEMORY_BYTES
    assert (
        fp8_shared_bytes(192, 128, PrefillLaunchConfig(num_stages=4))
        == 128 * 192 + 4 * 128 * 320 + 128 * 128 + 136
    )


def test_split_layout_counts_its_transposed_v_ring() -> None:
    """The split layout: per stage a K tile, a transposed V tile and the stage's float32 flags,
    plus two V landing tiles (not one V tile a stage) and the query tile: 4 stages fit at
    192/128 (218 KiB), 5 do not; at 128/128 5 fit, 6 do not."""
    split = PrefillLaunchConfig(num_stages=4, kernel=PrefillKernel.SPLIT)
    assert fp8_shared_bytes(192, 128, split) == (
        128 * 192 + 4 * 128 * (192 + 128 + 4) + prefill_fp8_launch.SPLIT_V_LANDING * 128 * 128
        + 8 * (1 + 4 * 4 + 2)
    )  # fmt: skip
    assert prefill_fp8_launch.SPLIT_V_LANDING == 2
    fits = {
        (dqk, block_n, stages)
        for dqk in (192, 128)
        for block_n in (64, 128)
        for stages in range(2, 8)
        if fp8_shared_bytes(dqk, 128, attrs.evolve(split, block_n=block_n, num_stages=stages))
        <= SHARED_MEMORY_BYTES
    }
    assert {(192, 128, s) for s in range(2, 8)} & fits == {(192, 128, s) for s in (2, 3, 4)}
    assert {(128, 128, s) for s in range(2, 8)} & fits == {(128, 128, s) for s in (2, 3, 4, 5)}
    assert {(dqk, 64, s) for dqk in (192, 128) for s in range(2, 8)} <= fits
    # more than the producer layout at the same stages (a transposed V tile a stage)
    producer = attrs.evolve(split, kernel=PrefillKernel.PRODUCER)
    assert fp8_shared_bytes(192, 128, split) > fp8_shared_bytes(192, 128, producer)
    # the default is its persistent form, one barrier (q_empty) more
    persistent = attrs.evolve(split, kernel=PrefillKernel.PERSISTENT)
    assert fp8_shared_bytes(192, 128, persistent) == fp8_shared_bytes(192, 128, split) + 8
    assert fp8_prefill_config(192, 128).kernel is PrefillKernel.PERSISTENT


def test_launcher_refuses_declined_calls_other_warp_splits_and_plan_mismatches() -> None:
    with pytest.raises(InvalidInputError, match="Triton provider"):
        launch_gluon_fp8_prefill(_call(q=torch.zeros(8, 4, 192, dtype=E5M2)))
    with pytest.raises(InvalidInputError, match="PLAIN, PRODUCER, SPLIT, PERSISTENT warp splits") as overlap:
        launch_gluon_fp8_prefill(_call(), PrefillLaunchConfig(kernel=PrefillKernel.OVERLAP))
    assert overlap.value.argument == "config"
    for config in (
        PrefillLaunchConfig(num_stages=5),
        PrefillLaunchConfig(num_stages=5, kernel=PrefillKernel.SPLIT),
    ):
        with pytest.raises(InvalidInputError, match="shared memory") as refused:
            launch_gluon_fp8_prefill(_call(), config)
        assert refused.value.argument == "config"
        assert "at 192/128" in str(refused.value)
    for plan in (_plan(heads=2), _plan(causal=False), _plan(tokens=9), _plan(keys=7)):
        with pytest.raises(PlanMismatchError, match="rebuild it"):
            launch_gluon_fp8_prefill(_call(schedule=plan))


def _plan_call(causal: bool = True, heads: int = 4) -> Fp8PrefillPlanCall:
    return Fp8PrefillPlanCall(
        cu_seqlens_q_cpu=torch.tensor(CU_Q, dtype=torch.int32),
        cu_seqlens_k_cpu=torch.tensor(CU_K, dtype=torch.int32),
        num_heads=heads, causal=causal, platform=simulated_platform("sm90"), device=torch.device("cpu"),
    )  # fmt: skip


def test_plan_wraps_the_triton_plan_with_the_batch_sizes() -> None:
    plan = plan_gluon_fp8_prefill(_plan_call(), "triton-plan")
    assert plan.triton == "triton-plan"
    assert (plan.max_seqlen_q, plan.num_heads, plan.num_tokens, plan.num_kv_tokens, plan.causal) == (
        5,
        4,
        8,
        8,
        True,
    )


def test_fp8_prefill_triton_option_keeps_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fp8_prefill="triton"`` the provider's plan is the Triton plan and its fp8 prefill
    the Triton kernel's, even for a call the Gluon fp8 kernel would take."""
    monkeypatch.setattr(prefill_fp8_launch, "launch_gluon_fp8_prefill", _refuse)
    provider = GluonProvider(fp8_prefill="triton")
    assert repr(provider) == "GluonProvider(fp8_prefill='triton')"
    plan = provider.plan_fp8_prefill(_plan_call())
    assert isinstance(plan, Fp8PrefillPlan)
    ran: list[object] = []
    monkeypatch.setattr(provider._triton, "fp8_prefill", lambda call: ran.append(call.schedule))
    call = _call(schedule=plan)
    provider.fp8_prefill(call)
    assert ran == [plan]
    assert "Triton fp8 kernels (GluonProvider(fp8_prefill='triton'))" in str(
        provider.describe_probes()["fp8_prefill"]
    )


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("the Gluon fp8 kernel was launched")


def test_default_provider_launches_the_gluon_kernel_where_the_route_takes_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launched: list[tuple[Fp8PrefillCall, bool]] = []

    def record(call: Fp8PrefillCall, config: object, *, write_lse: bool, routed: bool) -> None:
        assert config is None
        assert write_lse
        launched.append((call, routed))

    monkeypatch.setattr(prefill_fp8_launch, "_launch", record)
    provider = GluonProvider()
    assert repr(provider) == "GluonProvider()"
    assert repr(GluonProvider(prefill="triton", fp8_prefill="triton")) == (
        "GluonProvider(prefill='triton', fp8_prefill='triton')"
    )
    plan = provider.plan_fp8_prefill(_plan_call())
    assert isinstance(plan, GluonFp8PrefillPlan)
    assert isinstance(plan.triton, Fp8PrefillPlan)
    monkeypatch.setattr(provider._triton, "fp8_prefill", _refuse)
    call = _call(schedule=plan)
    provider.fp8_prefill(call)
    assert launched == [(call, True)]  # (routed once, by the provider)
    note = provider.kernel_note(
        phase="prefill", q_dtype=E4M3, kv_dtype=E4M3, kv_lora_rank=512, rope_dim=64
    )  # fmt: skip
    assert note is not None
    assert "Gluon fp8 prefill kernel" in note


def test_invalid_fp8_prefill_option() -> None:
    with pytest.raises(InvalidInputError, match="fp8_prefill"):
        GluonProvider(fp8_prefill="cutlass")


def test_default_provider_runs_declined_calls_on_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """e4m3 48/32 is not a Gluon fp8 case: the default provider hands the Triton kernel the
    Triton plan inside its own (here in the interpreter) and matches the reference."""
    monkeypatch.setattr(prefill_fp8_launch, "launch_gluon_fp8_prefill", _refuse)
    gen = torch.Generator().manual_seed(5)
    heads, causal = 2, True
    cu_q, cu_k = torch.tensor(CU_Q, dtype=torch.int32), torch.tensor(CU_K, dtype=torch.int32)
    raw = [torch.randn(8, heads, d, generator=gen) for d in (48, 48, 32)]
    (q8, qs), (k8, ks), (v8, vs) = (quantize_per_tensor(x, E4M3) for x in raw)
    provider = GluonProvider()
    plan = provider.plan_fp8_prefill(_plan_call(causal, heads))
    assert isinstance(plan, GluonFp8PrefillPlan)
    out, lse = torch.full((8, heads, 32), math.nan), torch.full((8, heads), math.nan)
    call = Fp8PrefillCall(
        q=q8, k=k8, v=v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse, schedule=plan,
        softmax_scale=0.2, q_scale=qs, k_scale=ks, v_scale=vs, causal=causal,
    )  # fmt: skip
    assert fp8_prefill_route(call)[0] == "triton"
    provider.fp8_prefill(call)
    q64, k64, v64 = (x.double() * s.double() for x, s in ((q8, qs), (k8, ks), (v8, vs)))
    ref_out, ref_lse = reference_prefill(q64, k64, v64, cu_q, cu_k, softmax_scale=0.2, causal=causal)
    err = float((out.double() - ref_out).norm() / ref_out.norm())
    assert err < 2e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse.double()[finite] - ref_lse[finite]).abs().max()) < 2e-3
    # the Triton planner's plan is the same either way
    direct = triton_plan_fp8_prefill(cu_q, cu_k, num_heads=heads, causal=causal, device=torch.device("cpu"))
    assert isinstance(plan.triton, Fp8PrefillPlan)
    assert torch.equal(plan.triton.units, direct.units)
