"""GPU tests of the Triton prefill kernels (varlen bf16/fp16 and fp8 persistent) at 192/128.

Compared with :func:`mla.tools.reference.reference_prefill` (float64; the fp8 kernels against the
reference on their dequantized inputs). Outputs are poisoned with NaN before each run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mla
from mla.providers.calls import Fp8PrefillCall, VarlenPrefillCall
from mla.providers.quant import quantize_per_tensor
from mla.providers.triton.fp8_prefill import build_fp8_prefill_plan, fp8_prefill_fwd, plan_fp8_prefill
from mla.providers.triton.prefill import varlen_attention_fwd
from mla.tools.reference import reference_prefill

pytestmark = pytest.mark.gpu

QK_DIM, V_DIM = 192, 128
SCALE = QK_DIM**-0.5
# request lengths (q, k): Sk > Sq (chunked prefill), Sk < Sq (rows with no key), empty q / k,
# and lengths that are not block multiples
BATCHES = {
    "mixed": ([100, 1, 257, 0, 64, 5], [300, 50, 257, 10, 64, 0]),
    "sk-lt-sq": ([130, 70], [40, 70]),
    "long": ([1030], [2051]),
}
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _inputs(
    lengths_q: list[int], lengths_k: list[int], heads: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens, kv_tokens = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tokens, heads, QK_DIM, device="cuda", generator=gen).to(dtype)
    k = torch.randn(kv_tokens, heads, QK_DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(kv_tokens, heads, V_DIM, device="cuda", generator=gen).to(dtype)
    return q, k, v, _indptr(lengths_q), _indptr(lengths_k)


def _poisoned(tokens: int, heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((tokens, heads, V_DIM), float("nan"), dtype=dtype, device="cuda")
    return out, torch.full((tokens, heads), float("nan"), device="cuda")


def _assert_close(
    out: torch.Tensor, lse: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], tol: float
) -> None:
    ref_out, ref_lse = ref
    out64, lse64 = out.cpu().double(), lse.cpu().double()
    assert not torch.isnan(out64).any(), "unwritten output rows"
    assert not torch.isnan(lse64).any(), "unwritten lse rows"
    err = float((out64 - ref_out).norm() / ref_out.norm().clamp_min(1e-30))
    assert err < tol, f"relative output error {err:.3g} >= {tol}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse64), finite), "rows without keys must have lse = -inf"
    assert bool((lse64[~finite] == float("-inf")).all())
    if bool(finite.any()):
        assert float((lse64[finite] - ref_lse[finite]).abs().max()) < 2e-3
    assert bool((out64[~finite] == 0).all()), "rows without keys must be 0"


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_reference(batch: str, causal: bool, dtype: torch.dtype) -> None:
    lengths_q, lengths_k = BATCHES[batch]
    heads = 3
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, heads, dtype, seed=len(batch))
    out, lse = _poisoned(q.shape[0], heads, dtype)
    varlen_attention_fwd(
        VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
            max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=SCALE, causal=causal,
        )
    )  # fmt: skip
    ref = reference_prefill(q, k, v, cu_q, cu_k, softmax_scale=SCALE, causal=causal)
    _assert_close(out, lse, ref, TOL[dtype])


def _fp8_inputs(
    lengths_q: list[int], lengths_k: list[int], heads: int, seed: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, heads, torch.bfloat16, seed)
    return [quantize_per_tensor(x, torch.float8_e4m3fn) for x in (q, k, v)], cu_q, cu_k


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_split", [None, 128])
def test_fp8_prefill_matches_reference(batch: str, causal: bool, kv_split: int | None) -> None:
    """``kv_split=None`` is the planner's choice (one pass per tile here); 128 forces partials."""
    lengths_q, lengths_k = BATCHES[batch]
    heads = 3
    quantized, cu_q, cu_k = _fp8_inputs(lengths_q, lengths_k, heads, seed=7)
    (q8, qs), (k8, ks), (v8, vs) = quantized
    device = torch.device("cuda")
    if kv_split is None:
        plan = plan_fp8_prefill(cu_q.cpu(), cu_k.cpu(), num_heads=heads, causal=causal, device=device)
    else:
        plan = build_fp8_prefill_plan(
            cu_q.cpu(), cu_k.cpu(), num_heads=heads, causal=causal, device=device, tile_q=128,
            kv_split=kv_split, num_programs=7,
        )  # fmt: skip
        assert plan.num_groups > 0 or batch == "sk-lt-sq"
    out, lse = _poisoned(q8.shape[0], heads, torch.bfloat16)
    fp8_prefill_fwd(
        Fp8PrefillCall(
            q=q8, k=k8, v=v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse, schedule=plan,
            softmax_scale=SCALE, q_scale=qs, k_scale=ks, v_scale=vs, causal=causal,
        )
    )  # fmt: skip
    deq = [x.double() * s.double() for x, s in quantized]
    ref = reference_prefill(*deq, cu_q, cu_k, softmax_scale=SCALE, causal=causal)
    _assert_close(out, lse, ref, 2e-2)


