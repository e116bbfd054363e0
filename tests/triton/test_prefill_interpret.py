"""The Triton prefill kernels in the CPU interpreter (``TRITON_INTERPRET=1``, set by conftest).

Tiny shapes, fp16/fp32 inputs (the interpreter computes bf16 dots wrongly), compared with
:func:`mla.tools.reference.reference_prefill` in float64. The fp8 kernel runs here too: the
interpreter's ``tl.dot`` on fp8 operands is exact (checked for e4m3fn and e5m2), so the fp8
tests compare with the reference on the dequantized inputs. Outputs start as NaN.
"""

from __future__ import annotations

import os
import random

import attrs
import pytest
import torch

from mla import PREFILL_STRATEGIES, Fp8PersistentPrefill, PrefillStrategy
from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.quant import quantize_per_tensor
from mla.tools.reference import causal_visible, merge_reference, reference_prefill

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1) or a GPU", allow_module_level=True)
pytest.importorskip("triton")

from mla.providers.calls import AppendedKeys, Fp8PrefillCall, VarlenPrefillCall
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton.fp8_prefill import (
    KV_SPLIT_ALIGN,
    build_fp8_prefill_plan,
    choose_kv_split,
    fp8_prefill_fwd,
    plan_fp8_prefill,
)
from mla.providers.triton.prefill import HeadDimBlocks, varlen_attention_fwd
from mla.testing import PrefillCase, check_prefill_strategy, prefill_support

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (q lengths, k lengths): Sk > Sq, Sk < Sq (rows with no key), empty requests, odd lengths
LENGTHS = ([37, 1, 70, 0, 9], [37, 50, 100, 6, 0])
SHORT_KEYS = ([40, 33], [12, 33])


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _check(out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], tol: float) -> None:
    ref_out, ref_lse = ref
    out64, lse64 = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out64).any(), "unwritten output rows"
    assert not torch.isnan(lse64).any(), "unwritten lse rows"
    err = float((out64 - ref_out).norm() / ref_out.norm())
    assert err < tol, f"relative output error {err:.3g} >= {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse64), finite), "rows without keys must have lse = -inf"
    assert bool((lse64[~finite] == float("-inf")).all())
    assert bool((out64[~finite] == 0).all()), "rows without keys must be 0"
    assert float((lse64[finite] - ref_lse[finite]).abs().max()) < 1e-4


