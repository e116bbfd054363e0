"""``mla demo --sparse``: the serving loop of :mod:`mla.tools.demo` for a DeepSeek Sparse
Attention model.

Every step writes the new tokens' latent rows and index keys, runs the backend's indexer over
all of the step's rows (``impl.index_topk``) and attends each decode, verify and prefill row over
only its selected tokens (``impl.forward_sparse_decode``/``forward_sparse_prefill``). Each step
is checked against :mod:`mla.tools.reference`: the selection against the float64 index scores
(every selected position outscores every visible position left out, so ties cannot fail it)
and the attention against the float64 sparse math over that selection.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from mla.core.config import DS_MLA_DTYPE, IndexerSpec, KVCacheSpec, MLADims
from mla.engine.backend import MLABackend, MLAMetadata, StepInputs
from mla.providers.formats import pack_ds_mla
from mla.tools.demo import ServingLoop
from mla.tools.demo_records import TOLERANCES, DemoConfig, DemoReport, ScheduledStep, StepRecord, _PhaseTally
from mla.tools.reference import reference_index_scores, reference_sparse

SELECTION_TOLERANCE = 1e-4
"""Largest accepted ``(best score left out - worst score selected) / max|score|`` of a row."""


class SparseServingLoop(ServingLoop):
    """The demo's serving loop for a sparse model (``DemoConfig.sparse``)."""

    def __init__(self, config: DemoConfig) -> None:
        self.indexer_spec = IndexerSpec(
            num_heads=config.index_heads, head_dim=config.index_head_dim, key_dtype=config.index_key_dtype
        )
        super().__init__(config)
        blocks, block_size = self.kv_cache.shape[:2]
        spec = self.indexer_spec
        self.index_cache = torch.zeros(
            blocks, block_size, spec.row_width, dtype=spec.storage_dtype, device=self.device
        )
        self.indexer_tally = _PhaseTally("indexer", SELECTION_TOLERANCE)
        self.topk: torch.Tensor | None = None
        """The current step's selection ``[rows, index_topk]``."""
        self.inputs: StepInputs | None = None
        """The current step's inputs."""

    # -- what the loop serves ----------------------------------------------------------------

    @staticmethod
    def _kv_dtype(config: DemoConfig, fp8_dtype: torch.dtype) -> torch.dtype:
        if config.kv_dtype == "fp8_ds_mla":
            return DS_MLA_DTYPE
        return ServingLoop._kv_dtype(config, fp8_dtype)

    @staticmethod
    def _dims(config: DemoConfig) -> MLADims:
        return attrs.evolve(ServingLoop._dims(config), index_topk=config.index_topk)

    def _backend(self, cache: KVCacheSpec, **options: Any) -> MLABackend:
        return super()._backend(cache, indexer=self.indexer_spec, **options)

    def _initial_cache(self, num_blocks: int) -> torch.Tensor:
        if self.kv_dtype != DS_MLA_DTYPE:
            return super()._initial_cache(num_blocks)
        rank, block_size = self.dims.kv_lora_rank, self.config.block_size
        rows = self._randn(num_blocks * block_size, self.dims.latent_dim, dtype=torch.float32)
        return pack_ds_mla(rows[:, :rank], rows[:, rank:]).view(num_blocks, block_size, -1)

    def _write(self, slots: list[int], rows: torch.Tensor) -> None:
        """The latent rows, then index keys for the same tokens."""
        super()._write(slots, rows)
        if not slots:
            return
        keys = self._randn(len(slots), self.indexer_spec.head_dim)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.backend.impl.write_index_keys(keys, self.index_cache, slot_mapping)

    # -- one step ----------------------------------------------------------------------------

    def _on_step(self, sched: ScheduledStep, inputs: StepInputs, latent: torch.Tensor) -> None:
        """Run and check the indexer over every row of the step."""
        metadata = self.backend.current_metadata
        assert metadata is not None
        self.inputs = inputs
        rows = inputs.num_decode_tokens + metadata.num_prefill_tokens
        spec, topk = self.indexer_spec, self.config.index_topk
        index_q = self._randn(rows, spec.num_heads, spec.head_dim)
        weights = self._randn(rows, spec.num_heads, dtype=torch.float32) * spec.num_heads**-0.5
        selected = torch.full((rows, topk), -1, dtype=torch.int32, device=self.device)
        self.backend.impl.index_topk(metadata, index_q, weights, self.index_cache, out=selected)
        self.topk = selected
        scores = reference_index_scores(
            index_q,
            weights,
            self.index_cache,
            inputs.block_table,
            inputs.seq_lens,
            inputs.query_start_loc,
            key_dtype=spec.key_dtype,
            softmax_scale=spec.scale,
        )
        gap = selection_gap(scores, selected.cpu(), topk)
        self.indexer_tally.add("lightning-indexer", rows, gap, 0.0)

    def _run_decode(self, index: int, metadata: MLAMetadata, inputs: StepInputs) -> tuple[str, bool]:
        nd, rows = inputs.num_decodes, inputs.num_decode_tokens
        qsl, seq, table = inputs.query_start_loc[: nd + 1], inputs.seq_lens[:nd], inputs.block_table[:nd]
        assert self.topk is not None
        assert metadata.sparse_decode is not None
        name = metadata.sparse_decode.strategy
        selected = self.topk[:rows]
        return name, self._attend(index, self.decode_tally, name, rows, (qsl, seq, table), selected, False)

    def _run_prefill(
        self, index: int, metadata: MLAMetadata, sched: ScheduledStep, new_rows: torch.Tensor
    ) -> tuple[str, bool]:
        nd = metadata.num_decodes
        step = self.inputs
        assert step is not None
        assert self.topk is not None
        assert metadata.sparse_prefill is not None
        qsl = step.query_start_loc[nd:] - step.query_start_loc[nd]
        requests = (qsl, step.seq_lens[nd:], step.block_table[nd:])
        name = metadata.sparse_prefill.strategy
        start = metadata.num_decode_tokens
        rows = new_rows.shape[0]
        selected = self.topk[start : start + rows]
        return name, self._attend(index, self.prefill_tally, name, rows, requests, selected, True)

    def _attend(
        self,
        index: int,
        tally: _PhaseTally,
        name: str,
        rows: int,
        requests: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        selected: torch.Tensor,
        prefill: bool,
    ) -> bool:
        dims = self.dims
        q = self._randn(rows, dims.num_heads, dims.latent_dim)
        out = torch.full(
            (rows, dims.num_heads, dims.kv_lora_rank), math.nan, dtype=self.model_dtype, device=self.device
        )
        lse = torch.full((rows, dims.num_heads), math.nan, dtype=torch.float32, device=self.device)
        impl = self.backend.impl
        run = impl.forward_sparse_prefill if prefill else impl.forward_sparse_decode
        metadata = self.backend.current_metadata
        assert metadata is not None
        run(metadata, q, self.kv_cache, selected, out=out, lse=lse, kv_scale=self.kv_scale)
        qsl, seq, table = requests
        ref = reference_sparse(
            q,
            self.kv_cache,
            table,
            seq,
            qsl,
            selected,
            softmax_scale=dims.scale,
            kv_lora_rank=dims.kv_lora_rank,
            kv_scale=self.kv_scale,
        )
        return self._record(tally, index, name, rows, (out, lse), ref)

    def report(self, steps: int, wall: float) -> DemoReport:
        report = super().report(steps, wall)
        return attrs.evolve(report, extra=(*report.extra, self.indexer_tally.stats()))