def test_kernels_capture_in_a_cuda_graph() -> None:
    """No host sync inside: both launchers record into a CUDA graph and replay correctly."""
    lengths_q, lengths_k = BATCHES["mixed"]
    heads = 2
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, heads, torch.bfloat16, seed=3)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_per_tensor(x, torch.float8_e4m3fn) for x in (q, k, v))
    plan = build_fp8_prefill_plan(
        cu_q.cpu(), cu_k.cpu(), num_heads=heads, causal=True, device=q.device, tile_q=128, kv_split=128,
        num_programs=5,
    )  # fmt: skip
    out, lse = _poisoned(q.shape[0], heads, torch.bfloat16)
    out8, lse8 = _poisoned(q.shape[0], heads, torch.bfloat16)

    def step() -> None:
        varlen_attention_fwd(
            VarlenPrefillCall(
                q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse,
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), softmax_scale=SCALE, causal=True,
            )
        )  # fmt: skip
        fp8_prefill_fwd(
            Fp8PrefillCall(
                q=q8, k=k8, v=v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out8, lse=lse8, schedule=plan,
                softmax_scale=SCALE, q_scale=qs, k_scale=ks, v_scale=vs, causal=True,
            )
        )  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    for tensor in (out, lse, out8, lse8):
        tensor.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, lse, reference_prefill(q, k, v, cu_q, cu_k, softmax_scale=SCALE), TOL[torch.bfloat16])
    deq = [x.double() * s.double() for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    _assert_close(out8, lse8, reference_prefill(*deq, cu_q, cu_k, softmax_scale=SCALE), 2e-2)


def _triton_provider_ready() -> bool:
    return importlib.util.find_spec("mla.providers.triton") is not None and hasattr(
        importlib.import_module("mla.providers.triton"), "TritonProvider"
    )


@pytest.mark.parametrize("strategy", ["flash-varlen", "fp8-persistent-prefill"])
def test_mla_prefill_through_the_triton_provider(strategy: str) -> None:
    if not _triton_provider_ready():
        pytest.skip("mla.providers.triton.TritonProvider is not importable yet")
    lengths_q, lengths_k = BATCHES["mixed"]
    heads = 16
    q, k, v, cu_q, cu_k = _inputs(lengths_q, lengths_k, heads, torch.bfloat16, seed=11)
    out, lse = mla.mla_prefill(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), softmax_scale=SCALE, causal=True,
        provider="triton", strategy=strategy,
    )  # fmt: skip
    if strategy == "fp8-persistent-prefill":
        dtype = mla.get_provider("triton").capabilities(mla.detect_platform()).fp8_dtype
        deq = [x8.double() * s.double() for x8, s in (quantize_per_tensor(x, dtype) for x in (q, k, v))]
        ref = reference_prefill(*deq, cu_q, cu_k, softmax_scale=SCALE)
        _assert_close(out, lse, ref, 2e-2)
    else:
        _assert_close(out, lse, reference_prefill(q, k, v, cu_q, cu_k, softmax_scale=SCALE), 1e-2)
