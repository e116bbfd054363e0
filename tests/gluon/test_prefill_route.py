"""Host side of the Gluon varlen prefill on a CPU: which calls the Gluon kernel takes
(:func:`~mla.providers.gluon.prefill_launch.prefill_route`), its launch configs, and the gluon
provider running the others on the Triton kernel (in the interpreter)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from mla.core.errors import InvalidInputError
from mla.providers.calls import AppendedKeys, VarlenPrefillCall
from mla.providers.gluon import GluonProvider
from mla.providers.gluon.prefill_launch import (
    APPENDED_KERNELS,
    CONTEXT_KERNELS,
    PERSISTENT_ANY_LENGTH_MAX_HEADS,
    PERSISTENT_MAX_SEQLEN_Q,
    SHARED_MEMORY_BYTES,
    PrefillKernel,
    PrefillLaunchConfig,
    default_kernel,
    launch_gluon_prefill,
    prefill_call_route,
    prefill_config,
    prefill_route,
    shared_bytes,
)
from mla.providers.torch_ref import TorchProvider
from mla.testing import assert_matches_reference

BF16 = torch.bfloat16


def _qkvo(
    dqk: int = 192, dv: int = 128, dtype: torch.dtype = BF16, tokens: int = 8, keys: int = 8, heads: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(tokens, heads, dqk, dtype=dtype),
        torch.zeros(keys, heads, dqk, dtype=dtype),
        torch.zeros(keys, heads, dv, dtype=dtype),
        torch.zeros(tokens, heads, dv, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("dqk", "dv", "dtype"),
    [(192, 128, torch.bfloat16), (192, 128, torch.float16), (128, 128, torch.bfloat16)],
)
def test_route_takes_16_bit_mla_dims(dqk: int, dv: int, dtype: torch.dtype) -> None:
    kernel, why = prefill_route(*_qkvo(dqk, dv, dtype))
    assert kernel == "gluon", why
    assert f"{dqk}/{dv}" in why


def test_route_takes_head_dim_slices_of_one_buffer() -> None:
    """k and v as slices of an up-projected ``[Tk, H, 320]`` buffer: strided heads, 16-byte
    aligned (v starts 384 bytes into each head)."""
    q, _, _, out = _qkvo()
    kv = torch.zeros(8, 4, 320, dtype=BF16)
    kernel, why = prefill_route(q, kv[..., :192], kv[..., 192:], out)
    assert kernel == "gluon", why


def _misaligned_base() -> torch.Tensor:
    return torch.zeros(8 * 4 * 192 + 4, dtype=BF16)[4:].view(8, 4, 192)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"q": torch.zeros(8, 4, 192)}, "query dtype torch.float32"),
        ({"k": torch.zeros(8, 4, 192, dtype=torch.float16)}, "mixed dtypes"),
        ({"q": torch.zeros(8, 4, 96, dtype=BF16), "k": torch.zeros(8, 4, 96, dtype=BF16)}, "dims 96/128"),
        ({"v": torch.zeros(8, 4, 64, dtype=BF16), "out": torch.zeros(8, 4, 64, dtype=BF16)}, "192/64"),
        ({"k": torch.zeros(0, 4, 192, dtype=BF16), "v": torch.zeros(0, 4, 128, dtype=BF16)}, "no keys"),
        ({"q": torch.zeros(8, 4, 200, dtype=BF16)[..., :192]}, None),  # 400-byte heads: aligned
        ({"q": torch.zeros(8, 4, 196, dtype=BF16)[..., :192]}, "head stride (196 elements)"),
        ({"k": torch.zeros(8, 4 * 192 + 4, dtype=BF16)[:, :768].view(8, 4, 192)}, "token stride"),
        ({"v": torch.zeros(8, 128, 4, dtype=BF16).transpose(1, 2)}, "last dim is not contiguous"),
        ({"k": _misaligned_base()}, "not 16-byte aligned"),
        ({"q": torch.zeros(4, 8, 192, dtype=BF16).transpose(0, 1)}, "heads do not lie within one token"),
        ({"out": torch.zeros(8, 4, 128, dtype=torch.float64)}, "output dtype"),
    ],
    ids=[
        "fp32", "mixed", "dims-96", "dv-64", "no-keys", "padded-heads", "odd-head-stride", "odd-token-stride",
        "strided-last-dim", "misaligned-base", "head-major", "fp64-out",
    ],
)  # fmt: skip
def test_route_sends_other_calls_to_triton(change: dict[str, torch.Tensor], why: str | None) -> None:
    q, k, v, out = _qkvo()
    args = {"q": q, "k": k, "v": v, "out": out, **change}
    kernel, reason = prefill_route(args["q"], args["k"], args["v"], args["out"])
    if why is None:
        assert kernel == "gluon", reason
    else:
        assert kernel == "triton"
        assert why in reason


def test_default_configs_fit_in_shared_memory() -> None:
    persistent, split = PrefillKernel.PERSISTENT, PrefillKernel.SPLIT
    assert prefill_config(192, 128, persistent) == PrefillLaunchConfig(num_stages=2, kernel=persistent)
    assert prefill_config(192, 128, split) == PrefillLaunchConfig(num_stages=2, kernel=split)
    # 128/128: 32 KiB query tile + 3 x 64 KiB
    assert prefill_config(128, 128, persistent) == PrefillLaunchConfig(num_stages=3, kernel=persistent)
    assert prefill_config(128, 128, split) == PrefillLaunchConfig(num_stages=3, kernel=split)
    for dqk in (192, 128):
        for kernel in (persistent, split):
            assert shared_bytes(dqk, 128, prefill_config(dqk, 128, kernel)) <= SHARED_MEMORY_BYTES
        # the persistent kernel: one more barrier (its query buffer's)
        one_tile = shared_bytes(dqk, 128, prefill_config(dqk, 128, split))
        assert shared_bytes(dqk, 128, prefill_config(dqk, 128, persistent)) == one_tile + 8


def test_the_default_layout_is_persistent_up_to_2048_queries_or_16_heads_or_with_appended_keys() -> None:
    # (the H200 measurements behind the bounds: docs/performance.md, "Kernel choices")
    assert PERSISTENT_MAX_SEQLEN_Q == 2048
    assert PERSISTENT_ANY_LENGTH_MAX_HEADS == 16
    for heads in (1, 16, 17, 128):
        assert default_kernel(1, context=False, num_heads=heads) is PrefillKernel.PERSISTENT
        assert default_kernel(2048, context=False, num_heads=heads) is PrefillKernel.PERSISTENT
        assert default_kernel(16, context=True, num_heads=heads) is PrefillKernel.SPLIT
        assert default_kernel(8192, context=True, num_heads=heads) is PrefillKernel.SPLIT
        # a context chunk's first pass with the new tokens' keys appended
        assert default_kernel(2048, context=True, num_heads=heads, appended=True) is PrefillKernel.PERSISTENT
        assert default_kernel(8192, context=True, num_heads=heads, appended=True) is PrefillKernel.PERSISTENT
    assert default_kernel(2049, context=False, num_heads=16) is PrefillKernel.PERSISTENT
    assert default_kernel(65536, context=False, num_heads=1) is PrefillKernel.PERSISTENT
    assert default_kernel(2049, context=False, num_heads=17) is PrefillKernel.SPLIT
    assert default_kernel(4096, context=False, num_heads=128) is PrefillKernel.SPLIT

    # 128-key tiles in three stages do not fit at 192/128; 64-key tiles do.
    assert shared_bytes(192, 128, PrefillLaunchConfig(num_stages=3)) > SHARED_MEMORY_BYTES
    assert shared_bytes(192, 128, PrefillLaunchConfig(block_n=64, num_stages=3)) <= SHARED_MEMORY_BYTES
    with pytest.raises(ValueError, match="block_n"):
        PrefillLaunchConfig(block_n=96)
    with pytest.raises(ValueError, match="num_stages"):
        PrefillLaunchConfig(num_stages=1)


def _call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> VarlenPrefillCall:
    cu_q = torch.tensor([0, 3, 3, q.shape[0]], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, k.shape[0]], dtype=torch.int32)
    return VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
        max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()), max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()),
        softmax_scale=0.2, causal=True,
    )  # fmt: skip


def test_overlap_kernel_fits_with_64_key_tiles_at_192() -> None:
    overlap = PrefillLaunchConfig(kernel=PrefillKernel.OVERLAP)
    assert shared_bytes(192, 128, overlap) > SHARED_MEMORY_BYTES
    assert shared_bytes(128, 128, overlap) <= SHARED_MEMORY_BYTES
    assert shared_bytes(192, 128, attrs.evolve(overlap, block_n=64, num_stages=3)) <= SHARED_MEMORY_BYTES
    q, k, v, out = _qkvo()
    with pytest.raises(InvalidInputError, match="shared memory"):
        launch_gluon_prefill(_call(q, k, v, out, torch.zeros(8, 4)), overlap)


def test_launcher_refuses_calls_the_route_declines() -> None:
    q, k, v, out = _qkvo(dtype=torch.float32)
    with pytest.raises(InvalidInputError, match="Triton provider"):
        launch_gluon_prefill(_call(q, k, v, out, torch.zeros(8, 4)))


def test_chunked_context_operands_route_to_the_gluon_kernel() -> None:
    """``k_pe`` of 64 rope lanes (here a strided slice of latent rows) and a prior state (the
    chunked-context forms) run on the Gluon kernel's split layout."""
    q, k, v, out = _qkvo()
    lse = torch.zeros(8, 4)
    plain = _call(q, k, v, out, lse)
    latent = torch.zeros(8, 576, dtype=BF16)
    k_nope = torch.zeros(8, 4, 128, dtype=BF16)
    for call in (
        attrs.evolve(plain, k=k_nope, k_pe=latent[:, 512:]),
        attrs.evolve(plain, prior_out=out, prior_lse=lse),
        attrs.evolve(plain, k=k_nope, k_pe=latent[:, 512:], prior_out=out, prior_lse=lse),
    ):
        kernel, why = prefill_call_route(call)
        assert kernel == "gluon", why


