"""The resolver: the decision table of issue 2 as a golden test, forced selection, overrides,
and one negative test per rejection rule of every strategy (asserting its reason code)."""

from __future__ import annotations

import attrs
import pytest
import torch

import mla
from mla import (
    Contract,
    EngineLimits,
    Knobs,
    KVCacheSpec,
    MLADims,
    Resolver,
    Support,
    UnsupportedError,
    aiter_capabilities,
    decode_context,
    prefill_context,
    simulated_platform,
)
from mla.core.capabilities import REFERENCE_CAPABILITIES, PagedKernel, ProviderCapabilities
from mla.core.context import DecodeContext, PrefillContext
from mla.providers.aiter.capabilities import AITER_GET_BLOCK_N_FP8_KEYS
from mla.testing import (
    emulated_provider,
    scratch_registry,
    simulated_decode_context,
    simulated_prefill_context,
)

BF16 = torch.bfloat16
AVAILABLE = Support.yes()

GLUON, VERIFY = "gluon-decode", "gluon-verify-flatten"
PERSISTENT, NONPERSISTENT = "asm-padded-persistent", "asm-non-persistent"
FP8_PREFILL, FLASH = "fp8-persistent-prefill", "flash-varlen"


def decode_ctx(
    arch: str = "gfx950",
    heads: int = 8,
    qlen: int = 1,
    max_decode_qlen: int = 1,
    kv: str = "bf16",
    mode: str = "auto",
    *,
    uniform: bool = True,
    q_dtype: torch.dtype = BF16,
    caps: ProviderCapabilities | None = None,
    availability: Support = AVAILABLE,
    native_h24: bool = False,
) -> DecodeContext:
    """A decode step as the backend describes it, with aiter's capabilities on ``arch``."""
    return simulated_decode_context(
        arch,
        heads=heads,
        qlen=qlen,
        max_decode_qlen=max_decode_qlen,
        kv_dtype=kv,
        q_dtype=q_dtype,
        uniform_qlen=uniform,
        knobs=Knobs(small_head_mode=mode),  # type: ignore[arg-type]
        provider="aiter",
        native_h24=native_h24,
        capabilities=caps,
        availability=availability,
    )


def prefill_ctx(
    arch: str = "gfx950",
    heads: int = 16,
    kv: str = "fp8",
    fp8_prefill: str = "auto",
    *,
    chunked: bool = False,
    q_dtype: torch.dtype = BF16,
    caps: ProviderCapabilities | None = None,
    availability: Support = AVAILABLE,
) -> PrefillContext:
    return simulated_prefill_context(
        arch,
        heads=heads,
        kv_dtype=kv,
        q_dtype=q_dtype,
        chunked_context=chunked,
        knobs=Knobs(fp8_prefill=fp8_prefill),  # type: ignore[arg-type]
        provider="aiter",
        capabilities=caps,
        availability=availability,
    )


# -- the decision table (issue 2), golden ---------------------------------------------------------

