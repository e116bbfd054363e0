"""No code path reaches a kernel combination aiter lacks (``mla_asm.csv``); where vLLM's
rules alone would pick one, the backend refuses at construction with the reason."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from aiter_cases import decode_backend, decode_case, fake_provider, fp8_for, run_decode

from mla import AsmNonPersistent, PaddedAsmPersistent, UnsupportedError
from mla.providers.aiter.capabilities import aiter_capabilities
from mla.providers.aiter.lse import kernel_returns_decode_lse

KERNEL_HEADS = (16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 256)
"""Every kernel head count a strategy can hand the paged decode (padded to 16, or 24 native)."""


def _fake_dispatch_ok(arch: str, *, persistent: bool, fp8: bool, heads: int, qlen: int) -> bool:
    """Whether the fake aiter accepts this call as the provider makes it (heads 24 run as 32
    with fp8; the LSE asked for where the provider's rule allows it)."""
    table = importlib.import_module("aiter._asm_table")
    kernel_heads = 32 if fp8 and heads == 24 else heads
    lse = kernel_returns_decode_lse(arch, persistent=persistent, fp8=fp8, heads=kernel_heads, qlen=qlen)
    kind = "fp8" if fp8 else "bf16"
    try:
        run_heads = kernel_heads
        if persistent:
            run_heads, _ = table.persistent_heads(arch, kernel_heads, qlen, fp8, fp8)
            table.check_reduce(run_heads, 512)
        elif fp8:
            table.block_n_fp8(kernel_heads, qlen)
        table.asm_kernel(arch, kind, kind, run_heads, persistent, qlen, lse)
    except (AssertionError, KeyError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_capability_table_is_exactly_the_kernels_aiter_dispatches(fake_aiter, arch: str) -> None:
    fake_aiter(arch)
    caps = aiter_capabilities(arch)
    mismatches = []
    for persistent, fp8, heads, qlen in itertools.product(
        (True, False), (False, True), KERNEL_HEADS, range(1, 9)
    ):
        if heads == 24 and arch != "gfx950":
            continue  # native 24 heads exist on gfx950 only; elsewhere 24 pads to 32
        claimed = caps.has_paged_kernel(persistent=persistent, fp8=fp8, heads=heads, qlen=qlen)
        if claimed != _fake_dispatch_ok(arch, persistent=persistent, fp8=fp8, heads=heads, qlen=qlen):
            mismatches.append((persistent, fp8, heads, qlen, claimed))
    assert not mismatches


def test_gfx942_fp8_past_qlen_4_is_refused_when_the_backend_is_built(fake_aiter) -> None:
    fake = fake_aiter("gfx942")
    case = decode_case(16, (6, 6), (30, 9), kv_dtype=fp8_for("gfx942"), max_decode_qlen=6)
    with pytest.raises(UnsupportedError) as info:
        decode_backend(fake_provider(), "gfx942", case, num_blocks=8)
    explanation = info.value.explanation
    assert explanation is not None
    persistent = {r.code for r in explanation.candidate(PaddedAsmPersistent.NAME).reasons}
    assert persistent == {"kernel-table"}
    assert [r.code for r in explanation.candidate(AsmNonPersistent.NAME).reasons] == ["kernel-table"]
    assert "max_decode_qlen 6" in str(info.value)
    assert not fake.calls("mla_decode_fwd")


def test_the_fp8_asm_fallback_at_a_missing_heads_x_qlen_product_is_refused(fake_aiter) -> None:
    fake = fake_aiter("gfx950", omit=("get_mla_metadata_v1",))  # no persistent metadata: asm fallback
    provider = fake_provider()
    case = decode_case(16, (5, 5), (30, 9), kv_dtype=torch.float8_e4m3fn, max_decode_qlen=5)
    with pytest.raises(
        UnsupportedError, match=r"no non-persistent fp8-KV decode kernel for 16 kernel heads at kernel qlen 5"
    ):
        decode_backend(provider, "gfx950", case, num_blocks=8)
    # A product get_block_n_fp8 has (32 x 1) whose C++ kernel does not exist is refused too.
    with pytest.raises(UnsupportedError, match="no non-persistent fp8-KV decode kernel for 32 kernel heads"):
        decode_backend(
            provider, "gfx950", decode_case(32, (1, 1), (30, 9), kv_dtype=torch.float8_e4m3fn), num_blocks=8
        )
    assert not fake.calls("mla_decode_fwd")


def test_gfx942_bf16_past_qlen_4_runs_non_persistent_at_any_head_count(fake_aiter) -> None:
    fake = fake_aiter("gfx942")
    provider = fake_provider()
    case = decode_case(16, (6, 6), (30, 9), max_decode_qlen=8)
    run = run_decode(provider, "gfx942", case)
    assert run.strategy == AsmNonPersistent.NAME
    assert run.comparison.ok, run.comparison
    assert [c["persistent"] for c in fake.calls("mla_decode_fwd")] == [False]
    with pytest.raises(UnsupportedError, match="kernel-table"):
        run_decode(provider, "gfx942", case, force=PaddedAsmPersistent)


def test_fp8_decode_always_sends_an_fp8_query(fake_aiter) -> None:
    """bf16-q/fp8-kv ("a16w8") kernels exist only persistent up to qlen 4: never ask for them."""
    for arch in ("gfx942", "gfx950"):
        fake = fake_aiter(arch)
        provider = fake_provider()
        fp8 = fp8_for(arch)
        for case, force in (
            (decode_case(8, (1, 1), (30, 9), kv_dtype=fp8), None),
            (decode_case(16, (3, 2), (30, 9), kv_dtype=fp8, max_decode_qlen=4), None),
            (decode_case(16, (2, 2), (30, 9), kv_dtype=fp8), AsmNonPersistent),
        ):
            run = run_decode(provider, arch, case, force=force)
            assert run.comparison.ok, (arch, case.id, run.comparison)
        calls = fake.calls("mla_decode_fwd")
        assert calls
        assert all(call["q_dtype"] == fp8 and call["kv_dtype"] == fp8 for call in calls)


def test_the_fake_rejects_the_kernels_aiter_lacks(fake_aiter) -> None:
    fake_aiter("gfx950")
    table = importlib.import_module("aiter._asm_table")
    with pytest.raises(RuntimeError, match=r"cannot get heuristic kernel.*qseqlen:5"):
        table.asm_kernel("gfx950", "bf16", "fp8", 16, True, 5, False)  # a16w8 past qlen 4 (aiter #4752)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel"):
        table.asm_kernel(
            "gfx950", "bf16", "fp8", 16, False, 1, False
        )  # no non-persistent a16w8 (vLLM #51232)
    with pytest.raises(KeyError):
        table.block_n_fp8(16, 5)  # non-persistent fp8 at 16 x 5 = 80 (vLLM #51011)
    with pytest.raises(RuntimeError, match="qo_len>4 in persistent mode on gfx950"):
        table.asm_kernel("gfx942", "fp8", "fp8", 16, True, 5, False)
    with pytest.raises(RuntimeError, match="lse:1"):
        table.asm_kernel("gfx942", "bf16", "bf16", 16, True, 4, True)  # no lse_ps kernel on gfx942
