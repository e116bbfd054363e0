"""The ``mla`` command line: the issue-2 decision table through ``mla explain``, and ``mla info``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mla
from mla.core.errors import ProviderUnavailableError
from mla.core.platform import FP8_PREFILL_ENV, SMALL_HEAD_MODE_ENV
from mla.strategy import Phase
from mla.tools import cli, cli_info

# (arch, heads, qlen, max decode qlen, kv dtype, small-head mode) -> chosen decode strategy.
DECODE_TABLE = [
    (("gfx950", 8, 1, 1, "bf16", "auto"), "gluon-decode"),
    (("gfx950", 4, 1, 1, "bf16", "auto"), "gluon-decode"),
    (("gfx950", 12, 1, 1, "bf16", "auto"), "asm-padded-persistent"),
    (("gfx950", 12, 1, 1, "bf16", "gluon"), "gluon-decode"),
    (("gfx950", 8, 1, 1, "bf16", "asm"), "asm-padded-persistent"),
    (("gfx950", 12, 3, 4, "bf16", "auto"), "gluon-verify-flatten"),
    (("gfx950", 8, 1, 1, "fp8", "auto"), "asm-padded-persistent"),
    (("gfx942", 8, 1, 1, "bf16", "auto"), "asm-padded-persistent"),
    (("gfx942", 8, 3, 4, "bf16", "auto"), "asm-padded-persistent"),
    (("gfx942", 8, 6, 8, "bf16", "auto"), "asm-non-persistent"),
    (("gfx950", 8, 6, 8, "fp8", "auto"), "asm-padded-persistent"),
    (("gfx942", 16, 1, 1, "bf16", "auto"), "asm-padded-persistent"),
]
NO_FIT_ROW = ("gfx942", 130, 1, 1, "bf16", "auto")

# (arch, heads, kv dtype, extra flags) -> chosen prefill strategy.
PREFILL_TABLE = [
    (("gfx950", 16, "fp8", ()), "fp8-persistent-prefill"),
    (("gfx950", 16, "fp8", ("--chunked-context",)), "flash-varlen"),
    (("gfx950", 16, "bf16", ("--fp8-prefill", "auto")), "flash-varlen"),
    (("gfx950", 12, "fp8", ()), "flash-varlen"),
    (("gfx942", 16, "fp8", ()), "flash-varlen"),
    (("gfx950", 16, "bf16", ("--fp8-prefill", "on")), "fp8-persistent-prefill"),
]

PROVIDER_FLAGS = {"emulated": ["--emulate", "aiter"], "aiter": ["--provider", "aiter"]}


@pytest.fixture(autouse=True)
def _no_knob_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table assumes default knobs; the environment must not leak in."""
    for name in (*SMALL_HEAD_MODE_ENV, FP8_PREFILL_ENV):
        monkeypatch.delenv(name, raising=False)


def case_id(value: object) -> str:
    if isinstance(value, tuple):
        return "-".join(case_id(v) for v in value if v != ())
    return str(value)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out = run_cli(capsys, *argv, "--json")
    return code, json.loads(out)


def decode_args(arch: str, heads: int, qlen: int, max_qlen: int, kv: str, mode: str) -> list[str]:
    return [
        "explain",
        "--phase",
        "decode",
        "--arch",
        arch,
        "--heads",
        str(heads),
        "--qlen",
        str(qlen),
        "--max-decode-qlen",
        str(max_qlen),
        "--kv-dtype",
        kv,
        "--small-head-mode",
        mode,
    ]


def effective_choice(payload: dict[str, Any]) -> str | None:
    """The choice where the provider runs: ``chosen`` here, else ``if_available``."""
    return payload["chosen"] if payload["provider"]["available"] else payload["if_available"]


def assert_schema(payload: dict[str, Any], phase: str) -> None:
    assert payload["phase"] == phase
    assert {"phase", "chosen", "candidates", "if_available", "provider"} <= set(payload)
    for cand in payload["candidates"]:
        assert {"name", "supported", "reasons"} <= set(cand)
        assert cand["supported"] == (not cand["reasons"])


