"""Verify rows (qlen > 1) on the non-persistent paged decode run on the caller's tensors.

A provider whose multi-row tiles mask their stores
(``ProviderCapabilities.decode_multi_row_stores_masked``: torch, Triton, Gluon) gets the
caller's ``q`` and ``out``: the strategy's workspace is never written (no copy in, no zeroing,
no copy out). A provider without it (aiter's asm kernels) gets a zeroed workspace and the owned
rows are copied out. Both give the reference result.
"""

from __future__ import annotations

import pytest
import torch

import mla
from mla.providers.torch_ref import TorchProvider
from mla.testing import reference_provider_with
from mla.tools.reference import reference_decode

RANK, ROPE, HEADS, BLOCK = 64, 16, 4, 16
QLEN, SEQ_LENS = 3, (40, 21, 3)
SCALE = 0.125


def _provider(name: str) -> str | TorchProvider:
    if name == "torch-unmasked-stores":
        return reference_provider_with(decode_multi_row_stores_masked=False)
    return name


@pytest.mark.parametrize(
    "provider",
    ["torch", pytest.param("triton", marks=pytest.mark.interpret), "torch-unmasked-stores"],
)
def test_verify_rows_run_on_the_callers_tensors(provider: str) -> None:
    if provider == "triton" and not mla.get_provider("triton").availability():
        pytest.skip("triton is unavailable here")
    blocks_per_request = 3
    num_blocks = len(SEQ_LENS) * blocks_per_request
    backend = mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, 32, 24, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=num_blocks),
        mla.EngineLimits(len(SEQ_LENS), blocks_per_request * BLOCK, 64, max_decode_qlen=QLEN),
        model_dtype=torch.float32,
        provider=_provider(provider),  # type: ignore[arg-type]
        platform="cpu",
        decode_strategy="asm-non-persistent",
        preallocate=False,
    )
    gen = torch.Generator().manual_seed(5)
    rows = QLEN * len(SEQ_LENS)
    qsl = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32) * QLEN
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=gen).view(len(SEQ_LENS), -1).to(torch.int32)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl, query_start_loc=qsl.clone(), seq_lens=lens.clone(), seq_lens_cpu=lens,
        block_table=table, num_decodes=len(SEQ_LENS), num_decode_tokens=rows,
    )  # fmt: skip
    cache = torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=gen)
    q = torch.randn(rows, HEADS, RANK + ROPE, generator=gen)
    metadata = backend.builder.build(step)
    strategy, _ = backend.current_decode()
    assert type(strategy).__name__ == "AsmNonPersistent"
    workspace = strategy.workspace  # type: ignore[attr-defined]
    for buffer in (workspace.q_kernel, workspace.o_kernel, workspace.lse_kernel):
        buffer.fill_(float("nan"))
    out = torch.full((rows, HEADS, RANK), float("nan"))
    lse = torch.full((rows, HEADS), float("nan"))
    backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse)
    want_out, want_lse = reference_decode(q, cache, table, lens, qsl, softmax_scale=SCALE, kv_lora_rank=RANK)
    torch.testing.assert_close(out, want_out.to(torch.float32), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want_lse.to(torch.float32), atol=2e-5, rtol=2e-5)
    untouched = all(
        bool(b.isnan().all()) for b in (workspace.q_kernel, workspace.o_kernel, workspace.lse_kernel)
    )
    assert untouched == (provider != "torch-unmasked-stores")
