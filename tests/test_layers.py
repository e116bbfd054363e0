"""``MLAAttention`` on every strategy: a mixed step against float64 attention over the full keys.

The reference up-projects every latent row of each request (history and new tokens) with the
layer's own ``kv_b_proj`` and runs plain causal MHA in float64, so it shares nothing with the
absorbed decode path, the chunked-context prefill or the paged cache. Emulated providers (the
torch kernels under aiter's and Triton's capability records) make the resolver choose the
padded, flattened, small-head and fp8 paths on a CPU; forcing each strategy covers the rest.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

import mla
from mla.core.errors import InvalidInputError, UnsupportedError
from mla.layers import MLAAttention, deepseek_softmax_scale, yarn_mscale
from mla.providers import emulated_provider
from mla.tools.reference import causal_visible

# (seq_len, new tokens), decodes first: a decode, a verify of 3, prefills with context 23 and
# 1 and one without.
REQUESTS = [(41, 1), (30, 3), (31, 8), (3, 2), (5, 5)]
NUM_DECODES = 2
TOLERANCE = {"bf16": 2e-2, "fp8": 8e-2}


def make_backend(
    heads: int, kv_dtype: str, provider: Any, *, platform: Any = "cpu", head_dim: int = 32, **options: Any
) -> mla.MLABackend:
    """DeepSeek's 512/64 latent, ``head_dim``-wide nope and v heads, a bf16 model."""
    dims = mla.MLADims(
        num_heads=heads, qk_nope_head_dim=head_dim, v_head_dim=head_dim, softmax_scale=(head_dim + 64) ** -0.5
    )
    if isinstance(platform, str):
        platform = mla.simulated_platform(platform)
    fp8 = provider.capabilities(platform).fp8_dtype
    return mla.MLABackend(
        dims,
        mla.KVCacheSpec(4, fp8 if kv_dtype == "fp8" else kv_dtype, num_blocks=64),
        mla.EngineLimits(max_num_seqs=6, max_model_len=48, max_num_batched_tokens=48, max_decode_qlen=4),
        model_dtype=torch.bfloat16,
        provider=provider,
        platform=platform,
        context_chunk_tokens=24,
        **options,
    )