def selection_gap(scores: list[torch.Tensor], selected: torch.Tensor, topk: int) -> float:
    """How far a selection is from a top-k: the largest ``(best visible score left out - worst
    score selected) / max|score|`` over rows (0 when every row kept its ``min(topk, visible)``
    best positions; ties may go either way), ``inf`` when a row selected a position it cannot
    see, repeated one, or kept fewer than it should."""
    worst = 0.0
    row = 0
    for score in scores:
        for m in range(score.shape[0]):
            chosen = [int(p) for p in selected[row + m] if int(p) >= 0]
            visible = torch.isfinite(score[m])
            count = int(visible.sum())
            if (
                len(chosen) != min(topk, count)
                or len(set(chosen)) != len(chosen)
                or any(p >= score.shape[1] or not bool(visible[p]) for p in chosen)
            ):
                return math.inf
            if not chosen or len(chosen) == count:
                continue
            kept = torch.zeros(score.shape[1], dtype=torch.bool)
            kept[chosen] = True
            left_out = score[m][visible & ~kept]
            scale = max(float(score[m][visible].abs().max()), 1e-30)
            worst = max(worst, (float(left_out.max()) - float(score[m][chosen].min())) / scale)
        row += score.shape[0]
    return max(worst, 0.0)


def run_sparse_demo(config: DemoConfig, progress: Callable[[StepRecord], None] | None = None) -> DemoReport:
    """:func:`mla.tools.demo.run_demo` for a sparse model (``config.sparse``)."""
    start = time.perf_counter()
    loop = SparseServingLoop(config)
    for index in range(config.steps):
        record = loop.step(index)
        if progress is not None:
            progress(record)
    return loop.report(config.steps, time.perf_counter() - start)


__all__ = ["TOLERANCES", "SparseServingLoop", "run_sparse_demo", "selection_gap"]
