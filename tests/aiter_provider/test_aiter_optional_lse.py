"""A decode without an LSE (``lse=None``) neither asks aiter for one nor runs the reference LSE pass.

Each case runs one backend step twice on the strict fake: with an LSE tensor (compared to the
reference) and with ``lse=None``, spying on the provider's reference LSE passes and reading the
``return_lse`` flag of every aiter call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from aiter_cases import decode_backend, decode_case, fake_provider

from mla import AsmNonPersistent, GluonDecode, PaddedAsmPersistent
from mla.decode.base import DecodeStrategy
from mla.providers.aiter import decode_calls
from mla.testing import DecodeCase, compare_to_reference, make_decode_inputs

FALLBACKS = ("reference_decode_lse", "reference_small_head_lse")
KERNELS = ("mla_decode_fwd", "mla_gluon", "mla_decode_gluon")

# (arch, case, forced strategy, small-head mode, the reference pass runs when an LSE is wanted)
CASES = [
    # gfx942 has no persistent bf16 lse kernel: the LSE comes from the reference pass.
    ("gfx942", decode_case(16, (1, 1, 1), (30, 9, 0), extra_rows=1), PaddedAsmPersistent, "auto", True),
    # Head padding 8 -> 16 and qlen padding 3 -> 4 on the padded path.
    ("gfx942", decode_case(8, (3, 3), (40, 5), max_decode_qlen=4), PaddedAsmPersistent, "auto", True),
    # gfx950 bf16 persistent: aiter returns the LSE itself (return_lse).
    ("gfx950", decode_case(16, (1, 1), (50, 7)), PaddedAsmPersistent, "asm", False),
    # Non-persistent: aiter's stage-2 reduce returns it.
    ("gfx942", decode_case(16, (2, 2), (26, 3), max_decode_qlen=8), AsmNonPersistent, "auto", False),
    # Gluon small-head kernel with return_lse.
    ("gfx950", decode_case(8, (1, 1, 1), (20, 1, 45)), GluonDecode, "auto", False),
]


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the provider's reference LSE passes with counting wrappers; returns the call log."""
    log: list[str] = []
    for name in FALLBACKS:
        original: Callable[..., None] = getattr(decode_calls, name)

        def spy(*args: Any, _name: str = name, _original: Callable[..., None] = original, **kw: Any) -> None:
            log.append(_name)
            _original(*args, **kw)

        monkeypatch.setattr(decode_calls, name, spy)
    return log


def _lse_requests(fake: Any) -> list[bool]:
    return [bool(call["return_lse"]) for name in KERNELS for call in fake.calls(name)]


@pytest.mark.parametrize(
    ("arch", "case", "strategy", "mode", "fallback"),
    CASES,
    ids=[f"{c[0]}-{c[2].NAME}-{c[1].id.split('-bf16')[0]}" for c in CASES],
)
def test_decode_without_lse_skips_every_lse_computation(
    fake_aiter: Any,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    case: DecodeCase,
    strategy: type[DecodeStrategy],
    mode: str,
    fallback: bool,
) -> None:
    fake = fake_aiter(arch)
    log = _spy(monkeypatch)
    inputs = make_decode_inputs(case)
    backend = decode_backend(
        fake_provider(), arch, case, num_blocks=inputs.kv_cache.shape[0], force=strategy, small_head_mode=mode
    )
    metadata = backend.builder.build(inputs.step())
    assert metadata.decode is not None
    assert metadata.decode.strategy == strategy.NAME

    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out, lse=lse)
    ref_out, ref_lse = inputs.reference()
    comparison = compare_to_reference(out, lse, ref_out, ref_lse)
    assert comparison.ok, comparison
    with_lse = _lse_requests(fake)
    assert with_lse == [not fallback]
    assert len(log) == int(fallback)

    out_only, _ = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out_only, lse=None)
    assert len(log) == int(fallback), f"the reference LSE pass ran without an LSE: {log}"
    assert _lse_requests(fake)[len(with_lse) :] == [False]
    assert not torch.isnan(out_only).any(), "rows left unwritten without an LSE"
    assert torch.equal(out_only, out)
    error = torch.linalg.vector_norm(out_only.double() - ref_out) / torch.linalg.vector_norm(ref_out)
    assert float(error) <= comparison.tolerance
