"""``MLAAttention`` against Hugging Face transformers' ``DeepseekV3Attention``.

HF's layer runs each whole sequence once in float32 (eager attention, causal mask). Hooks on its
projections capture ``q`` (before rope), the normed latent and ``k_pe`` (before rope); HF's own
rope functions rotate them with HF's cos/sin. ``MLAAttention`` is fed those rows over mixed
engine steps (prefills with and without cached context, decodes, verifies of qlen 2-4) through a
paged cache, and each step's output is compared with HF's attention output before ``o_proj`` at
the same positions. Tensor parallelism is simulated in one process: rank ``r`` of ``tp`` gets
its head slice and its own backend and cache.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hf_common import LENGTHS, STEPS, YARN, Model, grow_slots, hook_outputs, mla_rows, step_inputs

import mla
from mla.layers import MLAAttention, deepseek_softmax_scale

transformers = pytest.importorskip(
    "transformers", reason="the HF cross-check needs transformers (pip install -e '.[test]')"
)
hf_ds = pytest.importorskip(
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    reason="this transformers has no DeepSeek-V3 model",
)

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 8e-2}
"""Largest ``max|out - hf| / max|hf|`` per step, by cache dtype (float32 model)."""


CONFIGS: dict[str, dict[str, Any]] = {
    "plain-rope": {"q_lora_rank": None, "rope_interleave": False, "rope": {"rope_type": "default"}},
    "q-lora-interleaved": {"q_lora_rank": 24, "rope_interleave": True, "rope": {"rope_type": "default"}},
    "yarn": {
        "q_lora_rank": 24,
        "rope_interleave": True,
        "rope": dict(YARN),
    },
    "yarn-mscale-differs": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "rope": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.5,
        },
    },
}


def hf_config(q_lora_rank: int | None, rope_interleave: bool, rope: dict[str, Any]) -> Any:
    """A tiny DeepSeek-V3 config (4 heads, latent 32, rope 16, nope 16, v 24) in float32."""
    common: dict[str, Any] = {
        "vocab_size": 32,
        "hidden_size": 48,
        "intermediate_size": 32,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 24,
        "max_position_embeddings": 64,
        "rope_interleave": rope_interleave,
    }
    if TRANSFORMERS_MAJOR >= 5:
        config = transformers.DeepseekV3Config(rope_parameters={"rope_theta": 10000.0, **rope}, **common)
    else:
        scaling = None if rope["rope_type"] == "default" else dict(rope)
        config = transformers.DeepseekV3Config(rope_theta=10000.0, rope_scaling=scaling, **common)
    config._attn_implementation = "eager"
    return config


def rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(params or {})


def capture(config: Any, attn: Any, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run HF's layer on one sequence ``[S, hidden]``; return its per-token MLA inputs and the
    attention output before ``o_proj``."""
    seen: dict[str, torch.Tensor] = {}
    q_module = attn.q_proj if config.q_lora_rank is None else attn.q_b_proj
    modules = {"q": q_module, "kv_c": attn.kv_a_layernorm, "kv": attn.kv_a_proj_with_mqa}
    handles = hook_outputs(modules, attn.o_proj, seen)
    seq = hidden.shape[0]
    rotary = hf_ds.DeepseekV3RotaryEmbedding(config=config)
    cos, sin = rotary(hidden[None], torch.arange(seq)[None])
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    try:
        with torch.no_grad():
            attn(hidden[None], (cos, sin), mask)
    finally:
        for handle in handles:
            handle.remove()
    apply_rope = (
        hf_ds.apply_rotary_pos_emb_interleave if config.rope_interleave else hf_ds.apply_rotary_pos_emb
    )
    return mla_rows(config, seen, seq, cos, sin, apply_rope)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest) -> Model:
    torch.manual_seed(7)
    config = hf_config(**CONFIGS[request.param])
    attn = hf_ds.DeepseekV3Attention(config, layer_idx=0).eval()
    rows = {
        name: capture(config, attn, torch.randn(length, config.hidden_size))
        for name, length in LENGTHS.items()
    }
    return Model(request.param, config, attn, rows)