def run_step(backend: mla.MLABackend, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, mla.MLAMetadata]:
    """Serve one mixed step of :data:`REQUESTS` through a fresh layer; return (out, ref, meta)."""
    dims, bs, dev = backend.dims, backend.cache.block_size, backend.device
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    weight = torch.randn(
        dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=gen
    )
    layer = MLAAttention(backend, weight / math.sqrt(dims.kv_lora_rank))
    kv_scale = 1.0 / 32.0 if backend.cache.is_fp8 else None
    free = list(range(64))
    rng.shuffle(free)
    cache = torch.randn(64, bs, dims.latent_dim, generator=gen).to(dev, backend.cache.dtype)
    rows = [torch.randn(seq, dims.latent_dim, generator=gen).to(dev, torch.bfloat16) for seq, _ in REQUESTS]
    tables, slots, new_slots = [], [], []
    for (seq, new), latent in zip(REQUESTS, rows, strict=True):
        blocks = [free.pop() for _ in range(-(-seq // bs))]
        tables.append(blocks + [0] * (12 - len(blocks)))
        slots = [blocks[p // bs] * bs + p % bs for p in range(seq)]
        history = seq - new
        if history:
            layer.attention.impl.write_kv(
                latent[:history, : dims.kv_lora_rank],
                latent[:history, dims.kv_lora_rank :],
                cache,
                torch.tensor(slots[:history], device=dev),
                kv_scale=kv_scale,
            )
        new_slots += slots[history:]
    qlens = [new for _, new in REQUESTS]
    qsl = torch.tensor([0, *itertools_accumulate(qlens)], dtype=torch.int32)
    seq_lens = torch.tensor([seq for seq, _ in REQUESTS], dtype=torch.int32)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.to(dev),
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        block_table=torch.tensor(tables, dtype=torch.int32, device=dev),
        num_decodes=NUM_DECODES,
        num_decode_tokens=sum(qlens[:NUM_DECODES]),
    )
    meta = backend.builder.build(step)
    total = sum(qlens)
    q_nope = torch.randn(total, dims.num_heads, dims.qk_nope_head_dim, generator=gen).to(dev, torch.bfloat16)
    q_pe = torch.randn(total, dims.num_heads, dims.qk_rope_head_dim, generator=gen).to(dev, torch.bfloat16)
    new_rows = torch.cat([latent[seq - new :] for (seq, new), latent in zip(REQUESTS, rows, strict=True)])
    out = torch.full((total, dims.num_heads, dims.v_head_dim), math.nan, dtype=torch.bfloat16, device=dev)
    layer(
        meta,
        q_nope,
        q_pe,
        new_rows[:, : dims.kv_lora_rank],
        new_rows[:, dims.kv_lora_rank :],
        cache,
        slot_mapping=torch.tensor(new_slots, device=dev),
        kv_scale=kv_scale,
        out=out,
    )
    # float64 reference over each request's full keys, as the cache holds them.
    w = layer.kv_b_proj.double().cpu().view(dims.num_heads, -1, dims.kv_lora_rank)
    q_nope, q_pe, rows = q_nope.cpu(), q_pe.cpu(), [latent.cpu() for latent in rows]
    w_k, w_v = w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim :]
    ref = torch.zeros(total, dims.num_heads, dims.v_head_dim, dtype=torch.float64)
    start = 0
    for (seq, new), latent in zip(REQUESTS, rows, strict=True):
        keys = latent.double()
        if kv_scale is not None:
            keys = (latent.float() / kv_scale).to(backend.cache.dtype).double() * kv_scale
        c, k_pe = keys[:, : dims.kv_lora_rank], keys[:, dims.kv_lora_rank :]
        k = torch.cat([torch.einsum("sl,hnl->shn", c, w_k), k_pe[:, None].expand(-1, dims.num_heads, -1)], -1)
        v = torch.einsum("sl,hvl->shv", c, w_v)
        q = torch.cat([q_nope[start : start + new], q_pe[start : start + new]], -1).double()
        scores = torch.einsum("qhd,shd->hqs", q, k) * dims.scale
        scores = scores.masked_fill(~causal_visible(new, seq)[None], -math.inf)
        ref[start : start + new] = torch.einsum("hqs,shv->qhv", torch.softmax(scores, -1), v)
        start += new
    return out.cpu(), ref, meta


def itertools_accumulate(values: list[int]) -> list[int]:
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("emulate", "arch", "heads"),
    [
        ("torch", "cpu", 16),
        ("aiter", "gfx950", 8),
        ("aiter", "gfx950", 16),
        ("aiter", "gfx942", 16),
        ("triton", "sm90", 16),
    ],
)
def test_layer_on_emulated_providers(emulate: str, arch: str, heads: int, kv_dtype: str) -> None:
    provider = emulated_provider(emulate, arch)
    try:
        backend = make_backend(heads, kv_dtype, provider, platform=arch)
    except UnsupportedError as exc:
        pytest.skip(f"{emulate} on {arch} cannot serve this: {str(exc).splitlines()[0]}")
    out, ref, meta = run_step(backend)
    assert meta.decode is not None
    if (emulate, arch, heads, kv_dtype) == ("aiter", "gfx950", 8, "bf16"):
        # The Gluon small-head kernels (forced for every qlen they cannot all serve) run here.
        assert meta.decode.strategy == mla.GluonVerifyFlatten.NAME
    assert meta.prefill is not None
    assert meta.prefill.context_chunks, "the step has cached context"
    assert rel_error(out, ref) <= TOLERANCE[kv_dtype], (meta.decode.strategy, meta.prefill.strategy)


@pytest.mark.parametrize("decode", [mla.PaddedAsmPersistent.NAME, mla.AsmNonPersistent.NAME])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_layer_on_each_forced_decode_strategy(decode: str, kv_dtype: str) -> None:
    provider = emulated_provider("aiter", "gfx950")
    try:
        # 8 heads: the asm kernels pad them to 16.
        backend = make_backend(8, kv_dtype, provider, platform="gfx950", decode_strategy=decode)
    except UnsupportedError as exc:
        pytest.skip(f"{decode} cannot serve an {kv_dtype} cache here: {str(exc).splitlines()[0]}")
    out, ref, meta = run_step(backend, seed=1)
    assert meta.decode is not None
    assert meta.decode.strategy == decode
    assert rel_error(out, ref) <= TOLERANCE[kv_dtype]


def test_fp8_prefill_without_context_through_the_layer() -> None:
    """The fp8 prefill declines cached context; on a context-free step the layer still matches."""
    global REQUESTS, NUM_DECODES
    saved = REQUESTS, NUM_DECODES
    REQUESTS, NUM_DECODES = [(6, 6), (9, 9)], 0
    try:
        backend = make_backend(16, "fp8", emulated_provider("aiter", "gfx950"), platform="gfx950")
        out, ref, meta = run_step(backend, seed=2)
    finally:
        REQUESTS, NUM_DECODES = saved
    assert meta.prefill is not None
    assert meta.prefill.strategy == "fp8-persistent-prefill"
    assert rel_error(out, ref) <= TOLERANCE["fp8"]


def test_weights_are_split_per_rank() -> None:
    """Rank r keeps heads r*H..r*H+H-1 of kv_b_proj: W_UK rows then W_UV rows of each head."""
    dims = mla.MLADims(
        num_heads=2,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=3,
        v_head_dim=5,
        softmax_scale=7**-0.5,
    )
    backend = mla.MLABackend(
        dims, mla.KVCacheSpec(4), mla.EngineLimits(2, 16, 16), model_dtype=torch.float32, provider="torch"
    )
    weight = torch.arange(6 * 8 * 8, dtype=torch.float32).view(6 * 8, 8)  # 6 heads of 3 + 5 rows
    layer = MLAAttention(backend, weight, tp_rank=1, tp_size=3)
    heads = weight.view(6, 8, 8)[2:4]
    assert torch.equal(layer.w_uk_t, heads[:, :3])
    assert torch.equal(layer.w_uv, heads[:, 3:].transpose(1, 2))
    sharded = MLAAttention(backend, weight[2 * 8 : 4 * 8], sharded=True)
    assert torch.equal(sharded.w_uv, layer.w_uv)
    with torch.no_grad():
        layer.kv_b_proj.zero_()
    layer.process_weights_after_loading()
    assert bool((layer.w_uk_t == 0).all())


def test_softmax_scale_convention() -> None:
    assert deepseek_softmax_scale(192) == pytest.approx(192**-0.5)
    v3 = {
        "type": "yarn",
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    }
    m = 0.1 * math.log(40) + 1.0
    assert deepseek_softmax_scale(192, v3) == pytest.approx(192**-0.5 * m * m)
    assert deepseek_softmax_scale(192, {**v3, "mscale_all_dim": 0}) == pytest.approx(192**-0.5)
    assert deepseek_softmax_scale(
        192, {"rope_type": "default", "factor": 40, "mscale_all_dim": 1}
    ) == pytest.approx(192**-0.5)
    assert yarn_mscale(1.0, 5.0) == 1.0
    with pytest.raises(InvalidInputError) as info:
        deepseek_softmax_scale(192, {"rope_type": "yarn", "mscale_all_dim": 1.0})
    assert info.value.argument == "rope_scaling"
    with pytest.raises(InvalidInputError):
        deepseek_softmax_scale(0)


def small_layer() -> tuple[MLAAttention, mla.MLABackend]:
    dims = mla.MLADims(
        num_heads=2,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        softmax_scale=8**-0.5,
    )
    backend = mla.MLABackend(
        dims,
        mla.KVCacheSpec(4, num_blocks=4),
        mla.EngineLimits(2, 16, 16),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
    )
    return MLAAttention(backend, torch.randn(2 * 8, 8)), backend


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"weight": torch.randn(15, 8)}, "kv_b_proj"),
        ({"weight": torch.randn(16, 8), "tp_size": 2}, "kv_b_proj"),
        ({"weight": torch.randn(16, 8), "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"weight": torch.randn(16)}, "kv_b_proj"),
        ({"weight": torch.ones(16, 8, dtype=torch.int64)}, "kv_b_proj"),
    ],
)
def test_layer_rejects_bad_weights(kwargs: dict[str, Any], argument: str) -> None:
    _, backend = small_layer()
    weight = kwargs.pop("weight")
    with pytest.raises(InvalidInputError) as info:
        MLAAttention(backend, weight, **kwargs)
    assert info.value.argument == argument