def _assert_routes_to_triton(call: VarlenPrefillCall, why: str) -> None:
    kernel, reason = prefill_call_route(call)
    assert kernel == "triton"
    assert why in reason


@pytest.mark.parametrize(
    ("k_pe", "why"),
    [
        (torch.zeros(8, 32, dtype=BF16), "[Tk, 64]"),
        (torch.zeros(8, 64, dtype=torch.float16), "k_pe dtype"),
        (torch.zeros(8, 72, dtype=BF16)[:, 4:68], "k_pe's base address"),
        (torch.zeros(8, 68, dtype=BF16)[:, :64], "k_pe's token stride"),
    ],
    ids=["rope-32", "fp16", "unaligned-base", "unaligned-stride"],
)
def test_k_pe_the_gluon_kernel_cannot_read_routes_to_triton(k_pe: torch.Tensor, why: str) -> None:
    """Other rope widths, another dtype than q's, and layouts TMA cannot read go to the Triton
    kernel, with the reason."""
    q, k, v, out = _qkvo()
    k_nope = torch.zeros(8, 4, 192 - k_pe.shape[1], dtype=BF16)
    _assert_routes_to_triton(attrs.evolve(_call(q, k, v, out, torch.zeros(8, 4)), k=k_nope, k_pe=k_pe), why)