class Rank:
    """One simulated tensor-parallel rank: its backend, layer, cache and block lists."""

    def __init__(
        self, model: Model, *, tp_rank: int, tp_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype
    ):
        config = model.config
        heads = config.num_attention_heads // tp_size
        self.heads = slice(tp_rank * heads, (tp_rank + 1) * heads)
        dims = mla.MLADims(
            num_heads=heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim,
            qk_nope_head_dim=config.qk_nope_head_dim,
            v_head_dim=config.v_head_dim,
            softmax_scale=deepseek_softmax_scale(
                config.qk_nope_head_dim + config.qk_rope_head_dim, rope_parameters(config)
            ),
        )
        self.block_size, num_blocks = 4, 40
        self.backend = mla.MLABackend(
            dims,
            mla.KVCacheSpec(self.block_size, kv_dtype, num_blocks=num_blocks),
            mla.EngineLimits(max_num_seqs=3, max_model_len=32, max_num_batched_tokens=32, max_decode_qlen=4),
            model_dtype=model_dtype,
            provider="torch",
            context_chunk_tokens=12,  # the smallest workspace: contexts span several chunks
        )
        self.layer = MLAAttention(self.backend, model.attn.kv_b_proj.weight, tp_rank=tp_rank, tp_size=tp_size)
        self.cache = torch.full((num_blocks, self.block_size, dims.latent_dim), float("nan")).to(kv_dtype)
        self.free = list(range(num_blocks))
        random.Random(tp_rank).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {name: [] for name in LENGTHS}

    def slots(self, name: str, start: int, count: int) -> list[int]:
        return grow_slots(self.blocks[name], self.free, self.block_size, start, count)


def run_steps(model: Model, *, tp_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> list[float]:
    """Serve :data:`STEPS` on every simulated rank; return each (rank, step) relative error."""
    latent_amax = max(float(torch.cat([r["kv_c"], r["k_pe"]], -1).abs().max()) for r in model.rows.values())
    kv_scale = latent_amax / 224.0 if kv_dtype == torch.float8_e4m3fn else None
    errors = []
    for tp_rank in range(tp_size):
        rank = Rank(model, tp_rank=tp_rank, tp_size=tp_size, kv_dtype=kv_dtype, model_dtype=model_dtype)
        done = dict.fromkeys(LENGTHS, 0)
        for decodes, prefills in STEPS:
            picks: list[tuple[str, int, int]] = [(n, done[n], q) for n, q in (*decodes, *prefills)]
            slots: list[int] = []
            for name, start, count in picks:
                slots += rank.slots(name, start, count)
            metadata = rank.backend.builder.build(step_inputs(picks, rank.blocks, len(decodes)))

            def rows(key: str, picks: list[tuple[str, int, int]] = picks) -> torch.Tensor:
                return torch.cat([model.rows[n][key][s : s + c] for n, s, c in picks])

            out = rank.layer(
                metadata,
                rows("q_nope")[:, rank.heads].to(model_dtype),
                rows("q_pe")[:, rank.heads].to(model_dtype),
                rows("kv_c").to(model_dtype),
                rows("k_pe").to(model_dtype),
                rank.cache,
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                kv_scale=kv_scale,
            )
            ref = rows("out")[:, rank.heads]
            assert out.shape == ref.shape
            errors.append(float((out.float() - ref).abs().max() / ref.abs().max()))
            for name, _, count in picks:
                done[name] += count
    return errors


def test_softmax_scale_matches_hf(model: Model) -> None:
    config = model.config
    scale = deepseek_softmax_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, rope_parameters(config))
    assert scale == pytest.approx(model.attn.scaling, rel=1e-12)


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(
    ("kv_dtype", "model_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float8_e4m3fn, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32", "bf16-cache", "fp8-cache", "bf16-model"],
)
def test_layer_matches_hf_attention(
    model: Model, tp_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype
) -> None:
    errors = run_steps(model, tp_size=tp_size, kv_dtype=kv_dtype, model_dtype=model_dtype)
    tol = TOLERANCE[torch.bfloat16 if model_dtype == torch.bfloat16 else kv_dtype]
    assert len(errors) == tp_size * len(STEPS)
    assert max(errors) <= tol, errors