@pytest.mark.parametrize(
    ("dtype", "qk_dim", "v_dim", "causal", "lengths"),
    [
        (torch.float16, 192, 128, True, LENGTHS),
        (torch.float32, 192, 128, False, LENGTHS),
        (torch.float16, 192, 128, True, SHORT_KEYS),
        (torch.float32, 40, 24, True, SHORT_KEYS),  # masked head-dim columns in every block
        (torch.float16, 64, 32, False, SHORT_KEYS),  # power-of-two q/k dim: one dot chunk
    ],
    ids=["fp16-192-causal", "fp32-192-full", "fp16-sk-lt-sq", "fp32-40-24", "fp16-64-32"],
)
def test_varlen_matches_reference(
    dtype: torch.dtype, qk_dim: int, v_dim: int, causal: bool, lengths: tuple[list[int], list[int]]
) -> None:
    lengths_q, lengths_k = lengths
    gen = torch.Generator().manual_seed(qk_dim + v_dim)
    heads, scale = 2, qk_dim**-0.5
    q = _random((sum(lengths_q), heads, qk_dim), gen).to(dtype)
    k = _random((sum(lengths_k), heads, qk_dim), gen).to(dtype)
    v = _random((sum(lengths_k), heads, v_dim), gen).to(dtype)
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    out = torch.full((q.shape[0], heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((q.shape[0], heads), float("nan"), device=DEVICE)
    varlen_attention_fwd(
        VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
            max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=scale, causal=causal,
        )
    )  # fmt: skip
    ref = reference_prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal)
    _check(out, lse, ref, 2e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_split_keys_merge_into_prior_state(dtype: torch.dtype, causal: bool) -> None:
    """The chunked-context form: keys as a strided ``k_nope`` view of one up-projection output
    plus the latent's rope lanes (``k_pe``, shared by every head), ``v`` a strided view of the
    same output, the result merged in place into a prior state whose rows without a state
    (``lse = -inf``) hold NaN: equals the reference over the assembled keys, merged by LSE."""
    lengths_q, lengths_k = LENGTHS
    gen = torch.Generator().manual_seed(5)
    heads, nope, rope, v_dim, rank = 2, 24, 8, 16, 40
    scale = (nope + rope) ** -0.5
    tokens, keys = sum(lengths_q), sum(lengths_k)
    q = _random((tokens, heads, nope + rope), gen).to(dtype)
    kv = _random((keys, heads, nope + v_dim), gen).to(dtype)  # one matmul's [n, H, nope + v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    latent = _random((keys, rank + rope), gen).to(dtype)
    k_pe = latent[:, rank:]
    prior_out = _random((tokens, heads, v_dim), gen).to(dtype)
    prior_lse = _random((tokens, heads), gen)
    prior_lse[::3, 0] = float("-inf")
    clean_prior = prior_out.clone()
    clean_prior[::3, 0] = 0.0
    prior_out[::3, 0] = float("nan")  # a row without a state contributes nothing
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    whole = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
    part = reference_prefill(q, whole, v, cu_q, cu_k, softmax_scale=scale, causal=causal)
    ref = merge_reference(clean_prior.cpu(), prior_lse.cpu(), *part)
    out, lse = prior_out, prior_lse  # merged in place
    varlen_attention_fwd(
        VarlenPrefillCall(
            q=q, k=k_nope, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
            max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=scale, causal=causal,
            k_pe=k_pe, prior_out=out, prior_lse=lse,
        )
    )  # fmt: skip
    _check(out, lse, ref, 2e-3 if dtype == torch.float16 else 1e-5)


APPENDED = [36, 0, 70, 0, 3]
"""Appended key counts for :data:`LENGTHS`' requests: as many as queries, none, fewer."""


@pytest.mark.parametrize("provider", ["triton", "torch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_appended_keys_are_a_context_pass_and_a_pass_over_them(provider: str, causal: bool) -> None:
    """A call with appended keys (the new tokens' own keys after a context chunk's): every row
    sees all of its request's chunk keys (``k_nope`` plus ``k_pe``), and the appended keys by
    the call's ``causal`` rule over them alone; equals the two references merged by LSE, on the
    Triton kernel (its two passes) and on the torch provider."""
    lengths_q, lengths_k = LENGTHS
    gen = torch.Generator().manual_seed(8)
    heads, nope, rope, v_dim, rank = 2, 24, 8, 16, 40
    scale = (nope + rope) ** -0.5
    tokens, keys, added = sum(lengths_q), sum(lengths_k), sum(APPENDED)
    q = _random((tokens, heads, nope + rope), gen).half()
    kv = _random((keys, heads, nope + v_dim), gen).half()
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_pe = _random((keys, rank + rope), gen).half()[:, rank:]
    k_new = _random((added, heads, nope + rope), gen).half()
    v_new = _random((added, heads, v_dim), gen).half()
    cu_q, cu_k, cu_a = _indptr(lengths_q), _indptr(lengths_k), _indptr(APPENDED)
    whole = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
    own = reference_prefill(q, whole, v, cu_q, cu_k, softmax_scale=scale, causal=False)
    new = reference_prefill(q, k_new, v_new, cu_q, cu_a, softmax_scale=scale, causal=causal)
    out = torch.full((tokens, heads, v_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    lse = torch.full((tokens, heads), float("nan"), device=DEVICE)
    call = VarlenPrefillCall(
        q=q, k=k_nope, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
        max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=scale, causal=causal,
        k_pe=k_pe, appended=AppendedKeys(k=k_new, v=v_new, cu_seqlens_k=cu_a, max_seqlen_k=max(APPENDED)),
    )  # fmt: skip
    if provider == "triton":
        varlen_attention_fwd(call)
    else:
        TorchProvider().varlen_attention(call)
    _check(out, lse, merge_reference(*own, *new), 2e-3)


def test_split_keys_use_the_plain_blocks_at_128_plus_64() -> None:
    """128 nope lanes + 64 shared rope lanes run as the two dot chunks 192 runs as (no padding)."""
    assert HeadDimBlocks.for_split_keys(128, 64, 128) == HeadDimBlocks.for_dims(192, 128)


@pytest.mark.parametrize(
    ("cu_q", "cu_k"),
    [([0, 30, 24], [0, 10, 20]), ([0, -5, 24], [0, 50, 20]), ([0, 20, 10], [0, 25, -3])],
    ids=["past-the-rows", "negative-and-past-the-keys", "decreasing"],
)
def test_a_bad_indptr_touches_no_row_outside_the_tensors(cu_q: list[int], cu_k: list[int]) -> None:
    """Each request's rows are clamped into q's and k's rows (``mla.mla_prefill`` launches
    before it has checked the values on such providers): with NaN rows just outside q, k and v
    and sentinel rows just outside out and lse, no written row is NaN and no sentinel moves."""
    rows_q, rows_k, heads, pad, qk_dim, v_dim = 24, 20, 2, 8, 32, 16
    gen = torch.Generator().manual_seed(3)

    def inside(rows: int, width: int, fill: float, values: bool) -> tuple[torch.Tensor, torch.Tensor]:
        whole = torch.full((rows + 2 * pad, heads, width), fill, device=DEVICE)
        if values:
            whole[pad : pad + rows] = _random((rows, heads, width), gen)
        return whole, whole[pad : pad + rows]

    _, q = inside(rows_q, qk_dim, float("nan"), values=True)
    _, k = inside(rows_k, qk_dim, float("nan"), values=True)
    _, v = inside(rows_k, v_dim, float("nan"), values=True)
    out_whole, out = inside(rows_q, v_dim, 7.0, values=False)
    out.zero_()
    lse_whole = torch.full((rows_q + 2 * pad, heads), 7.0, device=DEVICE)
    lse = lse_whole[pad : pad + rows_q]
    lse.zero_()
    indptr = {
        name: torch.tensor(values, dtype=torch.int32, device=DEVICE)
        for name, values in (("q", cu_q), ("k", cu_k))
    }
    varlen_attention_fwd(
        VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=indptr["q"], cu_seqlens_k=indptr["k"], out=out, lse=lse,
            max_seqlen_q=48, max_seqlen_k=48, softmax_scale=qk_dim**-0.5, causal=True,
        )
    )  # fmt: skip
    for whole in (out_whole, lse_whole):
        assert bool((whole[:pad] == 7.0).all()), "a row before the output was written"
        assert bool((whole[pad + rows_q :] == 7.0).all()), "a row past the output was written"
    assert not bool(out.isnan().any()), "a row outside q, k or v was read"


def test_head_dim_blocks_cover_192_128_without_padding() -> None:
    assert HeadDimBlocks.for_dims(192, 128) == HeadDimBlocks(128, 64, 128)
    assert HeadDimBlocks.for_dims(128, 128) == HeadDimBlocks(128, 0, 128)
    assert HeadDimBlocks.for_dims(40, 24) == HeadDimBlocks(32, 16, 32)


@pytest.mark.parametrize(
    ("fp8", "causal", "kv_split", "num_programs"),
    [
        (torch.float8_e4m3fn, True, None, None),  # the planner's own choice
        (torch.float8_e4m3fn, True, 16, 3),  # splits + reduce, persistent round-robin
        (torch.float8_e5m2, False, 32, 2),
    ],
    ids=["e4m3-causal-planned", "e4m3-causal-split16", "e5m2-full-split32"],
)
def test_fp8_prefill_matches_reference(
    fp8: torch.dtype, causal: bool, kv_split: int | None, num_programs: int | None
) -> None:
    lengths_q, lengths_k = LENGTHS
    gen = torch.Generator().manual_seed(5)
    heads, qk_dim, v_dim = 2, 192, 128
    scale = qk_dim**-0.5
    raw = [
        _random((sum(lengths_q), heads, qk_dim), gen),
        _random((sum(lengths_k), heads, qk_dim), gen),
        _random((sum(lengths_k), heads, v_dim), gen),
    ]
    (q8, qs), (k8, ks), (v8, vs) = (quantize_per_tensor(x, fp8) for x in raw)
    cu_q, cu_k = _indptr(lengths_q), _indptr(lengths_k)
    if kv_split is None:
        plan = plan_fp8_prefill(cu_q.cpu(), cu_k.cpu(), num_heads=heads, causal=causal, device=DEVICE)
    else:
        assert num_programs is not None
        plan = build_fp8_prefill_plan(
            cu_q.cpu(), cu_k.cpu(), num_heads=heads, causal=causal, device=DEVICE, tile_q=32,
            kv_split=kv_split, num_programs=num_programs,
        )  # fmt: skip
        assert plan.num_groups > 0, "the forced split must exercise the partial + reduce path"
    out = torch.full((q8.shape[0], heads, v_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    lse = torch.full((q8.shape[0], heads), float("nan"), device=DEVICE)
    fp8_prefill_fwd(
        Fp8PrefillCall(
            q=q8, k=k8, v=v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse, schedule=plan,
            softmax_scale=scale, q_scale=qs, k_scale=ks, v_scale=vs, causal=causal,
        )
    )  # fmt: skip
    deq = [x.double() * s.double() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    _check(out, lse, reference_prefill(*deq, cu_q, cu_k, softmax_scale=scale, causal=causal), 2e-3)


def _covered_pairs(plan_units: torch.Tensor) -> list[tuple[int, int, int]]:
    pairs = []
    for q_begin, q_rows, k_begin, num_keys, shift, _slot, head, _ in plan_units.tolist():
        for r in range(q_rows):
            pairs.extend((q_begin + r, k_begin + n, head) for n in range(num_keys) if n <= r + shift)
    return pairs


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_plan_covers_every_visible_pair_once(causal: bool) -> None:
    rng = random.Random(7 + causal)
    lengths_q = [rng.choice([0, 1, 5, 31, 32, 70]) for _ in range(6)]
    lengths_k = [q + rng.choice([0, 0, 3, 40]) - (rng.random() < 0.3) * min(q, 4) for q in lengths_q]
    cu_q, cu_k = _indptr(lengths_q).cpu(), _indptr(lengths_k).cpu()
    heads = 2
    plan = build_fp8_prefill_plan(
        cu_q, cu_k, num_heads=heads, causal=causal, device=torch.device("cpu"), tile_q=16, kv_split=24,
        num_programs=5,
    )  # fmt: skip
    expected = []
    for b in range(len(lengths_q)):
        visible = causal_visible(lengths_q[b], lengths_k[b], causal=causal)
        for i, j in visible.nonzero().tolist():
            expected.extend((int(cu_q[b]) + i, int(cu_k[b]) + j, h) for h in range(heads))
    covered = _covered_pairs(plan.units[: plan.num_units])
    assert len(covered) == len(set(covered)), "a (row, key, head) is attended twice"
    assert sorted(covered) == sorted(expected)
    # every query row of every head is written exactly once: by a single-split unit or a group
    groups = plan.groups[: plan.num_groups].tolist()
    slots = sorted(int(s) for s in plan.units[: plan.num_units, 5].tolist() if s >= 0)
    assert slots == sorted(s for g in groups for s in range(g[2], g[2] + g[3]) for _ in range(heads))
    assert plan.num_slots == sum(g[3] for g in groups)


def test_kv_split_grows_with_the_batch() -> None:
    one_long = choose_kv_split([0, 128], [0, 65536], num_heads=16, causal=True, tile_q=128, num_programs=132)
    assert one_long % KV_SPLIT_ALIGN == 0
    assert 1024 <= one_long < 65536, "a lone long tile is split so every program gets work"
    cu = [0, 4096, 8192, 12288, 16384]
    big = choose_kv_split(cu, cu, num_heads=128, causal=True, tile_q=128, num_programs=132)
    assert big >= 4096, "a batch with enough tiles runs one pass per tile"


def _small_fp8_case() -> dict[str, object]:
    cu = _indptr([20])
    q8, qs = quantize_per_tensor(torch.randn(20, 2, 192, device=DEVICE), torch.float8_e4m3fn)
    v8, vs = quantize_per_tensor(torch.randn(20, 2, 128, device=DEVICE), torch.float8_e4m3fn)
    return {
        "q": q8, "k": q8, "v": v8, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "softmax_scale": 0.1,
        "q_scale": qs, "k_scale": qs, "v_scale": vs, "causal": True,
        "out": torch.empty(20, 2, 128, device=DEVICE), "lse": torch.empty(20, 2, device=DEVICE),
    }  # fmt: skip


def _one_request_plan(*, causal: bool) -> object:
    cu = torch.tensor([0, 20])
    return plan_fp8_prefill(cu, cu, num_heads=2, causal=causal, device=DEVICE)


def test_fp8_prefill_rejects_a_plan_for_another_batch() -> None:
    case = _small_fp8_case()
    other = _one_request_plan(causal=False)
    with pytest.raises(PlanMismatchError, match="causal"):
        fp8_prefill_fwd(Fp8PrefillCall(schedule=other, **case))  # type: ignore[arg-type]
    with pytest.raises(PlanMismatchError, match="Fp8PrefillPlan"):
        fp8_prefill_fwd(Fp8PrefillCall(schedule=object(), **case))  # type: ignore[arg-type]


def test_launchers_reject_bad_inputs() -> None:
    case = _small_fp8_case()
    plan = _one_request_plan(causal=True)
    with pytest.raises(InvalidInputError, match="v_scale"):
        fp8_prefill_fwd(Fp8PrefillCall(schedule=plan, **{**case, "v_scale": torch.ones(2, device=DEVICE)}))  # type: ignore[arg-type]
    q = torch.randn(20, 2, 192, device=DEVICE)
    v = torch.randn(20, 2, 128, device=DEVICE)
    out, lse = torch.empty(20, 2, 128, device=DEVICE), torch.empty(20, 2, device=DEVICE)
    cu = _indptr([20])
    varlen = VarlenPrefillCall(
        q=q, k=q, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out, lse=lse, max_seqlen_q=20, max_seqlen_k=20,
        softmax_scale=0.1, causal=True,
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match="softmax_scale"):
        varlen_attention_fwd(attrs.evolve(varlen, softmax_scale=0.0))
    with pytest.raises(InvalidInputError, match="cu_seqlens_q"):
        varlen_attention_fwd(attrs.evolve(varlen, cu_seqlens_q=cu.long()))
    with pytest.raises(InvalidInputError, match="fp8"):
        fp8_prefill_fwd(Fp8PrefillCall(schedule=plan, **{**case, "q": q, "k": q, "v": v}))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="contiguous"):
        varlen_attention_fwd(attrs.evolve(varlen, q=q.transpose(0, 2).contiguous().transpose(0, 2)))
    pe = torch.randn(20, 64, device=DEVICE)
    with pytest.raises(InvalidInputError, match=r"^k: "):  # whole keys beside k_pe
        varlen_attention_fwd(attrs.evolve(varlen, k_pe=pe))
    with pytest.raises(InvalidInputError, match="k_pe"):
        varlen_attention_fwd(attrs.evolve(varlen, k=q[..., :128], k_pe=pe[:19]))
    with pytest.raises(InvalidInputError, match="prior_out"):
        varlen_attention_fwd(attrs.evolve(varlen, prior_out=out))
    with pytest.raises(InvalidInputError, match="prior_lse"):
        varlen_attention_fwd(attrs.evolve(varlen, prior_out=out, prior_lse=lse[:, :1]))


KIT_CASES = [
    PrefillCase(
        heads=2,
        q_lens=(9, 1, 17),
        kv_lens=(12, 5, 17),
        dtype=torch.float16,
        qk_nope_dim=24,
        rope_dim=8,
        v_dim=16,
        kv_lora_rank=32,
    ),
    PrefillCase(
        heads=2,
        q_lens=(6, 11),
        dtype=torch.float32,
        causal=False,
        qk_nope_dim=24,
        rope_dim=8,
        v_dim=16,
        kv_lora_rank=32,
    ),
    PrefillCase(
        heads=2,
        q_lens=(5, 7),
        context_lens=(9, 0),
        dtype=torch.float16,
        qk_nope_dim=24,
        rope_dim=8,
        v_dim=16,
        kv_lora_rank=32,
        block_size=4,
    ),
    # Several context chunks (a 16-token workspace), one-token and context-free requests: the
    # chunks merged by the varlen kernel's epilogue, keys whole (fp16) or as strided k_nope
    # views plus the latent's rope lanes (fp32, fp16).
    PrefillCase(
        heads=2, q_lens=(1, 6, 1, 3), context_lens=(13, 0, 21, 5), dtype=torch.float16, qk_nope_dim=24,
        rope_dim=8, v_dim=16, kv_lora_rank=32, block_size=4, context_chunk_tokens=16,
    ),
    PrefillCase(
        heads=2, q_lens=(1, 6, 1, 3), context_lens=(13, 0, 21, 5), dtype=torch.float32, qk_nope_dim=24,
        rope_dim=8, v_dim=16, kv_lora_rank=32, block_size=4, context_chunk_tokens=16, context_nope_keys=True,
    ),
    PrefillCase(
        heads=3, q_lens=(4, 1), context_lens=(30, 9), dtype=torch.float16, qk_nope_dim=32, rope_dim=16,
        v_dim=16, kv_lora_rank=32, block_size=8, context_chunk_tokens=16, context_nope_keys=True, seed=7,
    ),
]  # fmt: skip


KIT_PARAMS = [
    pytest.param(strategy, case, id=f"{case.id}-{strategy.NAME}")
    for case in KIT_CASES
    for strategy in PREFILL_STRATEGIES
    if prefill_support(strategy, case, provider="triton", platform="sm90")
]
"""The supported pairs only (the fp8 prefill has no context merge, so not the context case)."""


def test_every_prefill_strategy_has_kit_cases() -> None:
    """The varlen prefill takes every kit case; the fp8 prefill every one without context."""
    for strategy in PREFILL_STRATEGIES:
        collected = [p.values[1] for p in KIT_PARAMS if p.values[0] is strategy]
        expected = [c for c in KIT_CASES if not (c.has_context and strategy is Fp8PersistentPrefill)]
        assert collected == expected, strategy.NAME


@pytest.mark.parametrize(("strategy", "case"), KIT_PARAMS)
def test_prefill_strategy_conformance(strategy: type[PrefillStrategy], case: PrefillCase) -> None:
    """Both prefill strategies pass the conformance kit on the Triton provider (interpreter)."""
    result = check_prefill_strategy(strategy, case, provider="triton", platform="sm90", device=DEVICE)
    assert result.supported, f"collected as supported, then declined: {result.reasons}"
    result.assert_passed()