@pytest.mark.parametrize(
    "kernel", sorted(set(PrefillKernel) - CONTEXT_KERNELS, key=lambda k: k.value), ids=lambda k: k.name
)
def test_launcher_runs_the_chunked_context_form_on_the_split_layouts_only(kernel: PrefillKernel) -> None:
    """A layout other than the split and persistent ones refuses the chunked-context operands,
    naming the config."""
    q, k, v, out = _qkvo()
    lse = torch.zeros(8, 4)
    call = attrs.evolve(_call(q, k, v, out, lse), prior_out=out, prior_lse=lse)
    with pytest.raises(InvalidInputError, match="split layouts") as info:
        launch_gluon_prefill(call, PrefillLaunchConfig(kernel=kernel))
    assert info.value.argument == "config"


@pytest.mark.interpret  # (CPU tensors: Triton runs them in its interpreter only)
def test_provider_runs_declined_calls_on_the_triton_kernel() -> None:
    """fp32 48/32 is not a Gluon prefill case: the gluon provider runs the Triton varlen kernel
    (here in the interpreter) and matches the reference."""
    gen = torch.Generator().manual_seed(5)
    heads = 2
    q = torch.randn(9, heads, 48, generator=gen)
    k = torch.randn(11, heads, 48, generator=gen)
    v = torch.randn(11, heads, 32, generator=gen)
    out = torch.full((9, heads, 32), math.nan)
    lse = torch.full((9, heads), math.nan)
    GluonProvider(prefill="gluon").varlen_attention(_call(q, k, v, out, lse))
    ref_out, ref_lse = torch.empty(9, heads, 32), torch.empty(9, heads)
    TorchProvider().varlen_attention(_call(q, k, v, ref_out, ref_lse))
    assert_matches_reference(out, lse, ref_out, ref_lse, context="gluon prefill -> triton fallback")


