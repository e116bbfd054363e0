"""Every decode strategy, forced on every case it supports, matches the reference math, with an LSE
tensor and with ``lse=None`` (the kit runs each plan both ways). Only the supported strategy ×
case pairs are collected (``strategy_matrix``); ``test_every_strategy_is_exercised`` guards
their number.

Runs on the torch provider's own capabilities and under aiter's capability records for gfx942
and gfx950 (simulated), so head padding, qlen padding, verify flattening and the persistent
schedule all run on a CPU. Cases are a pairwise selection over heads x qlen patterns x block
sizes x dtypes x graph padding (small 64+16 latent dims), plus a few at DeepSeek's 512+64.
"""

from __future__ import annotations

import pytest
import torch
from strategy_matrix import supported_matrix

import mla
from mla.decode.base import DecodeStrategy
from mla.testing import DecodeCase, check_decode_strategy, decode_cases, decode_support, emulated_provider

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn

# The torch provider pads no heads: fewer head counts than aiter's matrix keep its share of the
# run time (each case runs twice: with and without an LSE).
TORCH_CASES = list(
    decode_cases(heads=(1, 2, 8, 12, 16, 128), dtypes=((F32, F32), (BF16, BF16), (BF16, FP8), (F32, FP8)))
)
AITER_CASES = list(decode_cases(dtypes=((BF16, BF16), (BF16, FP8)), seed=1))
SMALL_HEAD_CASES = list(
    decode_cases(
        heads=(1, 2, 4, 8, 12),
        qlen_patterns=((1,), (1, 1, 1, 1), (2, 2), (3, 3, 3), (4, 2), (8, 8), (1, 6, 3)),
        dtypes=((BF16, BF16),),
        seed=2,
    )
)
FULL_DIM_CASES = [
    DecodeCase(heads=16, qlens=(1, 1), seq_lens=(70, 33), block_size=16, seed=11),
    DecodeCase(heads=8, qlens=(3, 3, 0), seq_lens=(40, 9, 0), kv_dtype=FP8, extra_rows=3, seed=12),
    DecodeCase(heads=2, qlens=(4, 4), seq_lens=(64, 5), block_size=64, seed=13),
    DecodeCase(heads=24, qlens=(2, 5), seq_lens=(20, 50), block_size=1, seed=14),
    DecodeCase(heads=128, qlens=(1,), seq_lens=(45,), q_dtype=F32, kv_dtype=F32, seed=15),
    DecodeCase(heads=12, qlens=(2, 2, 2), seq_lens=(2, 90, 31), kv_dtype=FP8, seed=16),
    DecodeCase(heads=1, qlens=(1, 1, 0), seq_lens=(128, 1, 0), block_size=1, extra_rows=1, seed=17),
    DecodeCase(heads=32, qlens=(6, 8), seq_lens=(100, 8), block_size=64, max_decode_qlen=8, seed=18),
    DecodeCase(heads=4, qlens=(3, 3), seq_lens=(77, 12), block_size=16, max_decode_qlen=4, seed=19),
]
"""DeepSeek's real geometry (512 + 64), a handful only: the small-dim cases carry the breadth."""

PROVIDERS = (("torch", "cpu"), ("aiter", "gfx942"), ("aiter", "gfx950"))


def _cases(provider: str) -> list[DecodeCase]:
    if provider == "torch":
        return TORCH_CASES + SMALL_HEAD_CASES + FULL_DIM_CASES
    return AITER_CASES + SMALL_HEAD_CASES + [c for c in FULL_DIM_CASES if c.q_dtype == BF16]


MATRIX = supported_matrix(
    mla.DECODE_STRATEGIES,
    PROVIDERS,
    _cases,
    lambda strategy, case, prov, arch: decode_support(strategy, case, provider=prov, platform=arch),
    lambda case: case.id,
)
"""The supported strategy × case pairs, asked at collection time: only these are collected."""


