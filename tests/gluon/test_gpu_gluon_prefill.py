"""The Gluon varlen prefill on an H100/H200 against the float64 torch reference.

Drives :func:`~mla.providers.gluon.prefill_launch.launch_gluon_prefill` directly (every launch
variant: the three warp splits of ``PrefillKernel``, 128- and 64-key tiles, 192/128 and
128/128, bf16 and fp16, causal and not, LSE on and off) and the gluon provider's
``varlen_attention`` (the route, the contract's NaN rules, head-dim slices of one buffer, the
chunked-context form: ``k_pe``, a prior state merged in place and appended keys, CUDA graph
capture). Batches
hold empty and one-token requests, requests with more queries than keys, and lengths that are
not tile multiples. Outputs are NaN-poisoned before each run. Run:
``pytest -m gpu tests/gluon/test_gpu_gluon_prefill.py`` (skipped without a Hopper GPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from varlen_batches import VARLEN_BATCHES

from mla.providers import get_provider
from mla.providers.calls import AppendedKeys, VarlenPrefillCall
from mla.providers.gluon import GluonProvider
from mla.providers.gluon.prefill_launch import (
    PrefillKernel,
    PrefillLaunchConfig,
    launch_gluon_prefill,
    prefill_call_route,
    prefill_route,
)
from mla.tools.reference import merge_reference, reference_prefill

pytestmark = pytest.mark.gpu

BATCHES = VARLEN_BATCHES
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    support = get_provider("gluon").availability()
    if not support:
        pytest.skip(f"the gluon provider is unavailable here: {support}")


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _call(
    batch: str, heads: int, dqk: int, dv: int, dtype: torch.dtype, causal: bool, seed: int
) -> VarlenPrefillCall:
    lengths_q, lengths_k = BATCHES[batch]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens, keys = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tokens, heads, dqk, device="cuda", generator=gen).to(dtype)
    k = torch.randn(keys, heads, dqk, device="cuda", generator=gen).to(dtype)
    v = torch.randn(keys, heads, dv, device="cuda", generator=gen).to(dtype)
    return VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=_indptr(lengths_q), cu_seqlens_k=_indptr(lengths_k),
        out=torch.full((tokens, heads, dv), math.nan, dtype=dtype, device="cuda"),
        lse=torch.full((tokens, heads), math.nan, device="cuda"),
        max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=dqk**-0.5, causal=causal,
    )  # fmt: skip


def _check(call: VarlenPrefillCall, *, lse_written: bool = True, tol: float | None = None) -> None:
    ref_out, ref_lse = reference_prefill(
        call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
        softmax_scale=call.softmax_scale, causal=call.causal,
    )  # fmt: skip
    out64, lse64 = call.out.cpu().double(), call.lse.cpu().double()
    assert not torch.isnan(out64).any(), "unwritten (or NaN) output rows"
    err = float((out64 - ref_out).norm() / ref_out.norm().clamp_min(1e-30))
    assert err < (tol or TOL[call.q.dtype]), f"relative output error {err:.3g}"
    finite = torch.isfinite(ref_lse)
    assert bool((out64[~finite] == 0).all()), "rows without keys must be 0"
    if not lse_written:
        assert bool(torch.isnan(lse64).all()), "the LSE was written without being asked for"
        return
    assert not torch.isnan(lse64).any(), "unwritten lse rows"
    assert torch.equal(torch.isfinite(lse64), finite), "rows without keys must have lse = -inf"
    assert bool((lse64[~finite] == -math.inf).all())
    if bool(finite.any()):
        assert float((lse64[finite] - ref_lse[finite]).abs().max()) < 2e-3


MAIN_CONFIGS = {
    "producer": PrefillLaunchConfig(),
    "split": PrefillLaunchConfig(kernel=PrefillKernel.SPLIT),
    "overlap": PrefillLaunchConfig(block_n=64, num_stages=3, kernel=PrefillKernel.OVERLAP),
    "persistent": PrefillLaunchConfig(kernel=PrefillKernel.PERSISTENT),
}


@pytest.mark.parametrize("config", sorted(MAIN_CONFIGS))
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(batch: str, causal: bool, heads: int, config: str) -> None:
    if heads == 128 and batch == "long":
        pytest.skip("the float64 reference is slow at this size; 128 heads run the other batches")
    call = _call(batch, heads, 192, 128, torch.bfloat16, causal, seed=heads + len(batch))
    assert prefill_route(call.q, call.k, call.v, call.out)[0] == "gluon"
    launch_gluon_prefill(call, MAIN_CONFIGS[config])
    _check(call)


PLAIN, SPLIT, OVERLAP = PrefillKernel.PLAIN, PrefillKernel.SPLIT, PrefillKernel.OVERLAP
VARIANTS = {
    "plain": (192, torch.bfloat16, PrefillLaunchConfig(kernel=PLAIN)),
    "n64": (192, torch.bfloat16, PrefillLaunchConfig(block_n=64, num_stages=3)),
    "split-n64": (192, torch.bfloat16, PrefillLaunchConfig(block_n=64, num_stages=3, kernel=SPLIT)),
    "fp16": (192, torch.float16, None),
    "split-fp16": (192, torch.float16, PrefillLaunchConfig(kernel=SPLIT)),
    "d128": (128, torch.bfloat16, None),
    "d128-fp16-plain": (128, torch.float16, PrefillLaunchConfig(kernel=PLAIN)),
    "d128-split": (128, torch.bfloat16, PrefillLaunchConfig(kernel=SPLIT, num_stages=3)),
    "overlap-fp16": (192, torch.float16, PrefillLaunchConfig(block_n=64, num_stages=3, kernel=OVERLAP)),
    "d128-overlap": (128, torch.bfloat16, PrefillLaunchConfig(kernel=OVERLAP)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("batch", ["mixed", "long"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_launch_variant_matches_reference(variant: str, batch: str, causal: bool) -> None:
    dqk, dtype, config = VARIANTS[variant]
    call = _call(batch, 3, dqk, 128, dtype, causal, seed=11)
    launch_gluon_prefill(call, config)
    _check(call)


KERNELS = pytest.mark.parametrize("kernel", list(PrefillKernel), ids=lambda k: k.name)


def _fitting(kernel: PrefillKernel) -> PrefillLaunchConfig:
    """A 192/128 launch of ``kernel`` that fits in shared memory (64-key tiles for the overlap
    kernel)."""
    if kernel is PrefillKernel.OVERLAP:
        return PrefillLaunchConfig(block_n=64, num_stages=3, kernel=kernel)
    return PrefillLaunchConfig(kernel=kernel)


@pytest.mark.parametrize("causal", [True, False])
@KERNELS
def test_lse_is_written_only_when_asked(causal: bool, kernel: PrefillKernel) -> None:
    call = _call("mixed", 4, 192, 128, torch.bfloat16, causal, seed=2)
    launch_gluon_prefill(call, _fitting(kernel), write_lse=False)
    _check(call, lse_written=False)


def test_provider_runs_head_dim_slices_of_one_buffer() -> None:
    """k and v as slices of an up-projected ``[Tk, H, 192 + 128]`` buffer (strided heads)."""
    call = _call("mixed", 16, 192, 128, torch.bfloat16, True, seed=4)
    kv = torch.cat([call.k, call.v], dim=-1)
    k, v = kv[..., :192], kv[..., 192:]
    assert prefill_route(call.q, k, v, call.out)[0] == "gluon"
    sliced = VarlenPrefillCall(
        q=call.q, k=k, v=v, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, out=call.out,
        lse=call.lse, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
        softmax_scale=call.softmax_scale, causal=True,
    )  # fmt: skip
    GluonProvider(prefill="gluon").varlen_attention(sliced)
    _check(sliced)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", [None, *PrefillKernel], ids=lambda k: "provider" if k is None else k.name)
def test_nan_key_stays_in_the_rows_that_see_it(causal: bool, kernel: PrefillKernel | None) -> None:
    """A NaN key (k and v) of request 1 shows in the rows that see it and never in requests 0
    and 2 (whose tiles run into request 1's rows). Request 1's earlier rows (causal: the key's
    tile is a diagonal tile of theirs) stay finite on the layouts whose consumers clean every
    masked tile; the split and persistent layouts clean only tiles reaching past the request's
    keys, so there a later key of the row's own request may reach it as ``0·NaN``."""
    lengths = [33, 140, 7]
    gen = torch.Generator(device="cuda").manual_seed(9)
    tokens, heads = sum(lengths), 4
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).bfloat16()
    k = torch.randn(tokens, heads, 192, device="cuda", generator=gen).bfloat16()
    v = torch.randn(tokens, heads, 128, device="cuda", generator=gen).bfloat16()
    bad = 33 + 70  # request 1's key 70
    k[bad], v[bad] = math.nan, math.nan
    cu = _indptr(lengths)
    out = torch.full((tokens, heads, 128), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), math.nan, device="cuda")
    call = VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out, lse=lse, max_seqlen_q=140,
        max_seqlen_k=140, softmax_scale=192**-0.5, causal=causal,
    )  # fmt: skip
    if kernel is None:
        GluonProvider(prefill="gluon").varlen_attention(call)
    else:
        launch_gluon_prefill(call, _fitting(kernel))
    sees = torch.zeros(tokens, dtype=torch.bool)
    sees[(bad if causal else 33) : 33 + 140] = True
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[bad], clean_v[bad] = 0, 0
    ref_out, _ref_lse = reference_prefill(q, clean_k, clean_v, cu, cu, softmax_scale=192**-0.5, causal=causal)
    keep = ~sees
    if kernel in (None, PrefillKernel.SPLIT, PrefillKernel.PERSISTENT):
        keep[33 : 33 + 140] = False  # (request 1's own rows: see the docstring)
    out_c = out.cpu()
    assert torch.isfinite(out_c[keep].float()).all()
    assert torch.isfinite(lse.cpu()[keep]).all()
    err = float((out_c[keep].double() - ref_out[keep]).norm() / ref_out[keep].norm())
    assert err < 1e-2
    assert torch.isnan(out_c[sees].float()).any(dim=-1).all(), "a NaN a row does see must show"


