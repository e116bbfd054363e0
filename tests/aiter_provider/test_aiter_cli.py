"""``mla info`` and ``mla explain --provider aiter`` on a machine without ROCm or aiter."""

from __future__ import annotations

import json

import pytest

import mla.providers
from mla.providers.aiter import AiterProvider
from mla.tools.cli import main

pytestmark = pytest.mark.skipif(
    bool(AiterProvider().availability()), reason="aiter runs here: the no-aiter explanations do not apply"
)


@pytest.fixture(autouse=True)
def fresh_provider() -> None:
    mla.providers.forget_instance("aiter")


def _reason_codes(payload: dict) -> set[str]:  # type: ignore[type-arg]
    return {r["code"] for c in payload["candidates"] for r in c["reasons"]}


def test_explain_says_why_aiter_is_unavailable_and_what_it_would_choose(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["explain", "--provider", "aiter", "--arch", "gfx950", "--heads", "8", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 2
    assert payload["chosen"] is None
    assert payload["if_available"] == "gluon-decode"
    assert "aiter-missing" in _reason_codes(payload)


def test_explain_shows_kernel_table_gaps_even_where_nothing_would_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["explain", "--provider", "aiter", "--arch", "gfx942", "--heads", "16", "--qlen", "6"]
    code = main([*argv, "--max-decode-qlen", "8", "--kv-dtype", "fp8"])
    text = capsys.readouterr().out
    assert code == 2
    assert "not available here" in text
    assert "no persistent fp8-KV decode kernel for 16 kernel heads at kernel qlen 6" in text
    assert "if the provider were available" not in text


def test_explain_prefill_on_gfx950_would_pick_the_fp8_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--phase", "prefill", "--provider", "aiter", "--arch", "gfx950", "--heads", "16"]
    main([*argv, "--kv-dtype", "fp8", "--json"])
    assert json.loads(capsys.readouterr().out)["if_available"] == "fp8-persistent-prefill"


def test_info_lists_aiter_with_its_reasons_and_probes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    (aiter,) = [p for p in payload["providers"] if p["name"] == "aiter"]
    assert not aiter["available"]
    assert "aiter-missing" in {r["code"] for r in aiter["reasons"]}
    assert "not available" in aiter["probes"]["aiter"]
    assert "simulated" in aiter["probes"]["capabilities"]