@pytest.mark.parametrize(("row", "expected"), DECODE_TABLE, ids=case_id)
def test_decode_table_emulated(
    capsys: pytest.CaptureFixture[str], row: tuple[Any, ...], expected: str
) -> None:
    """aiter's capability record on the always-available torch kernels reproduces each row."""
    code, payload = run_json(capsys, *decode_args(*row), *PROVIDER_FLAGS["emulated"])
    assert_schema(payload, "decode")
    assert payload["chosen"] == expected
    assert code == cli.EXIT_OK
    assert payload["provider"]["emulated_by"] == "torch"


@pytest.mark.parametrize(("row", "expected"), DECODE_TABLE, ids=case_id)
def test_decode_table_aiter_provider(
    capsys: pytest.CaptureFixture[str], row: tuple[Any, ...], expected: str
) -> None:
    """With the aiter provider itself: chosen where it runs, ``if_available`` where it does not
    (then nothing can run here, so the exit code is 2)."""
    code, payload = run_json(capsys, *decode_args(*row), *PROVIDER_FLAGS["aiter"])
    assert_schema(payload, "decode")
    assert effective_choice(payload) == expected
    if payload["provider"]["available"]:
        assert code == cli.EXIT_OK
    else:
        assert payload["chosen"] is None
        assert code == cli.EXIT_UNSUPPORTED
        assert payload["provider"]["reasons"]


@pytest.mark.parametrize("flags", PROVIDER_FLAGS.values(), ids=PROVIDER_FLAGS.keys())
def test_130_heads_fit_nothing(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    code, payload = run_json(capsys, *decode_args(*NO_FIT_ROW), *flags)
    assert code == cli.EXIT_UNSUPPORTED
    assert payload["chosen"] is None
    assert payload["if_available"] is None
    paged = {c["name"]: c for c in payload["candidates"]}["asm-padded-persistent"]
    head_reasons = [r["message"] for r in paged["reasons"] if r["code"] == "heads"]
    assert head_reasons
    assert "130 heads" in head_reasons[0]
    assert "H <= 128 or H % 16 == 0" in head_reasons[0]


def test_130_heads_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, *decode_args(*NO_FIT_ROW), "--emulate", "aiter")
    assert code == cli.EXIT_UNSUPPORTED
    assert "no strategy fits" in out
    assert "[heads] 130 heads" in out


@pytest.mark.parametrize(("row", "expected"), PREFILL_TABLE, ids=case_id)
@pytest.mark.parametrize("provider", PROVIDER_FLAGS, ids=PROVIDER_FLAGS.keys())
def test_prefill_table(
    capsys: pytest.CaptureFixture[str], row: tuple[Any, ...], expected: str, provider: str
) -> None:
    arch, heads, kv, extra = row
    argv = ["explain", "--phase", "prefill", "--arch", arch, "--heads", str(heads), "--kv-dtype", kv]
    code, payload = run_json(capsys, *argv, *extra, *PROVIDER_FLAGS[provider])
    assert_schema(payload, "prefill")
    assert effective_choice(payload) == expected
    assert code == (cli.EXIT_OK if payload["provider"]["available"] else cli.EXIT_UNSUPPORTED)


def test_human_table_marks_the_winner(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, *decode_args("gfx950", 12, 3, 4, "bf16", "auto"), "--emulate", "aiter")
    assert code == cli.EXIT_OK
    assert "-> gluon-verify-flatten: supported" in out
    assert "=> gluon-verify-flatten" in out
    assert "[qlen]" in out  # GluonDecode's reason is listed, not only the winner


