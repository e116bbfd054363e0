"""``mla demo``: the serving loop runs mixed steps through the backend and checks every one."""

from __future__ import annotations

import io
from typing import Any

import attrs
import pytest
import torch

from mla.core.errors import InvalidInputError, UnsupportedError
from mla.providers.calls import PagedDecodeCall, VarlenPrefillCall
from mla.providers.torch_ref import TorchProvider
from mla.tools import cli
from mla.tools.demo import run_demo
from mla.tools.demo_dcp import run_dcp_demo
from mla.tools.demo_records import DemoConfig, DemoReport, StepRecord

# Small latent dims keep each run to a fraction of a second on a CPU; the loop is the same.
SMALL = DemoConfig(
    steps=32,
    heads=4,
    seed=3,
    kv_lora_rank=64,
    rope_dim=16,
    nope_dim=32,
    v_dim=32,
    block_size=4,
    max_num_seqs=4,
    max_model_len=96,
    max_num_batched_tokens=48,
)


AITER_LATENT = {"kv_lora_rank": 512, "rope_dim": 64}
"""aiter's decode kernels are built for DeepSeek's latent dims only."""


def small(**changes: Any) -> DemoConfig:
    return attrs.evolve(SMALL, **changes)


def exercised(report: DemoReport) -> dict[str, int]:
    return dict(report.composition)


def test_torch_provider_passes_and_reports_strategies_per_phase() -> None:
    records: list[StepRecord] = []
    report = run_demo(small(provider="torch"), progress=records.append)
    assert report.passed, report.summary()
    assert report.provider == "torch"
    assert [r.index for r in records] == list(range(SMALL.steps))
    assert all(r.ok for r in records)
    assert report.strategies("decode") == {"asm-padded-persistent": report.decode.steps}
    assert report.strategies("prefill") == {"flash-varlen": report.prefill.steps}
    assert 0 < report.decode.max_rel_error < report.decode.tolerance
    assert report.tokens == report.decode.tokens + report.prefill.tokens
    features = exercised(report)
    for feature in (
        "prefills with cached context",
        "prefills without context",
        "verify requests",
        "graph-padded steps",
        "padding rows",
        "context chunks",
    ):
        assert features.get(feature, 0) > 0, feature
    summary = report.summary()
    assert "asm-padded-persistent" in summary
    assert "flash-varlen" in summary
    assert "PASSED" in summary


def test_emulated_aiter_runs_the_small_head_paths() -> None:
    """aiter's record on gfx950 with 8 heads: Gluon decode and verify flattening run on a CPU."""
    report = run_demo(small(heads=8, emulate="aiter", arch="gfx950", **AITER_LATENT))
    assert report.passed, report.summary()
    assert report.provider == "torch (emulating aiter)"
    assert set(report.strategies("decode")) == {"gluon-decode", "gluon-verify-flatten"}


def test_emulated_aiter_gfx942_pads_heads_and_qlen() -> None:
    """gfx942, 8 heads padded to 16, verifies up to qlen 6: persistent where aiter has kernels,
    non-persistent past qlen 4."""
    report = run_demo(
        small(heads=8, emulate="aiter", arch="gfx942", max_decode_qlen=6, steps=12, **AITER_LATENT)
    )
    assert report.passed, report.summary()
    assert set(report.strategies("decode")) == {"asm-padded-persistent", "asm-non-persistent"}


def test_fp8_cache_uses_both_prefill_strategies() -> None:
    report = run_demo(small(kv_dtype="fp8"))
    assert report.passed, report.summary()
    assert report.kv_dtype == "float8_e4m3fn"
    assert set(report.strategies("prefill")) == {"fp8-persistent-prefill", "flash-varlen"}


def test_fp32_is_held_to_the_fp32_tolerance() -> None:
    report = run_demo(small(dtype="fp32", steps=12))
    assert report.passed, report.summary()
    assert report.decode.tolerance == 1e-5
    assert report.decode.max_rel_error < 1e-5


class WrongScaleDecode(TorchProvider):
    """The classic bug: the kernel's default scale 1/sqrt(576) instead of the model's."""

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        super().paged_mqa_decode(attrs.evolve(call, softmax_scale=call.q.shape[-1] ** -0.5))


class DropsLastPrefillRow(TorchProvider):
    """Leaves the last output row of every varlen call unwritten."""

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        full, full_lse = torch.empty_like(call.out), torch.empty_like(call.lse)
        super().varlen_attention(attrs.evolve(call, out=full, lse=full_lse))
        call.out[:-1].copy_(full[:-1])
        call.lse[:-1].copy_(full_lse[:-1])