# (arch, heads, qlen, max decode qlen, kv, mode) -> chosen, and per candidate the reason codes it
# must report (empty: supported), in the explanation's preference order.
DECODE_TABLE = [
    (("gfx950", 8, 1, 1, "bf16", "auto"), GLUON,
     {GLUON: (), VERIFY: ("qlen",), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx950", 4, 1, 1, "bf16", "auto"), GLUON,
     {GLUON: (), VERIFY: ("qlen",), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx950", 12, 1, 1, "bf16", "auto"), PERSISTENT,
     {PERSISTENT: (), NONPERSISTENT: (), GLUON: (), VERIFY: ("qlen",)}),
    (("gfx950", 12, 1, 1, "bf16", "gluon"), GLUON,
     {GLUON: (), VERIFY: ("qlen",), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx950", 8, 1, 1, "bf16", "asm"), PERSISTENT,
     {PERSISTENT: (), NONPERSISTENT: (), GLUON: (), VERIFY: ("qlen",)}),
    (("gfx950", 12, 3, 4, "bf16", "auto"), VERIFY,
     {GLUON: ("qlen",), VERIFY: (), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx950", 8, 1, 1, "fp8", "auto"), PERSISTENT,
     {GLUON: ("kv-dtype",), VERIFY: ("kv-dtype", "qlen"), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx942", 8, 1, 1, "bf16", "auto"), PERSISTENT,
     {GLUON: ("missing-kernel",), VERIFY: ("missing-kernel", "qlen"), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx942", 8, 3, 4, "bf16", "auto"), PERSISTENT,
     {GLUON: ("missing-kernel", "qlen"), VERIFY: ("missing-kernel",), PERSISTENT: (), NONPERSISTENT: ()}),
    (("gfx942", 8, 6, 8, "bf16", "auto"), NONPERSISTENT,
     {GLUON: ("missing-kernel", "qlen"), VERIFY: ("missing-kernel",), PERSISTENT: ("kernel-table",),
      NONPERSISTENT: ()}),
    (("gfx950", 8, 6, 8, "fp8", "auto"), PERSISTENT,
     {GLUON: ("kv-dtype", "qlen"), VERIFY: ("kv-dtype",), PERSISTENT: (),
      NONPERSISTENT: ("kernel-table",)}),
    (("gfx942", 16, 1, 1, "bf16", "auto"), PERSISTENT,
     {PERSISTENT: (), NONPERSISTENT: (), GLUON: ("missing-kernel", "heads"),
      VERIFY: ("missing-kernel", "heads", "qlen")}),
    (("gfx942", 130, 1, 1, "bf16", "auto"), None,
     {PERSISTENT: ("heads",), NONPERSISTENT: ("heads",), GLUON: ("missing-kernel", "heads"),
      VERIFY: ("missing-kernel", "heads", "qlen")}),
]  # fmt: skip


def _row_id(row: tuple[object, ...]) -> str:
    return "-".join(str(x) for x in row[0]) + f"->{row[1]}"  # type: ignore[index]


def _assert_candidates(explanation: mla.Explanation, expected: dict[str, tuple[str, ...]]) -> None:
    assert [c.name for c in explanation.candidates] == list(expected)
    for cand in explanation.candidates:
        codes = tuple(r.code for r in cand.reasons)
        assert cand.supported == (not expected[cand.name]), (cand.name, codes)
        assert set(expected[cand.name]) <= set(codes), (cand.name, codes)
        for reason in cand.reasons:
            assert reason.message


@pytest.mark.parametrize(
    ("row", "chosen", "candidates"), DECODE_TABLE, ids=[_row_id(r) for r in DECODE_TABLE]
)
def test_decode_table_resolve(row: tuple, chosen: str | None, candidates: dict[str, tuple[str, ...]]) -> None:  # type: ignore[type-arg]
    ctx = decode_ctx(*row)
    resolver = Resolver()
    if chosen is None:
        with pytest.raises(UnsupportedError) as info:
            resolver.resolve(ctx)
        message = str(info.value)
        # The head-count rule, named with the observed value.
        assert "130 heads" in message
        assert "H <= 128 or H % 16 == 0" in message
        assert info.value.explanation is not None
        assert info.value.explanation.chosen is None
        return
    decision = resolver.resolve(ctx)
    assert decision.name == chosen
    assert chosen == decision.strategy.NAME
    assert not decision.forced
    assert decision.explanation.chosen == chosen


@pytest.mark.parametrize(
    ("row", "chosen", "candidates"), DECODE_TABLE, ids=[_row_id(r) for r in DECODE_TABLE]
)
def test_decode_table_explain(row: tuple, chosen: str | None, candidates: dict[str, tuple[str, ...]]) -> None:  # type: ignore[type-arg]
    explanation = Resolver().explain(decode_ctx(*row))
    assert explanation.chosen == chosen
    assert explanation.phase == "decode"
    _assert_candidates(explanation, candidates)
    as_json = explanation.to_json()
    assert as_json["chosen"] == chosen
    assert [c["name"] for c in as_json["candidates"]] == list(candidates)
    assert all(c["supported"] == (not candidates[c["name"]]) for c in as_json["candidates"])
    text = str(explanation)
    assert (f"=> {chosen}" if chosen else "no strategy fits") in text


PREFILL_TABLE = [
    (("gfx950", 16, "fp8", "auto"), False, FP8_PREFILL, {FP8_PREFILL: (), FLASH: ()}),
    (("gfx950", 16, "fp8", "auto"), True, FLASH, {FP8_PREFILL: ("chunked-context",), FLASH: ()}),
    (("gfx950", 16, "bf16", "auto"), False, FLASH, {FLASH: (), FP8_PREFILL: ()}),
    (("gfx950", 12, "fp8", "auto"), False, FLASH, {FP8_PREFILL: ("heads",), FLASH: ()}),
    (("gfx942", 16, "fp8", "auto"), False, FLASH, {FP8_PREFILL: ("missing-kernel",), FLASH: ()}),
    (("gfx950", 16, "bf16", "on"), False, FP8_PREFILL, {FP8_PREFILL: (), FLASH: ()}),
]


@pytest.mark.parametrize(
    ("row", "chunked", "chosen", "candidates"),
    PREFILL_TABLE,
    ids=["-".join(map(str, r[0])) + ("-chunked" if r[1] else "") for r in PREFILL_TABLE],
)
def test_prefill_table(
    row: tuple,  # type: ignore[type-arg]
    chunked: bool,
    chosen: str,
    candidates: dict[str, tuple[str, ...]],
) -> None:
    ctx = prefill_ctx(*row, chunked=chunked)
    resolver = Resolver()
    assert resolver.resolve(ctx).name == chosen
    explanation = resolver.explain(ctx)
    assert explanation.chosen == chosen
    assert explanation.phase == "prefill"
    _assert_candidates(explanation, candidates)


def test_prefill_knob_off_excludes_fp8_but_forcing_still_works() -> None:
    ctx = prefill_ctx(fp8_prefill="off")
    resolver = Resolver()
    explanation = resolver.explain(ctx)
    assert explanation.chosen == FLASH
    fp8 = explanation.candidate(FP8_PREFILL)
    assert fp8.supported
    assert not fp8.preferred
    assert fp8.note is not None
    assert "off" in fp8.note
    assert resolver.resolve(ctx, force=FP8_PREFILL).name == FP8_PREFILL


def test_asm_mode_excludes_small_head_but_forcing_still_works() -> None:
    ctx = decode_ctx("gfx950", 8, mode="asm")
    explanation = Resolver().explain(ctx)
    gluon = explanation.candidate(GLUON)
    assert gluon.supported
    assert not gluon.preferred
    assert gluon.note is not None
    assert "asm" in gluon.note
    decision = Resolver().resolve(ctx, force=GLUON)
    assert decision.name == GLUON
    assert decision.forced


# -- forced selection -------------------------------------------------------------------------


def test_forced_strategy_runs_the_same_checks() -> None:
    ctx = decode_ctx("gfx942", 8)
    with pytest.raises(UnsupportedError) as info:
        Resolver().resolve(ctx, force=GLUON)
    explanation = info.value.explanation
    assert explanation is not None
    assert explanation.forced == GLUON
    assert explanation.chosen is None
    assert "missing-kernel" in [r.code for r in explanation.candidate(GLUON).reasons]
    assert "forced decode strategy 'gluon-decode'" in str(info.value)
    assert "small-head-decode kernel" in str(info.value)


def test_forced_by_class_and_by_name_agree() -> None:
    ctx = decode_ctx("gfx950", 12)
    resolver = Resolver()
    by_name = resolver.resolve(ctx, force=GLUON)
    by_class = resolver.resolve(ctx, force=mla.GluonDecode)
    assert by_name.strategy is by_class.strategy is mla.GluonDecode
    assert by_name.forced
    assert by_class.explanation.forced == GLUON
    # Automatic selection would have chosen the padded asm path for 12 heads.
    assert resolver.resolve(ctx).name == PERSISTENT


def test_forced_strategy_with_130_heads_names_the_head_rule() -> None:
    ctx = decode_ctx("gfx942", 130)
    with pytest.raises(UnsupportedError) as info:
        Resolver().resolve(ctx, force=NONPERSISTENT)
    assert "130 heads" in str(info.value)
    assert "H % 16 == 0" in str(info.value)
    assert info.value.explanation is not None
    assert info.value.explanation.candidate(NONPERSISTENT).reasons[0].code == "heads"


def test_backend_with_130_heads_fails_at_init() -> None:
    with pytest.raises(UnsupportedError, match="130 heads"):
        mla.MLABackend(
            MLADims(130, softmax_scale=192**-0.5),
            KVCacheSpec(16, "bf16"),
            EngineLimits(4, 256, 256),
            provider=emulated_provider("aiter", "gfx942"),
            platform="gfx942",
        )


def test_forcing_a_strategy_of_the_other_phase_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="is a prefill strategy"):
        Resolver().resolve(decode_ctx(), force=FLASH)
    with pytest.raises(UnsupportedError, match="is a decode strategy"):
        Resolver().resolve(prefill_ctx(), force=mla.GluonDecode)


def test_unknown_strategy_name_lists_the_known_ones() -> None:
    with pytest.raises(UnsupportedError, match=r"unknown strategy 'nope'.*asm-non-persistent"):
        Resolver().resolve(decode_ctx(), force="nope")


def test_forced_unregistered_subclass_is_checked_and_used() -> None:
    class Unregistered(mla.AsmNonPersistent):
        NAME = "test-unregistered-asm"

    decision = Resolver().resolve(decode_ctx("gfx942", 8), force=Unregistered)
    assert decision.strategy is Unregistered
    with pytest.raises(UnsupportedError):
        Resolver().resolve(decode_ctx("gfx942", 130), force=Unregistered)


# -- overrides --------------------------------------------------------------------------------


def test_override_restores_state() -> None:
    ctx = decode_ctx("gfx950", 8)
    resolver = Resolver()
    before = mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE)
    assert resolver.resolve(ctx).name == GLUON
    with mla.override(decode=[NONPERSISTENT, PERSISTENT]):
        assert mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE) == (NONPERSISTENT, PERSISTENT)
        assert resolver.resolve(ctx).name == NONPERSISTENT
        assert [c.name for c in resolver.explain(ctx).candidates] == [NONPERSISTENT, PERSISTENT]
    assert mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE) == before
    assert resolver.resolve(ctx).name == GLUON


def test_override_restores_state_after_an_error() -> None:
    before = mla.DEFAULT_REGISTRY.names(mla.Phase.PREFILL)
    seen: list[tuple[str, ...]] = []

    def fail_inside() -> None:
        with mla.override(prefill=[mla.FlashVarlen]):
            seen.append(mla.DEFAULT_REGISTRY.names(mla.Phase.PREFILL))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert seen == [(FLASH,)]
    assert mla.DEFAULT_REGISTRY.names(mla.Phase.PREFILL) == before


def test_override_to_nothing_supported_raises_with_the_explanation() -> None:
    ctx = decode_ctx("gfx942", 8)
    resolver = Resolver()
    with mla.override(decode=[GLUON]), pytest.raises(UnsupportedError) as info:
        resolver.resolve(ctx)
    assert info.value.explanation is not None
    assert [c.name for c in info.value.explanation.candidates] == [GLUON]
    assert resolver.resolve(ctx).name == PERSISTENT


def test_override_rejects_unknown_names_and_leaves_state() -> None:
    before = mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE)
    with pytest.raises(UnsupportedError, match="unknown strategy"), mla.override(decode=["nope"]):
        pass
    assert mla.DEFAULT_REGISTRY.names(mla.Phase.DECODE) == before


def test_override_on_a_scratch_registry_leaves_the_default_alone() -> None:
    registry = scratch_registry()
    resolver = Resolver(registry)
    ctx = decode_ctx("gfx950", 8)
    with registry.override(decode=[PERSISTENT]):
        assert resolver.resolve(ctx).name == PERSISTENT
        assert Resolver().resolve(ctx).name == GLUON
    assert resolver.resolve(ctx).name == GLUON


# -- every rejection rule, one negative test each ------------------------------------------------


def _codes(strategy: type, ctx: DecodeContext | PrefillContext) -> tuple[str, ...]:
    support: Support = strategy.supports(ctx)  # type: ignore[attr-defined]
    assert not support
    for reason in support:
        assert reason.message
    return support.codes


def test_rule_heads_small_head() -> None:
    assert _codes(mla.GluonDecode, decode_ctx("gfx950", 16)) == ("heads",)
    assert _codes(mla.GluonVerifyFlatten, decode_ctx("gfx950", 20, 2, 2)) == ("heads",)


def test_rule_heads_paged() -> None:
    for strategy in (mla.PaddedAsmPersistent, mla.AsmNonPersistent):
        assert "heads" in _codes(strategy, decode_ctx("gfx950", 130))
        assert "heads" in _codes(strategy, decode_ctx("gfx950", 136))
    # 144 = 9 x 16 is valid above 128.
    assert mla.AsmNonPersistent.supports(decode_ctx("gfx950", 144)).codes.count("heads") == 0


def test_rule_heads_fp8_prefill() -> None:
    assert _codes(mla.Fp8PersistentPrefill, prefill_ctx("gfx950", 12)) == ("heads",)


def test_rule_qlen() -> None:
    assert _codes(mla.GluonDecode, decode_ctx("gfx950", 8, 2, 2)) == ("qlen",)
    assert _codes(mla.GluonVerifyFlatten, decode_ctx("gfx950", 8, 1, 2)) == ("qlen",)


def test_rule_kv_dtype() -> None:
    assert _codes(mla.GluonDecode, decode_ctx("gfx950", 8, kv="fp8")) == ("kv-dtype",)
    assert _codes(mla.GluonVerifyFlatten, decode_ctx("gfx950", 8, 2, 2, kv="fp8")) == ("kv-dtype",)
    assert "kv-dtype" in _codes(mla.PaddedAsmPersistent, decode_ctx("gfx950", 16, kv="fp16"))
    assert "kv-dtype" in _codes(mla.AsmNonPersistent, decode_ctx("gfx950", 16, kv="fp32"))


def test_rule_q_dtype() -> None:
    f32 = torch.float32
    assert _codes(mla.GluonDecode, decode_ctx("gfx950", 8, q_dtype=f32)) == ("q-dtype",)
    assert _codes(mla.PaddedAsmPersistent, decode_ctx("gfx950", 16, q_dtype=f32)) == ("q-dtype",)
    assert _codes(mla.AsmNonPersistent, decode_ctx("gfx950", 16, q_dtype=f32)) == ("q-dtype",)
    assert _codes(mla.FlashVarlen, prefill_ctx("gfx950", 16, q_dtype=f32)) == ("q-dtype",)


def test_rule_missing_kernel() -> None:
    assert _codes(mla.GluonDecode, decode_ctx("gfx942", 8)) == ("missing-kernel",)
    assert _codes(mla.GluonVerifyFlatten, decode_ctx("gfx942", 8, 2, 2)) == ("missing-kernel",)
    assert _codes(mla.Fp8PersistentPrefill, prefill_ctx("gfx942", 16)) == ("missing-kernel",)
    no_schedule = attrs.evolve(
        REFERENCE_CAPABILITIES, contracts=REFERENCE_CAPABILITIES.contracts - {Contract.DECODE_SCHEDULE}
    )
    assert _codes(mla.PaddedAsmPersistent, decode_ctx("cpu", 8, caps=no_schedule)) == ("missing-kernel",)
    assert mla.AsmNonPersistent.supports(decode_ctx("cpu", 8, caps=no_schedule))
    no_varlen = attrs.evolve(
        REFERENCE_CAPABILITIES, contracts=REFERENCE_CAPABILITIES.contracts - {Contract.VARLEN_PREFILL}
    )
    assert _codes(mla.FlashVarlen, prefill_ctx("cpu", caps=no_varlen)) == ("missing-kernel",)
    no_merge = attrs.evolve(
        REFERENCE_CAPABILITIES,
        contracts=REFERENCE_CAPABILITIES.contracts - {Contract.MERGE_STATES},
        varlen_context_operands=False,
    )
    assert mla.FlashVarlen.supports(prefill_ctx("cpu", caps=no_merge))
    assert _codes(mla.FlashVarlen, prefill_ctx("cpu", caps=no_merge, chunked=True)) == ("missing-kernel",)
    # A varlen kernel that merges a prior state in its epilogue needs no merge kernel.
    fused = attrs.evolve(no_merge, varlen_context_operands=True)
    assert mla.FlashVarlen.supports(prefill_ctx("cpu", caps=fused, chunked=True))


def test_rule_arch() -> None:
    for strategy in (mla.PaddedAsmPersistent, mla.AsmNonPersistent):
        assert _codes(strategy, decode_ctx("sm90", 16, caps=aiter_capabilities("gfx950"))) == ("arch",)
    assert _codes(mla.FlashVarlen, prefill_ctx("sm90", caps=aiter_capabilities("gfx950"))) == ("arch",)


def _table_message(strategy: type, ctx: DecodeContext) -> str:
    support: Support = strategy.supports(ctx)  # type: ignore[attr-defined]
    assert support.codes == ("kernel-table",), support.codes
    return support.reasons[0].message


def test_kernel_table_padded_heads() -> None:
    """Fewer heads than the granularity, padded to 16: no bf16 persistent kernel past qlen 4."""
    message = _table_message(mla.PaddedAsmPersistent, decode_ctx("gfx942", 8, 6, 8))
    assert "16 kernel heads (padded from 8) at kernel qlen 6" in message
    assert "(padded from 8)" in _table_message(mla.PaddedAsmPersistent, decode_ctx("gfx950", 8, 6, 8))
    # Not a gap for 16+ heads, nor for fp8, nor within qlen 4.
    assert mla.PaddedAsmPersistent.supports(decode_ctx("gfx950", 16, 6, 8))
    assert mla.PaddedAsmPersistent.supports(decode_ctx("gfx950", 8, 6, 8, "fp8"))
    assert mla.PaddedAsmPersistent.supports(decode_ctx("gfx942", 8, 3, 4))


def test_kernel_table_persistent_fp8_qlen() -> None:
    """gfx942 runs fp8 persistent past qlen 4 only with 128 native heads; gfx950 at any."""
    assert "at kernel qlen 6" in _table_message(
        mla.PaddedAsmPersistent, decode_ctx("gfx942", 16, 6, 8, "fp8")
    )
    assert mla.PaddedAsmPersistent.supports(decode_ctx("gfx942", 128, 6, 8, "fp8"))
    assert mla.PaddedAsmPersistent.supports(decode_ctx("gfx950", 16, 6, 8, "fp8"))


def test_kernel_table_nonpersistent_fp8() -> None:
    """fp8 non-persistent: qlen 1..4 and only the head counts with a get_block_n_fp8 block."""
    message = _table_message(mla.AsmNonPersistent, decode_ctx("gfx950", 16, 6, 8, "fp8"))
    assert "non-persistent fp8 KV, heads [16, 128], qlen 1..4" in message
    assert "80 kernel heads at kernel qlen 1" in _table_message(
        mla.AsmNonPersistent, decode_ctx("gfx950", 80, 1, 1, "fp8")
    )
    assert mla.AsmNonPersistent.supports(decode_ctx("gfx950", 16, 3, 4, "fp8"))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_aiter_nonpersistent_fp8_rows_have_kernel_blocks(arch: str) -> None:
    """Every non-persistent fp8 combination of the table is a ``get_block_n_fp8`` key."""
    rows = aiter_capabilities(arch).paged_kernel_rows(persistent=False, fp8=True)
    assert rows
    for row in rows:
        assert row.max_qlen is not None
        for heads in row.heads:
            for qlen in range(row.min_qlen, row.max_qlen + 1):
                assert heads * qlen in AITER_GET_BLOCK_N_FP8_KEYS, (heads, qlen)


def test_rule_qlen_over_engine_max() -> None:
    ctx = decode_ctx("cpu", 8, 3, 2, caps=REFERENCE_CAPABILITIES)
    assert _codes(mla.PaddedAsmPersistent, ctx) == ("qlen-over-engine-max",)


def test_rule_chunked_context() -> None:
    assert _codes(mla.Fp8PersistentPrefill, prefill_ctx("gfx950", 16, chunked=True)) == ("chunked-context",)


def test_rule_provider_unavailable() -> None:
    unavailable = Support.no("provider-unavailable", "aiter is not installed here (no ROCm)")
    decode = decode_ctx("gfx950", 8, availability=unavailable)
    for strategy in mla.DECODE_STRATEGIES:
        assert "provider-unavailable" in _codes(strategy, decode)
    explanation = Resolver().explain(decode)
    assert explanation.chosen is None
    assert explanation.if_available == GLUON
    assert "if the provider were available: gluon-decode" in str(explanation)
    with pytest.raises(UnsupportedError, match="not installed here"):
        Resolver().resolve(decode)
    prefill = prefill_ctx(availability=unavailable)
    for strategy in mla.PREFILL_STRATEGIES:
        assert "provider-unavailable" in _codes(strategy, prefill)
    assert Resolver().explain(prefill).if_available == FP8_PREFILL


def test_unavailable_provider_fails_the_backend_at_init() -> None:
    class Absent(mla.TorchProvider):
        name = "test-absent"

        def availability(self) -> Support:
            return Support.no("provider-unavailable", "test-absent has no device here")

    with pytest.raises(UnsupportedError, match="no device here"):
        mla.MLABackend(
            MLADims(16, softmax_scale=192**-0.5),
            KVCacheSpec(16, "bf16"),
            EngineLimits(4, 256, 256),
            provider=Absent(),
        )


def test_every_reason_is_reported_not_only_the_first() -> None:
    ctx = decode_ctx("gfx942", 130, 2, 2, "fp8", q_dtype=torch.float32)
    codes = mla.GluonDecode.supports(ctx).codes
    assert {"missing-kernel", "heads", "kv-dtype", "q-dtype", "qlen"} <= set(codes)


def test_resolutions_are_cached_per_context_and_registry_version() -> None:
    registry = scratch_registry()
    resolver = Resolver(registry)
    ctx = decode_ctx("gfx950", 8)
    first = resolver.resolve(ctx)
    assert resolver.resolve(ctx) is first
    registry.unregister(GLUON)
    assert resolver.resolve(ctx).name == PERSISTENT


def test_rule_dims() -> None:
    """A provider built for DeepSeek's 512/64 latent (192/128 prefill) refuses other dims."""
    caps = attrs.evolve(
        REFERENCE_CAPABILITIES, latent_dims=frozenset({(512, 64)}), fp8_prefill_dims=frozenset({(192, 128)})
    )
    small = decode_context(
        dims=MLADims(8, kv_lora_rank=64, qk_rope_head_dim=16, softmax_scale=144**-0.5),
        cache=KVCacheSpec(16, "bf16"),
        q_dtype=BF16,
        platform=simulated_platform("cpu"),
        capabilities=caps,
        availability=AVAILABLE,
        limits=EngineLimits(4, 64, 64),
        max_qlen=1,
        uniform_qlen=True,
    )
    for strategy in (mla.GluonDecode, mla.PaddedAsmPersistent, mla.AsmNonPersistent):
        assert _codes(strategy, small) == ("dims",)
    assert mla.GluonDecode.supports(decode_ctx("cpu", 8, caps=caps))
    prefill = prefill_context(
        dims=MLADims(16, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, softmax_scale=48**-0.5),
        cache=KVCacheSpec(16, "fp8"),
        q_dtype=BF16,
        platform=simulated_platform("cpu"),
        capabilities=caps,
        availability=AVAILABLE,
        has_chunked_context=False,
    )
    assert _codes(mla.Fp8PersistentPrefill, prefill) == ("dims",)
    assert mla.Fp8PersistentPrefill.supports(prefill_ctx("cpu", caps=caps))


def test_rule_kernel_table() -> None:
    """A kernel-table gap (a combination the provider has no kernel for) is a reason."""
    table = frozenset(
        {PagedKernel(True, False, frozenset({16}), 1, 4), PagedKernel(False, False, frozenset({32}))}
    )
    caps = attrs.evolve(REFERENCE_CAPABILITIES, head_granularity=16, paged_kernels=table)
    assert mla.PaddedAsmPersistent.supports(decode_ctx("cpu", 8, 4, 4, caps=caps))
    assert _codes(mla.PaddedAsmPersistent, decode_ctx("cpu", 8, 5, 5, caps=caps)) == ("kernel-table",)
    assert _codes(mla.AsmNonPersistent, decode_ctx("cpu", 8, caps=caps)) == ("kernel-table",)
    assert mla.AsmNonPersistent.supports(decode_ctx("cpu", 32, caps=caps))


def test_persistent_preference_hint_orders_the_paged_modes() -> None:
    """A record whose non-persistent paged decode is faster puts it first; support is unchanged."""
    preferred = decode_ctx("sm90", heads=16, caps=REFERENCE_CAPABILITIES)
    hinted = decode_ctx(
        "sm90", heads=16, caps=attrs.evolve(REFERENCE_CAPABILITIES, persistent_decode_preferred=False)
    )
    resolver = mla.Resolver()
    assert resolver.resolve(preferred).name == PERSISTENT
    assert resolver.resolve(hinted).name == NONPERSISTENT
    assert resolver.explain(hinted).candidate(PERSISTENT).supported
    with mla.override(decode=[PERSISTENT, NONPERSISTENT]):
        assert resolver.resolve(hinted).name == PERSISTENT