def test_unavailable_provider_says_why_and_what_it_would_choose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider module that cannot be imported is reported, with aiter's static record used to
    show what it would choose."""

    def missing(name: str) -> mla.KernelProvider:
        raise ProviderUnavailableError(f"provider: {name!r} cannot be imported here: no ROCm")

    monkeypatch.setattr(cli_info, "get_provider", missing)
    code, out = run_cli(capsys, *decode_args("gfx950", 8, 1, 1, "bf16", "auto"))  # default: aiter on gfx
    assert code == cli.EXIT_UNSUPPORTED
    assert "provider aiter: not available here" in out
    assert "no ROCm" in out
    assert "if the provider were available: gluon-decode" in out


def test_import_failure_of_any_kind_is_a_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(name: str) -> mla.KernelProvider:
        raise AttributeError("module 'mla.providers.aiter' has no attribute 'AiterProvider'")

    monkeypatch.setattr(cli_info, "get_provider", broken)
    code, payload = run_json(capsys, *decode_args("gfx942", 16, 1, 1, "bf16", "auto"), "--provider", "aiter")
    assert code == cli.EXIT_UNSUPPORTED
    assert payload["provider"]["available"] is False
    assert "AttributeError" in payload["provider"]["reasons"][0]["message"]
    assert payload["if_available"] == "asm-padded-persistent"


def test_environment_knob_applies_and_flag_wins(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ROCM_AITER_MLA_ASM_PADDING", "asm")
    argv = ["explain", "--arch", "gfx950", "--heads", "8", "--emulate", "aiter"]
    _, payload = run_json(capsys, *argv)
    assert payload["chosen"] == "asm-padded-persistent"
    _, payload = run_json(capsys, *argv, "--small-head-mode", "auto")
    assert payload["chosen"] == "gluon-decode"


def test_forced_strategy_uses_the_same_checks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*decode_args("gfx942", 8, 1, 1, "bf16", "auto"), "--emulate", "aiter", "--force", "gluon-decode"]
    code, payload = run_json(capsys, *argv)
    assert code == cli.EXIT_UNSUPPORTED
    assert payload["chosen"] is None
    assert payload["forced"] == "gluon-decode"
    gluon = {c["name"]: c for c in payload["candidates"]}["gluon-decode"]
    assert "missing-kernel" in [r["code"] for r in gluon["reasons"]]


def test_mixed_qlen_marks_the_batch_non_uniform(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*decode_args("gfx942", 8, 3, 4, "bf16", "auto"), "--emulate", "aiter"]
    _, uniform = run_json(capsys, *argv)
    _, mixed = run_json(capsys, *argv, "--mixed-qlen")
    assert uniform["context"]["uniform_qlen"] is True
    assert mixed["context"]["uniform_qlen"] is False
    assert mixed["chosen"] == uniform["chosen"] == "asm-padded-persistent"


@pytest.mark.parametrize("flags", PROVIDER_FLAGS.values(), ids=PROVIDER_FLAGS.keys())
def test_native_h24_reaches_the_capability_record(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    argv = [*decode_args("gfx950", 24, 1, 1, "bf16", "auto"), *flags]
    _, default = run_json(capsys, *argv)
    _, native = run_json(capsys, *argv, "--native-h24")
    assert 24 not in default["capabilities"]["native_head_counts"]
    assert 24 in native["capabilities"]["native_head_counts"]
    assert effective_choice(native) == "asm-padded-persistent"


def test_explain_subprocess_json() -> None:
    """``python -m mla explain ... --json`` in a fresh interpreter: JSON on stdout, exit code."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mla",
            *decode_args("gfx950", 8, 1, 1, "bf16", "auto"),
            "--emulate",
            "aiter",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["chosen"] == "gluon-decode"
    assert payload["candidates"][0]["name"] == "gluon-decode"


def test_info_human(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "info")
    assert code == cli.EXIT_OK
    for name in mla.provider_names():
        assert f"  {name}: " in out
    for phase in Phase:
        for name in mla.DEFAULT_REGISTRY.names(phase):
            assert name in out
    assert "platform:" in out


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = run_json(capsys, "info")
    assert code == cli.EXIT_OK
    assert payload["version"] == mla.__version__
    assert [p["name"] for p in payload["providers"]] == list(mla.provider_names())
    torch_entry = payload["providers"][0]
    assert torch_entry["available"] is True
    assert torch_entry["capabilities"]["head_granularity"] == 1
    for entry in payload["providers"]:
        assert entry["available"] == (not entry["reasons"])
    for phase in Phase:
        rows = payload["strategies"][phase.value]
        assert [r["name"] for r in rows] == list(mla.DEFAULT_REGISTRY.names(phase))
        assert [r["priority"] for r in rows] == sorted(r["priority"] for r in rows)
    assert payload["auto_provider"] in mla.provider_names()


