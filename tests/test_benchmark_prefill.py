"""The prefill benchmark on the CPU: its FlexAttention peer on tiny shapes (eager
``flex_attention``: ``torch.compile`` of it takes some 10 s on the CPU, so the compiled function
is swapped for the eager one), and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import prefill
from benchmarks.prefill import Case, flex_attention_peer, flex_varlen, reference_heads

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention


def per_request_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    """Plain softmax attention, causal within each request, one request at a time: ``[T, H, Dv]``."""
    outs, start = [], 0
    for n in lengths:
        qh, kh, vh = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        scores = (qh @ kh.transpose(1, 2)) * scale
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((scores.softmax(dim=-1) @ vh).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("pad_v", [False, True])
def test_flex_varlen_is_causal_within_each_request_only(pad_v: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths, heads = [5, 3], 2
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, heads, 192, generator=gen) for _ in range(2))
    v = torch.randn(tokens, heads, 128, generator=gen)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    scale = 0.1  # not flex_attention's default (192**-0.5): a scale not passed on shows
    out = flex_varlen(q, k, v, cu, scale=scale, pad_v=pad_v, compiled=False)()
    assert out.shape == (tokens, heads, 128)
    torch.testing.assert_close(out, per_request_causal(q, k, v, lengths, scale), rtol=1e-5, atol=1e-5)
    # The second request's first token sees only itself: its output is its own value row.
    torch.testing.assert_close(out[5], v[5], rtol=1e-5, atol=1e-5)


def _cpu_case() -> Case:
    return Case(2, 2, 8, device="cpu")


def test_flex_attention_peer_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill, "compiled_flex_attention", lambda: flex_attention)
    case = _cpu_case()
    peer = flex_attention_peer(case)
    assert peer is not None
    assert peer.note == "[1,H,T,D] block mask, v 128"
    ref_out, _ = reference_heads(case.q, case.k, case.v, case, [0, 1])
    assert prefill.rel(peer(), ref_out) < 1e-2


def test_flex_attention_peer_pads_v_where_flex_refuses_its_head_dim(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def one_head_dim(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> Any:
        if value.shape[-1] != query.shape[-1]:
            raise RuntimeError("v head dim differs")
        return flex_attention(query, key, value, **kw)

    monkeypatch.setattr(prefill, "compiled_flex_attention", lambda: one_head_dim)
    monkeypatch.setattr(prefill, "_SAID", set())
    case = _cpu_case()
    peer = flex_attention_peer(case)
    assert peer is not None
    assert "v padded to 192" in peer.note
    assert "v head dim differs" in capsys.readouterr().out
    ref_out, _ = reference_heads(case.q, case.k, case.v, case, [0, 1])
    assert prefill.rel(peer(), ref_out) < 1e-2


def test_flex_attention_peer_is_left_out_with_the_reason_said_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(prefill, "compiled_flex_attention", lambda: refuse)
    monkeypatch.setattr(prefill, "_SAID", set())
    case = _cpu_case()
    assert flex_attention_peer(case) is None
    assert flex_attention_peer(case) is None
    said = capsys.readouterr().out
    assert said.count("flex-attention: left out") == 1
    assert "no kernel here" in said


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        {"shape": shape, "impl": impl, "time_us": 100.0, "TFLOP/s": tf}
        for shape in ("H=16 4x4096", "H=128 16x1024")
        for impl, tf in (("varlen_attn", 240.0), ("triton-bf16", 404.0), ("flex-attention", 300.0))
    ]
    rows += [
        {"shape": "H=16 4x(2048 new + 16384 cached)", "impl": "chunked-context step", "TFLOP/s": 350.0},
        {"shape": "H=16 4x(2048 new + 16384 cached)", "impl": "up-projection alone",
         "TFLOP/s": float("nan")},
    ]  # fmt: skip
    path = tmp_path / "img" / "prefill.png"
    prefill.plot(rows, str(path), device="test GPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prefill.plot([], str(tmp_path / "empty.png"), device="test GPU")
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_interleaved_medians_time_every_row_once_a_round_in_turn() -> None:
    from benchmarks._common import interleaved_medians

    order: list[str] = []
    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    fns = {name: (lambda name=name: name) for name in times}

    def timer(fn: Any) -> float:
        name = fn()
        order.append(name)
        return next(times[name])

    assert interleaved_medians(fns, timer=timer, rounds=3) == {"a": 3.0, "b": 4.0}
    assert order == ["a", "b"] * 3


def test_interleaved_medians_refuse_zero_rounds() -> None:
    from benchmarks._common import interleaved_medians

    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        interleaved_medians({"a": lambda: None}, timer=lambda fn: 1.0, rounds=0)


def test_main_refuses_rounds_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prefill.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