@pytest.mark.parametrize(("strategy", "provider", "arch", "case"), MATRIX.params)
def test_strategy_matches_reference(
    strategy: type[DecodeStrategy], provider: str, arch: str, case: DecodeCase
) -> None:
    result = check_decode_strategy(strategy, case, provider=emulated_provider(provider, arch), platform=arch)
    assert result.supported, f"collected as supported, then declined: {result.reasons}"
    result.assert_passed()


# Expected coverage (the supported counts of the pairwise selection above, exact as of writing), so
# a regression in ``supports`` cannot silently shrink the matrix.
MIN_SUPPORTED = {
    ("torch", "cpu", "gluon-decode"): 19,
    ("torch", "cpu", "gluon-verify-flatten"): 97,
    ("torch", "cpu", "asm-padded-persistent"): len(_cases("torch")),
    ("torch", "cpu", "asm-non-persistent"): len(_cases("torch")),
    ("aiter", "gfx942", "asm-padded-persistent"): 85,
    ("aiter", "gfx942", "asm-non-persistent"): 143,
    ("aiter", "gfx950", "gluon-decode"): 16,
    ("aiter", "gfx950", "gluon-verify-flatten"): 76,
    ("aiter", "gfx950", "asm-padded-persistent"): 113,
    ("aiter", "gfx950", "asm-non-persistent"): 143,
}


@pytest.mark.parametrize(("provider", "arch"), PROVIDERS)
def test_every_strategy_is_exercised(provider: str, arch: str) -> None:
    """Each strategy keeps its collected cases under each provider: at least the counts above,
    and none where none is expected (for the reason expected)."""
    for strategy in mla.DECODE_STRATEGIES:
        collected = MATRIX.counts[(provider, arch, strategy.NAME)]
        expected = MIN_SUPPORTED.get((provider, arch, strategy.NAME), 0)
        assert collected >= expected, (provider, arch, strategy.NAME, collected)
        if expected == 0:
            # gfx942 ships no small-head kernel: every case is refused for that reason.
            assert collected == 0, (provider, arch, strategy.NAME, collected)
            prov = emulated_provider(provider, arch)
            support = decode_support(strategy, SMALL_HEAD_CASES[0], provider=prov, platform=arch)
            assert "missing-kernel" in support.codes


def test_every_strategy_has_cases() -> None:
    """Every built-in decode strategy is collected on some case, and the collected pairs are
    exactly the supported ones counted above (the matrix cannot quietly collect nothing)."""
    for strategy in mla.DECODE_STRATEGIES:
        assert sum(n for (_, _, name), n in MATRIX.counts.items() if name == strategy.NAME) >= 1, strategy
    assert len(MATRIX.params) == sum(MATRIX.counts.values()) >= sum(MIN_SUPPORTED.values())
    assert MATRIX.total == len(mla.DECODE_STRATEGIES) * sum(len(_cases(p)) for p, _ in PROVIDERS)


def test_unwritten_rows_are_caught() -> None:
    """The kit's poison works: a strategy that skips the last row fails the comparison."""

    class SkipsLastRow(mla.AsmNonPersistent):
        NAME = "test-skips-last-row"

        def launch(self, plan, q, kv_flat, *, kv_scale, out, lse):  # type: ignore[no-untyped-def]
            saved_out = out[-1].clone()
            saved_lse = None if lse is None else lse[-1].clone()
            super().launch(plan, q, kv_flat, kv_scale=kv_scale, out=out, lse=lse)
            out[-1].copy_(saved_out)
            if lse is not None and saved_lse is not None:
                lse[-1].copy_(saved_lse)

    case = DecodeCase(heads=4, qlens=(2, 1), seq_lens=(9, 30), kv_lora_rank=64, rope_dim=16)
    result = check_decode_strategy(SkipsLastRow, case, provider="torch", platform="cpu")
    assert result.supported
    assert not result.ok
    assert result.comparison is not None
    assert result.comparison.unwritten_rows == 1
    assert result.without_lse is not None
    assert result.without_lse.unwritten_rows == 1
    with pytest.raises(AssertionError, match="1 unwritten rows"):
        result.assert_passed()