def test_info_survives_a_broken_provider(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cli_info.get_provider

    def flaky(name: str) -> mla.KernelProvider:
        if name == "aiter":
            raise RuntimeError("Get GPU arch from rocminfo failed")
        return real(name)

    monkeypatch.setattr(cli_info, "get_provider", flaky)
    code, payload = run_json(capsys, "info")
    assert code == cli.EXIT_OK
    aiter = {p["name"]: p for p in payload["providers"]}["aiter"]
    assert aiter["available"] is False
    assert "rocminfo" in aiter["reasons"][0]["message"]


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("sm_90", "sm90"),
        ("SM90a", "sm90"),
        ("h100", "sm90"),
        ("gfx942:sramecc+:xnack-", "gfx942"),
        ("mi355x", "gfx950"),
    ],
)
def test_arch_spellings_map_to_the_canonical_name(
    capsys: pytest.CaptureFixture[str], spelling: str, canonical: str
) -> None:
    code, payload = run_json(capsys, "explain", "--arch", spelling, "--emulate", "aiter")
    assert payload["context"]["arch"] == canonical
    assert code in (cli.EXIT_OK, cli.EXIT_UNSUPPORTED)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["explain", "--arch", "banana"],
            "argument --arch: unknown arch 'banana'; expected one of gfx90a, gfx942",
        ),
        (["explain", "--arch", "sm_9"], "argument --arch: unknown arch 'sm_9'"),
        (["demo", "--arch", "banana"], "argument --arch: unknown arch 'banana'"),
        (["explain", "--heads", "abc"], "argument --heads: 'abc' is not a positive integer"),
        (["explain", "--qlen", "0"], "argument --qlen: '0' is not a positive integer"),
        (["demo", "--steps", "-3"], "argument --steps: '-3' is not a positive integer"),
        (["explain", "--force", "nope"], "argument --force: unknown strategy 'nope'"),
    ],
    ids=["arch-banana", "arch-sm_9", "demo-arch", "heads-abc", "qlen-0", "steps-negative", "force-nope"],
)
def test_bad_arguments_are_rejected_in_the_users_terms(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "_positive_int" not in err
    assert "positive_int value" not in err


def test_force_accepts_the_class_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = run_json(
        capsys,
        *decode_args("gfx950", 8, 1, 1, "bf16", "auto"),
        "--emulate",
        "aiter",
        "--force",
        "GluonDecode",
    )
    assert code == cli.EXIT_OK
    assert payload["forced"] == payload["chosen"] == "gluon-decode"


def test_json_numbers_and_flags_keep_their_type(capsys: pytest.CaptureFixture[str]) -> None:
    _, payload = run_json(capsys, *decode_args("gfx950", 12, 3, 4, "bf16", "auto"), "--emulate", "aiter")
    context = payload["context"]
    assert (context["heads"], context["max_qlen"], context["max_decode_qlen"]) == (12, 3, 4)
    assert context["graph_mode"] == "none"
    assert context["uniform_qlen"] is True
    assert payload["capabilities"]["head_granularity"] == 16
    assert payload["capabilities"]["uniform_qlen_padding"] == [[2, 4], [3, 4]]
    assert "non-persistent fp8 KV, heads [16, 128], qlen 1..4" in payload["capabilities"]["paged_kernels"]


def test_availability_reasons_are_said_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(name: str) -> mla.KernelProvider:
        raise ProviderUnavailableError(f"provider: {name!r} cannot be imported here: no ROCm")

    monkeypatch.setattr(cli_info, "get_provider", missing)
    code, out = run_cli(capsys, *decode_args("gfx950", 12, 3, 4, "bf16", "auto"))
    assert code == cli.EXIT_UNSUPPORTED
    assert out.count("no ROCm") == 1
    assert "gluon-verify-flatten: supported where the provider is available" in out
    assert "[qlen]" in out  # GluonDecode's own reason still shows


def test_readme_explain_examples_run_anywhere(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    commands = [
        line.split("#")[0].split()[1:] for line in readme.splitlines() if line.startswith("mla explain")
    ]
    assert commands
    for argv in commands:
        code, _ = run_cli(capsys, *argv)
        assert code == (cli.EXIT_UNSUPPORTED if "130" in argv else cli.EXIT_OK), argv


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_explain_takes_the_engine_graph_mode(capsys: pytest.CaptureFixture[str], mode: str) -> None:
    """Every built-in decode strategy is capturable: the graph mode is shown and changes nothing."""
    code, payload = run_json(
        capsys, *decode_args("gfx950", 8, 1, 1, "bf16", "auto"), "--emulate", "aiter", "--graph-mode", mode
    )
    assert code == cli.EXIT_OK
    assert payload["context"]["graph_mode"] == mode
    assert payload["chosen"] == "gluon-decode"
