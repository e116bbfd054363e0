"""vLLM's ``VLLM_ROCM_AITER_MLA_ASM_PADDING`` maps to the small-head mode; explicit knobs win."""

from __future__ import annotations

import pytest

from mla import InvalidInputError, Knobs, detect_platform, simulated_platform


@pytest.mark.parametrize(
    ("value", "mode"), [("auto", "auto"), ("GLUON", "gluon"), (" asm ", "asm"), ("", "auto")]
)
def test_the_vllm_variable_sets_the_small_head_mode(value: str, mode: str) -> None:
    assert Knobs.from_env({"VLLM_ROCM_AITER_MLA_ASM_PADDING": value}).small_head_mode == mode


def test_mla_own_variable_wins_over_the_vllm_one() -> None:
    env = {"VLLM_ROCM_AITER_MLA_ASM_PADDING": "asm", "MLA_SMALL_HEAD_MODE": "gluon"}
    assert Knobs.from_env(env).small_head_mode == "gluon"


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(InvalidInputError, match="VLLM_ROCM_AITER_MLA_ASM_PADDING: environment value 'pad'"):
        Knobs.from_env({"VLLM_ROCM_AITER_MLA_ASM_PADDING": "pad"})


def test_explicit_knobs_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ROCM_AITER_MLA_ASM_PADDING", "asm")
    monkeypatch.delenv("MLA_SMALL_HEAD_MODE", raising=False)
    assert detect_platform().knobs.small_head_mode == "asm"
    assert detect_platform(knobs=Knobs(small_head_mode="gluon")).knobs.small_head_mode == "gluon"
    assert detect_platform().with_knobs(small_head_mode="auto").knobs.small_head_mode == "auto"
    assert simulated_platform("gfx950").knobs.small_head_mode == "auto"  # simulations read no environment