def _appended(keys: torch.Tensor, values: torch.Tensor) -> AppendedKeys:
    """The rows of ``keys``/``values`` as three requests' appended keys (:func:`_call`'s batch)."""
    cu = torch.tensor([0, 2, 2, keys.shape[0]], dtype=torch.int32)
    return AppendedKeys(k=keys, v=values, cu_seqlens_k=cu, max_seqlen_k=max(2, keys.shape[0] - 2))


def test_appended_keys_route_to_the_gluon_kernel() -> None:
    """A context chunk's call with the new tokens' keys appended (whole 192-lane keys, v)
    runs on the Gluon kernel, with ``k_pe`` and without."""
    q, k, v, out = _qkvo()
    latent = torch.zeros(8, 576, dtype=BF16)
    chunk = attrs.evolve(_call(q, k, v, out, torch.zeros(8, 4)), k=torch.zeros(8, 4, 128, dtype=BF16))
    for call in (attrs.evolve(chunk, k_pe=latent[:, 512:]), attrs.evolve(chunk, k=k)):
        kernel, why = prefill_call_route(attrs.evolve(call, appended=_appended(k, v)))
        assert kernel == "gluon", why
        assert "appended" in why


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"k": torch.zeros(8, 4, 192, dtype=torch.float16)}, "appended keys of torch.float16"),
        (
            {"k": torch.zeros(0, 4, 192, dtype=BF16), "v": torch.zeros(0, 4, 128, dtype=BF16)},
            "no appended keys",
        ),
        ({"k": torch.zeros(8, 4, 200, dtype=BF16)[..., 4:196]}, "appended.k's base address"),
        (
            {"v": torch.zeros(8, 4, 128, dtype=BF16).transpose(0, 1).contiguous().transpose(0, 1)},
            "appended.v's heads",
        ),
    ],
    ids=["fp16", "empty", "unaligned-base", "head-major-v"],
)
def test_appended_keys_the_gluon_kernel_cannot_read_route_to_triton(
    change: dict[str, torch.Tensor], why: str
) -> None:
    q, k, v, out = _qkvo()
    appended = attrs.evolve(_appended(k, v), **change)
    _assert_routes_to_triton(attrs.evolve(_call(q, k, v, out, torch.zeros(8, 4)), appended=appended), why)


@pytest.mark.parametrize(
    "kernel", sorted(set(PrefillKernel) - APPENDED_KERNELS, key=lambda k: k.value), ids=lambda k: k.name
)
def test_launcher_runs_appended_keys_on_the_split_layouts_only(kernel: PrefillKernel) -> None:
    q, k, v, out = _qkvo()
    call = attrs.evolve(_call(q, k, v, out, torch.zeros(8, 4)), appended=_appended(k, v))
    with pytest.raises(InvalidInputError, match="layout") as info:
        launch_gluon_prefill(call, PrefillLaunchConfig(kernel=kernel))
    assert info.value.argument == "config"


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"k": torch.zeros(8, 4, 128, dtype=BF16)}, "appended.k"),
        ({"v": torch.zeros(8, 4, 64, dtype=BF16)}, "out"),
        ({"v": torch.zeros(7, 4, 128, dtype=BF16)}, "appended.v"),
        ({"cu_seqlens_k": torch.tensor([0, 8], dtype=torch.int32)}, "appended.cu_seqlens_k"),
        ({"cu_seqlens_k": torch.tensor([0, 2, 2, 8])}, "appended.cu_seqlens_k"),
    ],
    ids=["k-without-rope", "v-dim", "v-rows", "cu-entries", "cu-int64"],
)
def test_bad_appended_keys_are_refused_naming_them(change: dict[str, torch.Tensor], argument: str) -> None:
    """The launcher checks the appended keys before launching anything; the error names the
    appended argument (a ``v`` of another width than the call's shows as ``out``'s shape)."""
    q, k, v, out = _qkvo()
    call = attrs.evolve(
        _call(q, k, v, out, torch.zeros(8, 4)), appended=attrs.evolve(_appended(k, v), **change)
    )
    with pytest.raises(InvalidInputError) as info:
        launch_gluon_prefill(call)
    assert info.value.argument == argument
