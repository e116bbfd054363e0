"""``lse=None`` on the decode path: every strategy writes the same ``out`` as with an LSE tensor.

Runs each decode strategy (forced) on the torch provider, the torch provider under aiter's gfx950
capability record (head padding, qlen padding, the persistent schedule) and the Triton provider
(in the interpreter on a CPU), once with an LSE tensor and once without, on one built plan.
Tiny latent dims (32 + 16) keep the interpreter runs short.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.base import DecodeStrategy
from mla.decode.gluon import GluonDecode
from mla.decode.gluon_verify_flatten import GluonVerifyFlatten
from mla.providers import emulated_provider, get_provider
from mla.testing import DecodeCase, compare_to_reference, decode_case_backend, make_decode_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TINY = {"kv_lora_rank": 32, "rope_dim": 16}
QLEN_1 = DecodeCase(heads=3, qlens=(1, 1, 1), seq_lens=(20, 1, 45), block_size=16, extra_rows=2, **TINY)
"""One token per request, a one-key request and graph-padding rows past the batch."""
MIXED = DecodeCase(heads=4, qlens=(3, 2), seq_lens=(30, 2), block_size=1, **TINY)
"""Verify rows of mixed qlen; the short request's first row sees no key."""
UNIFORM_2 = DecodeCase(heads=8, qlens=(2, 2, 2), seq_lens=(33, 0, 12), block_size=16, **TINY)
"""Uniform qlen 2 with an empty request (qlen-padded to 4 and head-padded under aiter)."""

STRATEGY_CASES: dict[type[DecodeStrategy], tuple[DecodeCase, ...]] = {
    GluonDecode: (QLEN_1,),
    GluonVerifyFlatten: (MIXED, UNIFORM_2),
    PaddedAsmPersistent: (QLEN_1, UNIFORM_2),
    AsmNonPersistent: (QLEN_1, MIXED),
}
PROVIDERS = {
    # name: (platform, q/kv dtype, provider factory)
    "torch": ("cpu", torch.float16, lambda: get_provider("torch")),
    "aiter-emulated": ("gfx950", torch.bfloat16, lambda: emulated_provider("aiter", "gfx950")),
    "triton": ("cpu" if DEVICE.type == "cpu" else "sm90", torch.float16, lambda: get_provider("triton")),
}


PARAMS = [
    pytest.param(
        name,
        strategy,
        case,
        id=f"{name}-{strategy.NAME}-{case.id.split('-bf16')[0]}",
        marks=[pytest.mark.interpret] if name == "triton" else [],
    )
    for name in PROVIDERS
    for strategy, cases in STRATEGY_CASES.items()
    for case in cases
]


@pytest.mark.parametrize(("provider_name", "strategy", "case"), PARAMS)
def test_decode_without_lse_writes_the_same_output(
    provider_name: str, strategy: type[DecodeStrategy], case: DecodeCase
) -> None:
    arch, dtype, make_provider = PROVIDERS[provider_name]
    if provider_name == "triton":
        pytest.importorskip("triton")
    case = attrs.evolve(case, q_dtype=dtype, kv_dtype=dtype)
    inputs = make_decode_inputs(case, DEVICE)
    backend = decode_case_backend(
        case,
        provider=make_provider(),
        platform=arch,
        strategy=strategy,
        device=DEVICE,
        num_blocks=inputs.kv_cache.shape[0],
    )
    metadata = backend.builder.build(inputs.step())
    assert metadata.decode is not None
    assert metadata.decode.strategy == strategy.NAME

    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out, lse=lse)
    comparison = compare_to_reference(out, lse, *inputs.reference())
    assert comparison.ok, comparison

    out_only, _ = inputs.poisoned_outputs()
    backend.impl.forward_decode(metadata, inputs.q, inputs.kv_cache, out=out_only, lse=None)
    assert not torch.isnan(out_only).any(), "rows left unwritten without an LSE"
    assert torch.equal(out_only, out)
