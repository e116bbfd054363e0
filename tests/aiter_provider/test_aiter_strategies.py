"""All six strategies through the aiter provider and the strict fake, against the reference."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from aiter_cases import LATENT, decode_case, fake_provider, fp8_for, prefill_case, run_decode, run_prefill

import mla
from mla import (
    DECODE_STRATEGIES,
    AsmNonPersistent,
    GluonDecode,
    GluonVerifyFlatten,
    PaddedAsmPersistent,
    UnsupportedError,
)
from mla.prefill.flash_varlen import FlashVarlen
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.testing import check_prefill_strategy, context_prefill_cases, decode_cases, prefill_cases

# The decision table of the framework issue (aiter capabilities), decode part:
# (arch, heads, qlen, max decode qlen, kv, small-head mode, chosen).
DECODE_TABLE = [
    ("gfx950", 8, 1, 1, "bf16", "auto", GluonDecode),
    ("gfx950", 4, 1, 1, "bf16", "auto", GluonDecode),
    ("gfx950", 12, 1, 1, "bf16", "auto", PaddedAsmPersistent),
    ("gfx950", 12, 1, 1, "bf16", "gluon", GluonDecode),
    ("gfx950", 8, 1, 1, "bf16", "asm", PaddedAsmPersistent),
    ("gfx950", 12, 3, 4, "bf16", "auto", GluonVerifyFlatten),
    ("gfx950", 8, 1, 1, "fp8", "auto", PaddedAsmPersistent),
    ("gfx942", 8, 1, 1, "bf16", "auto", PaddedAsmPersistent),
    ("gfx942", 8, 3, 4, "bf16", "auto", PaddedAsmPersistent),
    ("gfx942", 8, 6, 8, "bf16", "auto", AsmNonPersistent),
    ("gfx950", 8, 6, 8, "fp8", "auto", PaddedAsmPersistent),
    ("gfx942", 16, 1, 1, "bf16", "auto", PaddedAsmPersistent),
]


@pytest.mark.parametrize(
    ("arch", "heads", "qlen", "max_qlen", "kv", "mode", "chosen"),
    DECODE_TABLE,
    ids=[f"{r[0]}-h{r[1]}-q{r[2]}of{r[3]}-{r[4]}-{r[5]}" for r in DECODE_TABLE],
)
def test_decode_decision_table_runs_and_matches(
    fake_aiter, arch, heads, qlen, max_qlen, kv, mode, chosen
) -> None:  # type: ignore[no-untyped-def]
    fake_aiter(arch)
    kv_dtype = fp8_for(arch) if kv == "fp8" else torch.bfloat16
    # A graph-padding request (seq_len 0) and a trailing unowned row ride along.
    case = decode_case(
        heads,
        (qlen, qlen, qlen),
        (37, qlen + 2, 0),
        kv_dtype=kv_dtype,
        max_decode_qlen=max_qlen,
        extra_rows=1,
    )
    run = run_decode(fake_provider(), arch, case, small_head_mode=mode)
    assert run.strategy == chosen.NAME
    assert run.comparison.ok, run.comparison


def test_a_head_count_no_strategy_accepts_names_the_rule(fake_aiter) -> None:
    fake_aiter("gfx942")
    with pytest.raises(
        UnsupportedError, match=r"130 heads: the paged decode needs H > 0 and \(H <= 128 or H % 16 == 0\)"
    ):
        run_decode(fake_provider(), "gfx942", decode_case(130, (1,), (9,)))


PREFILL_TABLE = [
    # (arch, heads, cache, context, fp8-prefill knob, chosen)
    ("gfx950", 16, "fp8", False, "auto", Fp8PersistentPrefill),
    ("gfx950", 16, "fp8", True, "auto", FlashVarlen),
    ("gfx950", 16, "bf16", False, "auto", FlashVarlen),
    ("gfx950", 12, "fp8", False, "auto", FlashVarlen),
    ("gfx942", 16, "fp8", False, "auto", FlashVarlen),
    ("gfx950", 16, "bf16", False, "on", Fp8PersistentPrefill),
]


@pytest.mark.parametrize(
    ("arch", "heads", "cache", "context", "knob", "chosen"),
    PREFILL_TABLE,
    ids=[f"{r[0]}-h{r[1]}-{r[2]}{'-ctx' if r[3] else ''}-{r[4]}" for r in PREFILL_TABLE],
)
def test_prefill_decision_table_runs_and_matches(
    fake_aiter, arch, heads, cache, context, knob, chosen
) -> None:  # type: ignore[no-untyped-def]
    fake_aiter(arch, cu_num=32)
    kv_dtype = fp8_for(arch) if cache == "fp8" else torch.bfloat16
    case = prefill_case(heads, (9, 5), kv_dtype=kv_dtype, context_lens=(21, 0) if context else None)
    strategy, comparison = run_prefill(fake_provider(), arch, case, fp8_prefill=knob)
    assert strategy == chosen.NAME
    assert comparison.ok, comparison


def test_fp8_prefill_splits_tiles_and_reduces_them(fake_aiter) -> None:
    fake = fake_aiter("gfx950", cu_num=32)
    strategy, comparison = run_prefill(
        fake_provider(), "gfx950", prefill_case(16, (300, 40, 1)), fp8_prefill="on"
    )
    assert strategy == Fp8PersistentPrefill.NAME
    assert comparison.ok, comparison
    (plan,) = fake.calls("get_ps_metadata_v1")
    assert plan["partial_tiles"] > 0  # some q tiles were split across CUs and went through the reduce
    assert plan["qlen_granularity"] == 256
    assert plan["kvlen_granularity"] == 128
    assert (plan["block_size"], plan["qhead_granularity"], plan["gqa_ratio"]) == (1, 1, 1)
    assert [c["num_kv_splits"] for c in fake.calls("mla_reduce_v1")] == [0]
    assert [c["max_seqlen_q"] for c in fake.calls("mla_reduce_v1")] == [256]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_every_decode_strategy_matches_the_reference_where_it_runs(fake_aiter, arch: str) -> None:
    fake_aiter(arch)
    provider = fake_provider()
    # bf16 caches carry the breadth (the small-head kernels take only those); a few fp8 ones.
    cases = [
        *decode_cases(
            heads=(2, 8, 12, 16, 32),
            qlen_patterns=((1, 1), (3, 3), (5, 5), (1, 3, 2)),
            block_sizes=(1, 16),
            dtypes=((torch.bfloat16, torch.bfloat16),),
            padding=("none", "rows", "both"),
            max_seq_len=24,
            **LATENT,
        ),
        *decode_cases(
            heads=(2, 16),
            qlen_patterns=((1, 1), (5, 5)),
            block_sizes=(16,),
            dtypes=((torch.bfloat16, fp8_for(arch)),),
            padding=("none",),
            max_seq_len=24,
            seed=1,
            **LATENT,
        ),
    ]
    ran: Counter[str] = Counter()
    for case in cases:
        for strategy in DECODE_STRATEGIES:
            try:
                run = run_decode(provider, arch, case, force=strategy, preallocate=False)
            except UnsupportedError:
                continue
            assert run.strategy == strategy.NAME
            assert run.comparison.ok, (strategy.NAME, case.id, run.comparison)
            ran[strategy.NAME] += 1
    paged = {PaddedAsmPersistent.NAME, AsmNonPersistent.NAME}
    small_head = {GluonDecode.NAME, GluonVerifyFlatten.NAME}
    assert all(ran[name] >= 3 for name in paged), ran
    if arch == "gfx950":
        assert all(ran[name] >= 3 for name in small_head), ran
    else:
        assert not any(ran[name] for name in small_head), ran


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_flash_varlen_matches_with_and_without_cached_context(fake_aiter, arch: str) -> None:
    fake_aiter(arch)
    provider = fake_provider()
    ran = 0
    for case in [
        *prefill_cases(heads=(4,), dtypes=(torch.bfloat16,)),
        *context_prefill_cases(
            heads=(16,),
            dtypes=((torch.bfloat16, torch.bfloat16), (torch.bfloat16, fp8_for(arch))),
            kv_lora_rank=512,
        ),
    ]:
        result = check_prefill_strategy(FlashVarlen, case, provider=provider, platform=arch)
        assert result.ok, result
        ran += 1
    assert ran >= 6


def test_fp8_prefill_through_the_api_with_keys_longer_than_queries(fake_aiter) -> None:
    fake_aiter("gfx950")
    provider = fake_provider()
    for case in (
        prefill_case(16, (9, 4), kv_lens=(20, 4)),
        prefill_case(32, (1, 12, 6), kv_lens=(1, 30, 6)),
        prefill_case(16, (5, 3), kv_lens=(5, 3), causal=False),
    ):
        result = check_prefill_strategy(Fp8PersistentPrefill, case, provider=provider, platform="gfx950")
        assert result.ok, result


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_fp16_prefill_runs_on_the_ck_varlen_kernel(fake_aiter, arch: str) -> None:
    """aiter's CK flash_attn_varlen_func takes fp16: an fp16 model's prefill is FlashVarlen,
    not the fp8 prefill (fp8-level error) on gfx950 and not nothing on gfx942."""
    fake_aiter(arch)
    case = prefill_case(16, (9, 5), dtype=torch.float16)
    result = check_prefill_strategy(FlashVarlen, case, provider=fake_provider(), platform=arch)
    assert result.ok, result
    q = torch.randn(7, 16, 192, dtype=torch.float16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = mla.mla_prefill(
        q, q, q[..., :128], cu, cu, 4, 4, softmax_scale=192**-0.5, provider=fake_provider(), platform=arch
    )
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize(("arch", "qlen"), [("gfx942", 1), ("gfx942", 4), ("gfx950", 1), ("gfx950", 6)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_heads_above_128_fold_like_vllm(fake_aiter, arch: str, qlen: int, kv: str) -> None:
    """vLLM's ROCm AITER MLA backend accepts any multiple of 16 heads; aiter folds heads above
    128 onto its 16-head kernel as pseudo-requests."""
    if arch == "gfx942" and kv == "fp8" and qlen > 4:
        pytest.skip("gfx942 has no fp8 decode past qlen 4 at any head count")
    fake = fake_aiter(arch)
    kv_dtype = fp8_for(arch) if kv == "fp8" else torch.bfloat16
    case = decode_case(144, (qlen, qlen), (30, qlen + 3), kv_dtype=kv_dtype)
    run = run_decode(fake_provider(), arch, case)
    assert run.strategy == PaddedAsmPersistent.NAME
    assert run.comparison.ok, run.comparison
    assert [c["heads"] for c in fake.calls("mla_decode_fwd")] == [144]
