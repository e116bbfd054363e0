"""Probes decide the record: a missing kernel removes only what needs it, with the reason."""

from __future__ import annotations

import attrs
import pytest
import torch
from aiter_cases import decode_case, fake_provider, fp8_for, prefill_case, run_decode, run_prefill

from mla import (
    AsmNonPersistent,
    GluonDecode,
    KVCacheSpec,
    MLADims,
    PaddedAsmPersistent,
    Resolver,
    UnsupportedError,
    prefill_context,
)
from mla.core.capabilities import Contract
from mla.core.platform import simulated_platform
from mla.prefill.flash_varlen import FlashVarlen
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.providers.aiter import AiterProvider

GFX950 = simulated_platform("gfx950")


def _caps(provider: AiterProvider, arch: str = "gfx950"):  # type: ignore[no-untyped-def]
    return provider.capabilities(simulated_platform(arch))


def test_a_complete_build_on_gfx950_has_every_dense_contract(fake_aiter) -> None:
    fake_aiter("gfx950")
    caps = _caps(fake_provider())
    # Sparse attention and the indexer are not claimed on any aiter build (its record says why).
    assert caps.contracts == frozenset(Contract) - {Contract.SPARSE_ATTENTION, Contract.INDEXER}
    assert caps.kv_dtypes == frozenset({torch.bfloat16, torch.float8_e4m3fn})


def test_gfx942_has_no_gluon_or_fp8_prefill_and_reads_fnuz(fake_aiter) -> None:
    fake_aiter("gfx942")
    caps = _caps(fake_provider(), "gfx942")
    assert Contract.SMALL_HEAD_DECODE not in caps.contracts
    assert Contract.FP8_PREFILL not in caps.contracts
    assert caps.kv_dtypes == frozenset({torch.bfloat16, torch.float8_e4m3fnuz})


def test_without_gluon_only_the_gluon_strategies_become_unsupported(fake_aiter) -> None:
    fake_aiter("gfx950", gluon_modules=())
    provider = fake_provider()
    assert not provider.probes.gluon.ok  # type: ignore[union-attr]
    assert "mla_gluon not found" in provider.describe_probes()["gluon_small_head"]  # type: ignore[operator]
    case = decode_case(8, (1, 1), (30, 9))
    with pytest.raises(UnsupportedError, match="small-head-decode kernel"):
        run_decode(provider, "gfx950", case, force=GluonDecode)
    run = run_decode(provider, "gfx950", case)
    assert run.strategy == PaddedAsmPersistent.NAME
    assert run.comparison.ok, run.comparison


def test_the_legacy_gluon_module_is_used_when_the_current_one_is_missing(fake_aiter) -> None:
    fake = fake_aiter("gfx950", gluon_modules=("mla_decode_gluon",))
    provider = fake_provider()
    assert str(provider.describe_probes()["gluon_small_head"]).endswith("mla_decode_gluon.mla_decode_gluon")
    run = run_decode(provider, "gfx950", decode_case(4, (1, 1, 1), (30, 9, 17)))
    assert run.strategy == GluonDecode.NAME
    assert run.comparison.ok, run.comparison
    assert fake.calls("mla_decode_gluon")
    assert not fake.calls("mla_gluon")


def test_without_metadata_v1_only_the_persistent_strategy_goes(fake_aiter) -> None:
    fake = fake_aiter("gfx950", omit=("get_mla_metadata_v1",))
    provider = fake_provider()
    caps = _caps(provider)
    assert Contract.DECODE_SCHEDULE not in caps.contracts
    assert Contract.PAGED_DECODE in caps.contracts
    run = run_decode(provider, "gfx950", decode_case(16, (1, 1), (30, 9)))
    assert run.strategy == AsmNonPersistent.NAME
    assert run.comparison.ok, run.comparison
    assert all(not call["persistent"] for call in fake.calls("mla_decode_fwd"))
    with pytest.raises(UnsupportedError, match="decode-schedule kernel"):
        run_decode(provider, "gfx950", decode_case(16, (1, 1), (30, 9)), force=PaddedAsmPersistent)


def test_without_the_fp8_prefill_kernels_prefill_falls_back_to_flash(fake_aiter) -> None:
    fake_aiter("gfx950", omit=("mla_prefill_ps_asm_fwd",))
    provider = fake_provider()
    assert "lacks aiter.mla_prefill_ps_asm_fwd" in str(provider.describe_probes()["fp8_prefill"])
    case = prefill_case(16, (7, 12))
    strategy, comparison = run_prefill(provider, "gfx950", case, fp8_prefill="on")
    assert strategy == FlashVarlen.NAME
    assert comparison.ok, comparison
    with pytest.raises(UnsupportedError, match="fp8-prefill kernel"):
        run_prefill(provider, "gfx950", case, force=Fp8PersistentPrefill)


