"""``MLAAttention`` with DeepSeek Sparse Attention against Hugging Face's ``DeepseekV32Attention``.

The ``hf_v32`` harness runs HF's layer once per whole sequence (float32, eager, causal mask) and
captures per token the MLA inputs, the indexer's inputs (index q/k after their rope, the scaled
per-head weights), HF's top-k and the attention output before ``o_proj``. ``mla`` is fed those
rows over mixed engine steps through paged latent and index-key caches (prefills with and
without cached context, decodes, verifies of qlen 2-4), and each step is checked at the same
positions:

* fed HF's top-k (its causally masked picks replaced by ``-1``: request-local positions, as an
  engine passes them), the output matches HF's per latent-cache format (float32, bf16,
  ``fp8_ds_mla``);
* with ``topk_indices=None`` mla's own indexer selects: the same sets as HF with float32 index
  keys (the sampled sequences are tie-free, see ``hf_v32.MARGIN``), at least 99% of them with
  bf16 or fp8 keys, and the layer's output is HF's attention over mla's selection.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import hf_v32
import pytest
import torch
from hf_common import LENGTHS, STEPS, grow_slots, step_inputs

import mla

CACHES: dict[str, torch.dtype | str] = {"fp32": torch.float32, "bf16": "bf16", "fp8_ds_mla": "fp8_ds_mla"}
"""Latent-cache formats by test id (``KVCacheSpec.dtype``)."""

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp8_ds_mla": 8e-2}
"""Largest ``max|out - ref| / max|ref|`` per step, by latent-cache format (float32 model)."""

KEY_DTYPES: dict[str, torch.dtype | str] = {"fp32": torch.float32, "bf16": "bf16", "fp8": "fp8"}
"""Index-key formats by test id (``IndexerSpec.key_dtype``)."""

MIN_OVERLAP = 0.99
"""Least fraction of HF's (visible) selection that mla's indexer keeps with rounded index keys."""

BLOCK_SIZE = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module", params=sorted(hf_v32.CONFIGS))
def model(request: pytest.FixtureRequest) -> hf_v32.Model:
    return hf_v32.build_model(request.param, LENGTHS)


class Engine:
    """mla's sparse backend and layer for one HF model, its two paged caches and block lists."""

    def __init__(self, model: hf_v32.Model, *, cache_dtype: torch.dtype | str, key_dtype: torch.dtype | str):
        config = model.config
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.dims = mla.MLADims(
            num_heads=config.num_attention_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=config.v_head_dim,
            softmax_scale=mla.deepseek_softmax_scale(nope + rope, hf_v32.rope_parameters(config)),
            index_topk=config.index_topk,
        )
        self.indexer = mla.IndexerSpec(
            num_heads=config.index_n_heads, head_dim=config.index_head_dim, key_dtype=key_dtype
        )
        self.cache = mla.KVCacheSpec(block_size=BLOCK_SIZE, dtype=cache_dtype, num_blocks=NUM_BLOCKS)
        limits = mla.EngineLimits(
            max_num_seqs=4, max_model_len=64, max_num_batched_tokens=128, max_decode_qlen=4
        )
        self.backend = mla.MLABackend(
            self.dims, self.cache, limits, model_dtype=torch.float32, provider="torch", indexer=self.indexer
        )
        self.layer = mla.MLAAttention(self.backend, model.attn.kv_b_proj.weight)
        # Float caches start as NaN (as in the dense test): a read of a row the step never wrote
        # shows up in the output. Byte formats (fp8_ds_mla rows, fp8 keys with scales) start as 0.
        self.kv_cache = self._empty(self.cache.row_width(self.dims), self.cache.dtype)
        self.index_cache = self._empty(self.indexer.row_width, self.indexer.storage_dtype)
        self.free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {name: [] for name in LENGTHS}

    @staticmethod
    def _empty(width: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.zeros(NUM_BLOCKS, BLOCK_SIZE, width, dtype=dtype)
        return torch.full((NUM_BLOCKS, BLOCK_SIZE, width), float("nan"), dtype=dtype)

    def slots(self, name: str, start: int, count: int) -> list[int]:
        return grow_slots(self.blocks[name], self.free, BLOCK_SIZE, start, count)

    def metadata(self, picks: list[tuple[str, int, int]], num_decodes: int) -> Any:
        return self.backend.builder.build(step_inputs(picks, self.blocks, num_decodes))


@attrs.frozen
class Step:
    """One served step: its rows (request, start, count), mla's output and HF's rows there."""

    picks: list[tuple[str, int, int]]
    out: torch.Tensor
    """``[T, H, v]`` mla's layer output."""
    hf: dict[str, torch.Tensor]
    """HF's captured :data:`hf_v32.KEYS` rows at the step's positions (``topk`` padded)."""
    positions: torch.Tensor
    """``[T]`` request-local position of each row."""
    selection: torch.Tensor | None
    """``[T, index_topk]`` mla's indexer selection when it selected, else ``None``."""


def serve(model: hf_v32.Model, engine: Engine, *, feed_hf_topk: bool) -> list[Step]:
    """Serve :data:`STEPS`; the layer gets HF's top-k (``feed_hf_topk``) or selects with its own
    indexer (then read back with ``impl.index_topk`` after the layer wrote the step's keys)."""
    topk = model.config.index_topk
    done = dict.fromkeys(LENGTHS, 0)
    steps = []
    for decodes, prefills in STEPS:
        picks = [(n, done[n], q) for n, q in (*decodes, *prefills)]
        slots = [s for n, start, count in picks for s in engine.slots(n, start, count)]
        metadata = engine.metadata(picks, len(decodes))
        positions = torch.cat([torch.arange(start, start + count) for _, start, count in picks])
        hf = {
            key: torch.cat([model.rows[n][key][start : start + count] for n, start, count in picks])
            for key in hf_v32.KEYS
            if key != "index_scores"
        }
        hf["topk"] = hf_v32.pad_masked(hf["topk"], positions)
        out = engine.layer(
            metadata,
            hf["q_nope"],
            hf["q_pe"],
            hf["kv_c"],
            hf["k_pe"],
            engine.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            index_q=hf["index_q"],
            index_k=hf["index_k"],
            index_weights=hf["index_weights"],
            index_cache=engine.index_cache,
            topk_indices=hf["topk"] if feed_hf_topk else None,
        )
        selection = None
        if not feed_hf_topk:
            selection = torch.full((len(positions), topk), -1, dtype=torch.int32)
            engine.backend.impl.index_topk(
                metadata, hf["index_q"], hf["index_weights"], engine.index_cache, out=selection
            )
        assert out.shape == hf["out"].shape
        steps.append(Step(picks, out, hf, positions, selection))
        for name, _, count in picks:
            done[name] += count
    assert done == LENGTHS
    return steps


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def attend(model: hf_v32.Model, step: Step, selection: torch.Tensor) -> torch.Tensor:
    """HF's attention (MHA form, ``hf_v32.attend_selected``) at the step's rows over ``selection``."""
    parts, row = [], 0
    for name, _, count in step.picks:
        rows = slice(row, row + count)
        parts.append(
            hf_v32.attend_selected(model.attn, model.rows[name], selection[rows], step.positions[rows])
        )
        row += count
    return torch.cat(parts)


def test_scales_match_hf(model: hf_v32.Model) -> None:
    config = model.config
    scale = mla.deepseek_softmax_scale(
        config.qk_nope_head_dim + config.qk_rope_head_dim, hf_v32.rope_parameters(config)
    )
    assert scale == pytest.approx(model.attn.scaling, rel=1e-12)
    indexer = mla.IndexerSpec(num_heads=config.index_n_heads, head_dim=config.index_head_dim)
    assert indexer.scale == pytest.approx(model.attn.indexer.softmax_scale, rel=1e-12)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_layer_fed_hf_topk_matches_hf(model: hf_v32.Model, cache: str) -> None:
    engine = Engine(model, cache_dtype=CACHES[cache], key_dtype=torch.float32)
    errors = [relative_error(s.out, s.hf["out"]) for s in serve(model, engine, feed_hf_topk=True)]
    assert len(errors) == len(STEPS)
    assert max(errors) <= TOLERANCE[cache], errors


@pytest.mark.parametrize(
    ("keys", "cache"),
    [("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "fp8_ds_mla")],
    ids=["fp32", "bf16", "fp8-keys-ds-mla"],  # the last is DeepSeek-V3.2's serving format
)
def test_indexer_selects_hf_topk(model: hf_v32.Model, keys: str, cache: str) -> None:
    engine = Engine(model, cache_dtype=CACHES[cache], key_dtype=KEY_DTYPES[keys])
    topk = model.config.index_topk
    kept = total = 0
    errors, hf_errors = [], []
    for step in serve(model, engine, feed_hf_topk=False):
        assert step.selection is not None
        positions = step.positions.tolist()
        # The contract: min(index_topk, p + 1) distinct visible positions, then -1.
        for picks, p in zip(step.selection.tolist(), positions, strict=True):
            count = min(topk, p + 1)
            assert len(set(picks[:count])) == count, (p, picks)
            assert all(0 <= i <= p for i in picks[:count]), (p, picks)
            assert picks[count:] == [-1] * (topk - count), (p, picks)
        ours = hf_v32.visible_sets(step.selection, positions)
        theirs = hf_v32.visible_sets(step.hf["topk"], positions)
        if keys == "fp32":
            assert ours == theirs, step.picks
        kept += sum(len(a & b) for a, b in zip(ours, theirs, strict=True))
        total += sum(len(b) for b in theirs)
        errors.append(relative_error(step.out, attend(model, step, step.selection)))
        hf_errors.append(relative_error(step.out, step.hf["out"]))
    assert kept / total >= MIN_OVERLAP, (kept, total)
    assert max(errors) <= TOLERANCE[cache], errors
    if keys == "fp32":
        assert max(hf_errors) <= TOLERANCE[cache], hf_errors


@pytest.mark.parametrize("keys", sorted(KEY_DTYPES))
def test_indexer_alone_one_prefill(model: hf_v32.Model, keys: str) -> None:
    """Index keys written with ``impl.write_index_keys`` (no attention), then one prefill step of
    every whole sequence: ``impl.index_topk`` selects HF's sets (all of them with float32 keys)."""
    engine = Engine(model, cache_dtype=torch.float32, key_dtype=KEY_DTYPES[keys])
    picks = [(name, 0, length) for name, length in LENGTHS.items()]
    slots = [s for n, start, count in picks for s in engine.slots(n, start, count)]
    metadata = engine.metadata(picks, 0)

    def rows(key: str) -> torch.Tensor:
        return torch.cat([model.rows[name][key] for name in LENGTHS])

    engine.backend.impl.write_index_keys(
        rows("index_k"), engine.index_cache, torch.tensor(slots, dtype=torch.int64)
    )
    selection = torch.full((sum(LENGTHS.values()), model.config.index_topk), -1, dtype=torch.int32)
    engine.backend.impl.index_topk(
        metadata, rows("index_q"), rows("index_weights"), engine.index_cache, out=selection
    )
    positions = [p for length in LENGTHS.values() for p in range(length)]
    ours = hf_v32.visible_sets(selection, positions)
    theirs = hf_v32.visible_sets(rows("topk"), positions)
    if keys == "fp32":
        assert ours == theirs
    kept = sum(len(a & b) for a, b in zip(ours, theirs, strict=True))
    assert kept / sum(len(b) for b in theirs) >= MIN_OVERLAP