def test_a_wrong_decode_is_reported() -> None:
    report = run_demo(small(provider=WrongScaleDecode(), steps=8))
    assert not report.passed
    assert report.failures
    assert {f.phase for f in report.failures} == {"decode"}
    assert report.failures[0].strategy == "asm-padded-persistent"
    assert report.decode.max_rel_error > report.decode.tolerance
    assert "FAILED" in report.summary()


def test_an_unwritten_prefill_row_is_reported() -> None:
    report = run_demo(small(provider=DropsLastPrefillRow(), steps=8))
    assert not report.passed
    assert "prefill" in {f.phase for f in report.failures}
    assert report.prefill.max_rel_error > report.prefill.tolerance


def test_cli_demo_exit_codes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``mla demo`` prints progress and the summary; exit 1 when a step misses its tolerance."""
    real_run = cli.run_demo

    def shrunk(config: DemoConfig, progress: Any = None) -> DemoReport:
        sized = attrs.evolve(SMALL, steps=config.steps, heads=config.heads, provider=config.provider)
        return real_run(sized, progress=progress)

    monkeypatch.setattr(cli, "run_demo", shrunk)
    assert cli.main(["demo", "--steps", "6", "--heads", "2"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert "PASSED" in captured.out
    assert "6/6 steps" in captured.err

    def broken(config: DemoConfig, progress: Any = None) -> DemoReport:
        return real_run(attrs.evolve(SMALL, steps=6, provider=WrongScaleDecode()), progress=progress)

    monkeypatch.setattr(cli, "run_demo", broken)
    assert cli.main(["demo", "--quiet"]) == cli.EXIT_FAILED
    assert "FAILED" in capsys.readouterr().out


def test_cli_demo_reports_an_unservable_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    """aiter's kernels take bf16 queries only: an fp32 model cannot be served, before any step."""
    code = cli.main(["demo", "--emulate", "aiter", "--arch", "gfx950", "--dtype", "fp32", "--quiet"])
    assert code == cli.EXIT_UNSUPPORTED
    assert "q-dtype" in capsys.readouterr().err


def test_unservable_configuration_raises_before_any_step() -> None:
    with pytest.raises(UnsupportedError):
        run_demo(small(emulate="aiter", arch="gfx950", dtype="fp32"))


def test_config_rejects_sizes_the_loop_cannot_serve() -> None:
    with pytest.raises(InvalidInputError, match="max_model_len"):
        small(max_model_len=8)
    with pytest.raises(InvalidInputError, match="max_num_batched_tokens"):
        small(max_num_batched_tokens=16)


@pytest.mark.parametrize(
    ("changes", "argument", "match"),
    [
        ({"kv_dtype": "fp8_ds_mla"}, "kv_dtype", "add --sparse"),
        ({"sparse": True, "dcp": 2}, "dcp", "drop --dcp or --sparse"),
    ],
    ids=["fp8_ds_mla-without-sparse", "sparse-with-dcp"],
)
def test_config_rejects_options_that_do_not_go_together(
    changes: dict[str, Any], argument: str, match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match) as info:
        small(**changes)
    assert info.value.argument == argument


def test_progress_bar_writes_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    bar = cli.ProgressBar(stream)
    for index in range(20):
        bar(StepRecord(index, 20, "gluon-decode", None, 1, 0, ok=index != 3))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[-1].startswith("[" + "#" * 28 + "]")
    assert "20/20 steps" in lines[-1]
    assert "FAILED: 1" in lines[-1]


@pytest.mark.heavy
def test_dcp_demo_checks_every_rank_against_the_single_process_run() -> None:
    """``mla demo --dcp 2``: two gloo processes serve the sharded cache; every step's decode and
    prefill on each rank's head slice match the single-process backend."""
    records: list[StepRecord] = []
    report = run_dcp_demo(small(dcp=2, dcp_interleave=3, steps=12), progress=records.append)
    assert report.passed, report.summary()
    assert [r.index for r in records] == list(range(12))
    phases = {stats.phase: stats for stats in report.extra}
    assert {"dcp decode", "dcp prefill"} <= set(phases)
    assert phases["dcp decode"].steps == report.decode.steps
    assert phases["dcp prefill"].steps == report.prefill.steps
    assert "decode context parallelism over 2 ranks (interleave 3)" in report.summary()


def test_run_demo_serves_one_process() -> None:
    """``run_demo`` does not start rank processes: ``dcp > 1`` is ``run_dcp_demo``'s."""
    with pytest.raises(InvalidInputError, match="run_dcp_demo"):
        run_demo(small(dcp=2, steps=2))


def test_dcp_demo_needs_heads_that_split_over_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidInputError, match="heads"):
        small(heads=4, dcp=3)
    assert cli.main(["demo", "--dcp", "3", "--heads", "4", "--quiet"]) == cli.EXIT_UNSUPPORTED
    assert "dcp=3" in capsys.readouterr().err