def test_without_flash_attn_varlen_only_the_fp8_prefill_remains(fake_aiter) -> None:
    fake_aiter("gfx950", omit=("flash_attn_varlen_func",))
    provider = fake_provider()
    caps = _caps(provider)
    assert Contract.VARLEN_PREFILL not in caps.contracts

    def explain(chunked: bool):  # type: ignore[no-untyped-def]
        ctx = prefill_context(
            dims=MLADims(16, softmax_scale=192**-0.5),
            cache=KVCacheSpec(16, torch.float8_e4m3fn),
            q_dtype=torch.bfloat16,
            platform=GFX950,
            capabilities=caps,
            availability=provider.availability(),
            has_chunked_context=chunked,
        )
        return Resolver().explain(ctx)

    plain = explain(False)
    assert plain.chosen == Fp8PersistentPrefill.NAME
    assert plain.candidate(FlashVarlen.NAME).reasons[0].code == "missing-kernel"
    assert explain(True).chosen is None  # chunked context needs the varlen kernel
    with pytest.raises(UnsupportedError, match="varlen-prefill kernel"):
        run_prefill(provider, "gfx950", prefill_case(16, (7, 12)), fp8_prefill="on")


@pytest.mark.parametrize("signature", ["no_return_lse", "legacy"])
def test_an_old_mla_decode_fwd_still_gives_the_lse(fake_aiter, signature: str) -> None:
    fake = fake_aiter("gfx942", decode_signature=signature)
    provider = fake_provider()
    assert not provider.probes.decode_returns_lse  # type: ignore[union-attr]
    assert provider.describe_probes()["decode_lse"] == "reference pass (no return_lse)"
    for case in (
        decode_case(16, (1, 1, 0), (30, 9, 0), extra_rows=2),
        decode_case(8, (3, 3), (30, 9), kv_dtype=fp8_for("gfx942"), max_decode_qlen=4),
    ):
        run = run_decode(provider, "gfx942", case)
        assert run.comparison.ok, (case.id, run.comparison)
    assert all(not call["return_lse"] for call in fake.calls("mla_decode_fwd"))


def test_a_reduce_without_num_kv_splits_is_called_without_it(fake_aiter) -> None:
    fake = fake_aiter("gfx950", reduce_signature="legacy", cu_num=32)
    provider = fake_provider()
    assert not provider.probes.reduce_takes_num_kv_splits  # type: ignore[union-attr]
    strategy, comparison = run_prefill(provider, "gfx950", prefill_case(16, (300, 40)), fp8_prefill="on")
    assert strategy == Fp8PersistentPrefill.NAME
    assert comparison.ok, comparison
    assert [call["num_kv_splits"] for call in fake.calls("mla_reduce_v1")] == [None]


@pytest.mark.parametrize(
    ("reducer", "planner", "arch", "native"),
    [
        (True, True, "gfx950", True),
        (True, False, "gfx950", False),
        (False, True, "gfx950", False),
        (True, True, "gfx942", False),
    ],
)
def test_native_h24_needs_the_reducer_and_the_planner(fake_aiter, reducer, planner, arch, native) -> None:  # type: ignore[no-untyped-def]
    fake_aiter(arch, h24_reducer=reducer, h24_planner=planner)
    provider = fake_provider()
    assert provider.probes.native_h24 == (reducer and planner)  # type: ignore[union-attr]
    caps = _caps(provider, arch)
    assert (24 in caps.native_head_counts) == native
    assert caps.padded_heads(24) == (24 if native else 32)


def test_native_h24_runs_24_heads_and_fp8_runs_them_as_32(fake_aiter) -> None:
    fake = fake_aiter("gfx950", h24_reducer=True, h24_planner=True)
    provider = fake_provider()
    bf16 = run_decode(provider, "gfx950", decode_case(24, (1, 1), (30, 9)))
    assert bf16.strategy == PaddedAsmPersistent.NAME
    assert bf16.comparison.ok, bf16.comparison
    assert {call["heads"] for call in fake.calls("mla_decode_fwd")} == {24}
    fp8 = run_decode(provider, "gfx950", decode_case(24, (2, 1), (30, 9), kv_dtype=torch.float8_e4m3fn))
    assert fp8.comparison.ok, fp8.comparison
    assert fake.calls("mla_decode_fwd")[-1]["heads"] == 32


def test_overrides_simulate_a_build_without_aiter_installed() -> None:
    assert 24 in AiterProvider(native_h24=True).capabilities(GFX950).native_head_counts
    assert (
        24 not in AiterProvider(native_h24=True).capabilities(simulated_platform("gfx942")).native_head_counts
    )
    assert Contract.SMALL_HEAD_DECODE not in AiterProvider(gluon=False).capabilities(GFX950).contracts
    assert (
        Contract.SMALL_HEAD_DECODE
        not in AiterProvider(gluon=True).capabilities(simulated_platform("gfx942")).contracts
    )
    assert "native_h24=True" in str(AiterProvider(native_h24=True).describe_probes()["overrides"])


def test_a_decode_without_q_and_kv_scales_takes_no_fp8_cache(fake_aiter) -> None:
    fake_aiter("gfx950")
    provider = fake_provider()
    probes = provider.probes
    assert probes is not None
    provider.__dict__["probes"] = attrs.evolve(probes, decode_params=frozenset({"return_lse"}))
    caps = _caps(provider)
    assert caps.kv_dtypes == frozenset({torch.bfloat16})
    assert Contract.PAGED_DECODE in caps.contracts


def test_an_fp8_cache_in_the_other_fp8_format_is_rejected_before_any_kernel(fake_aiter) -> None:
    fake = fake_aiter("gfx942")
    case = decode_case(16, (1, 1), (30, 9), kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match="float8_e4m3fnuz"):
        run_decode(fake_provider(), "gfx942", case)
    assert not fake.calls("mla_decode_fwd")