def test_prefill_captures_in_a_cuda_graph() -> None:
    """No host sync inside the launch: it records into a CUDA graph and replays correctly."""
    call = _call("mixed", 8, 192, 128, torch.bfloat16, True, seed=6)
    provider = GluonProvider(prefill="gluon")
    provider.varlen_attention(call)  # compile outside the capture
    call.out.fill_(math.nan)
    call.lse.fill_(math.nan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        provider.varlen_attention(call)
    graph.replay()
    torch.cuda.synchronize()
    _check(call)


@pytest.mark.parametrize("layout", ["provider", "split", "persistent"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("prior", ["prior-state", "no-prior"])
@pytest.mark.parametrize("batch", ["mixed", "sk-lt-sq"])
def test_chunked_context_form_matches_reference(batch: str, prior: str, causal: bool, layout: str) -> None:
    """A context chunk's pass on the Gluon kernel (the provider's default launch, or the split or
    persistent layout): ``k`` and ``v`` as head-dim slices
    of one up-projection buffer, the rope lanes every head shares as ``k_pe`` (a slice of the
    latent rows), merged in place into a prior state whose rows include ``lse = -inf`` ones
    holding NaN (they must weigh nothing), against the float64 reference over the whole keys
    merged by the LSE rule."""
    lengths_q, lengths_k = BATCHES[batch]
    gen = torch.Generator(device="cuda").manual_seed(31)
    heads, tokens, keys = 16, sum(lengths_q), sum(lengths_k)
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).bfloat16()
    up = torch.randn(keys, heads, 128 + 128, device="cuda", generator=gen).bfloat16()
    latent = torch.randn(keys, 512 + 64, device="cuda", generator=gen).bfloat16()
    k_nope, v, k_pe = up[..., :128], up[..., 128:], latent[:, 512:]
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    if prior == "prior-state":
        out = torch.randn(tokens, heads, 128, device="cuda", generator=gen).bfloat16()
        lse = torch.randn(tokens, heads, device="cuda", generator=gen) * 3
        empty = torch.rand(tokens, heads, device="cuda", generator=gen) < 0.2
        lse[empty] = -math.inf
        out[empty] = math.nan
        prior_out, prior_lse = out.cpu().double(), lse.cpu().double()
    else:
        out = torch.full((tokens, heads, 128), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), math.nan, device="cuda")
    call = VarlenPrefillCall(
        q=q, k=k_nope, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
        max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=192**-0.5, causal=causal,
        k_pe=k_pe, prior_out=out if prior == "prior-state" else None,
        prior_lse=lse if prior == "prior-state" else None,
    )  # fmt: skip
    assert prefill_call_route(call)[0] == "gluon"
    if layout == "provider":
        GluonProvider().varlen_attention(call)
    else:
        launch_gluon_prefill(call, PrefillLaunchConfig(kernel=PrefillKernel[layout.upper()]))
    whole = torch.cat([k_nope, k_pe[:, None, :].expand(keys, heads, 64)], dim=-1)
    ref_out, ref_lse = reference_prefill(q, whole, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=causal)
    if prior == "prior-state":
        merged_lse = torch.logaddexp(ref_lse, prior_lse)
        top = torch.where(merged_lse == -math.inf, 0.0, merged_lse)
        w, w_p = torch.exp(ref_lse - top), torch.exp(prior_lse - top)
        o_p = torch.where((w_p == 0)[..., None], 0.0, prior_out)
        ref_out = (w[..., None] * ref_out + w_p[..., None] * o_p) / (w + w_p).clamp_min(1e-300)[..., None]
        ref_lse = merged_lse
    out64, lse64 = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out64).any(), "NaN rows (an lse = -inf prior row must weigh nothing)"
    err = float((out64 - ref_out).norm() / ref_out.norm())
    assert err < TOL[torch.bfloat16], f"relative output error {err:.3g}"
    assert torch.equal(torch.isfinite(lse64), torch.isfinite(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert float((lse64[finite] - ref_lse[finite]).abs().max()) < 2e-3


APPENDED = {"mixed": [100, 1, 257, 0, 64, 2, 1], "sk-lt-sq": [130, 0, 17]}
"""Appended key counts per request of a batch: the new tokens' own (as many as queries), none,
or fewer than queries (causal: the first rows see only the chunk's keys; request 5 of "mixed"
has no chunk keys, so its first three rows see no key at all)."""


@pytest.mark.parametrize("layout", ["provider", "split", "persistent"])
@pytest.mark.parametrize("keys", ["k_pe", "whole"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch", sorted(APPENDED))
def test_appended_keys_match_reference(batch: str, causal: bool, keys: str, layout: str) -> None:
    """A context chunk's pass with the new tokens' keys appended (one launch of the split or the
    persistent layout): every row sees all of its request's chunk keys and the appended ones by the causal
    rule over them alone; against the float64 reference of the two passes merged by LSE. The
    buffers run on into NaN rows past the last request's keys, which must reach no row."""
    lengths_q, lengths_k = BATCHES[batch]
    lengths_a = APPENDED[batch]
    gen = torch.Generator(device="cuda").manual_seed(37)
    heads, tokens, n_ctx, n_new, pad = 16, sum(lengths_q), sum(lengths_k), sum(lengths_a), 130
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).bfloat16()
    up = torch.randn(n_ctx + pad, heads, 128 + 128, device="cuda", generator=gen).bfloat16()
    latent = torch.randn(n_ctx + pad, 512 + 64, device="cuda", generator=gen).bfloat16()
    new_kv = torch.randn(n_new + pad, heads, 192 + 128, device="cuda", generator=gen).bfloat16()
    up[n_ctx:], latent[n_ctx:], new_kv[n_new:] = math.nan, math.nan, math.nan
    k_pe = latent[:n_ctx, 512:]
    whole = torch.cat([up[:n_ctx, :, :128], k_pe[:, None, :].expand(n_ctx, heads, 64)], dim=-1)
    k, v = (up[:n_ctx, :, :128], up[:n_ctx, :, 128:]) if keys == "k_pe" else (whole, up[:n_ctx, :, 128:])
    cu_q, cu_k, cu_a = _indptr(lengths_q), _indptr(lengths_k), _indptr(lengths_a)
    appended = AppendedKeys(
        k=new_kv[:n_new, :, :192], v=new_kv[:n_new, :, 192:], cu_seqlens_k=cu_a, max_seqlen_k=max(lengths_a)
    )
    out = torch.full((tokens, heads, 128), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((tokens, heads), math.nan, device="cuda")
    call = VarlenPrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
        max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=192**-0.5, causal=causal,
        k_pe=k_pe if keys == "k_pe" else None, appended=appended,
    )  # fmt: skip
    assert prefill_call_route(call)[0] == "gluon"
    if layout == "provider":
        GluonProvider().varlen_attention(call)
    else:
        launch_gluon_prefill(call, PrefillLaunchConfig(kernel=PrefillKernel[layout.upper()]))
    own = reference_prefill(q, whole, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=False)
    new = reference_prefill(q, appended.k, appended.v, cu_q, cu_a, softmax_scale=192**-0.5, causal=causal)
    ref_out, ref_lse = merge_reference(*own, *new)
    out64, lse64 = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out64).any(), "unwritten or NaN rows (the NaN rows past the keys reached a row)"
    err = float((out64 - ref_out).norm() / ref_out.norm())
    assert err < TOL[torch.bfloat16], f"relative output error {err:.3g}"
    assert torch.equal(torch.isfinite(lse64), torch.isfinite(ref_lse))
    assert bool((out64[~torch.isfinite(ref_lse)] == 0).all()), "rows without keys must be 0"
    finite = torch.isfinite(ref_lse)
    assert float((lse64[finite] - ref_lse[finite]).abs().max()) < 2e-3