@pytest.mark.parametrize("bad", ["q_nope", "q_pe", "kv_c_normed", "k_pe", "slot_mapping", "no-slots", "out"])
def test_layer_rejects_bad_inputs(bad: str) -> None:
    layer, backend = small_layer()
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq = torch.tensor([3, 2], dtype=torch.int32)
    meta = backend.builder.build(
        mla.StepInputs(qsl, qsl, seq, torch.tensor([[0], [1]], dtype=torch.int32), 1, 1, seq)
    )
    inputs: dict[str, Any] = {
        "q_nope": torch.randn(3, 2, 4),
        "q_pe": torch.randn(3, 2, 4),
        "kv_c_normed": torch.randn(3, 8),
        "k_pe": torch.randn(3, 4),
    }
    options: dict[str, Any] = {"slot_mapping": torch.tensor([2, 4, 5])}
    if bad in inputs:
        inputs[bad] = inputs[bad][:2]
    elif bad == "slot_mapping":
        options["slot_mapping"] = torch.tensor([2, 4])
    elif bad == "no-slots":
        options["slot_mapping"] = None
    else:
        options["out"] = torch.empty(3, 2, 5)
    cache = torch.zeros(4, 4, 12)
    with pytest.raises(InvalidInputError) as info:
        layer(meta, *inputs.values(), cache, **options)
    assert info.value.argument == ("slot_mapping" if bad == "no-slots" else bad)
    assert bool((cache == 0).all()), "nothing is written before the inputs are checked"


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_layer_on_the_gpu_provider(heads: int, kv_dtype: str) -> None:
    """The GPU provider (Triton on CUDA, aiter on ROCm) behind the layer, DeepSeek's latent dims."""
    platform = mla.detect_platform("cuda")
    provider = mla.providers.auto_provider(platform)
    backend = make_backend(heads, kv_dtype, provider, platform=platform, head_dim=128, device="cuda")
    out, ref, meta = run_step(backend, seed=3)
    assert meta.decode is not None
    assert rel_error(out, ref) <= TOLERANCE[kv_dtype]
