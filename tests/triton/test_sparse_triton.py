"""The Triton provider's sparse kernels (DeepSeek Sparse Attention) against the float64 references.

Interpreter tests (``interpret``; on a GPU the same tests run compiled): sparse attention over
float, per-tensor fp8 and ``fp8_ds_mla`` caches with NaN-poisoned outputs and NaN in every cache
row no slot selects, ``-1`` padding between and after the selected slots, empty rows, graph
padding rows, split slot lists and several head blocks, ``lse=None``, per-row ``lengths`` that
cut rows short (the rows past the cut are NaN); the indexer's scores and top-k over float and
fp8 index keys; index-key and ``fp8_ds_mla`` writes byte for byte against
:mod:`mla.providers.formats`; the fused slot conversion (and its ``lengths``) against the torch
default. Tiny dims (latent 128 or 256, rope 64, index head dim 32) and fp16/fp32 queries (the
interpreter computes ``tl.dot`` on bf16 wrongly).

GPU tests (``gpu``; skipped without CUDA): DeepSeek dims (512 + 64, top-k 2048, index heads
64 × 128) with bf16, fp8 and ``fp8_ds_mla`` caches, 8 to 128 heads, qlen 1 to 4, on the
``triton`` and ``gluon`` providers, the Triton kernel with ``lengths`` that cut rows short, and a
CUDA-graph replay (with and without ``lengths``) after the slots change in place.
Run: ``pytest -m gpu tests/triton/test_sparse_triton.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")

from mla.core.capabilities import Contract
from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
from mla.core.errors import InvalidInputError
from mla.core.platform import simulated_platform
from mla.providers import get_provider
from mla.providers.base import KernelProvider
from mla.providers.calls import (
    IndexTopkCall,
    SparseAttentionCall,
    SparseSlotsCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.providers.formats import E4M3, pack_ds_mla, quantize_index_queries
from mla.providers.formats import write_index_keys as torch_write_index_keys
from mla.providers.gluon.provider import GluonProvider
from mla.providers.sparse_slots import sparse_slots as torch_sparse_slots
from mla.providers.triton import TritonProvider
from mla.providers.triton.decode import num_sms
from mla.providers.triton.indexer import IndexScoresConfig, index_scores, position_chunk, score_chunk
from mla.providers.triton.sparse import (
    SparseLaunchConfig,
    sparse_attention,
    sparse_launch_config,
    sparse_slots,
    write_index_keys,
    write_kv_ds_mla,
)
from mla.testing import assert_matches_reference
from mla.testing.inputs import indptr
from mla.tools.reference import reference_index_scores, reference_sparse, reference_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON = TritonProvider()
FP8 = torch.float8_e4m3fn
FORMATS = {
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8": FP8,
    "ds_mla": DS_MLA_DTYPE,
}


# -- inputs ---------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class SparseBatch:
    """A paged batch with each row's request-local top-k positions and their cache slots."""

    q: torch.Tensor
    cache: torch.Tensor
    """``[blocks, block_size, W]`` in the case's format (NaN in every row no slot selects)."""
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    indices: torch.Tensor
    """int32 ``[T, topk]`` request-local positions, ``-1`` pads (interleaved), one out of the
    causal window, and junk in the graph-padding rows."""
    row_request: torch.Tensor
    row_keys: torch.Tensor
    slots: torch.Tensor
    """int32 ``[T, topk]`` flat cache rows (the torch default's conversion of ``indices``)."""
    kv_scale: float | None
    rank: int
    rope: int
    lengths: torch.Tensor | None = None
    """int32 ``[T]`` passed as :attr:`SparseAttentionCall.lengths` (the reference drops the
    columns at or past each, and the cache rows only they select are NaN), or ``None``."""

    @property
    def flat_cache(self) -> torch.Tensor:
        return self.cache.view(-1, self.cache.shape[-1])

    def reference(self, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.indices if self.lengths is None else cut_at_lengths(self.indices, self.lengths)
        return reference_sparse(
            self.q, self.cache, self.block_table, self.seq_lens, self.query_start_loc, indices,
            softmax_scale=softmax_scale, kv_lora_rank=self.rank, kv_scale=self.kv_scale,
        )  # fmt: skip

    def run(
        self,
        attend: Callable[..., None],
        *,
        softmax_scale: float,
        with_lse: bool = True,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attend(SparseAttentionCall)`` (a provider method or a launcher) into NaN outputs."""
        rows, heads = self.q.shape[:2]
        out = torch.full((rows, heads, self.rank), math.nan, dtype=self.q.dtype, device=self.q.device)
        lse = (
            torch.full((rows, heads), math.nan, dtype=torch.float32, device=self.q.device)
            if with_lse
            else None
        )
        scale = None if self.kv_scale is None else torch.tensor([self.kv_scale], device=self.q.device)
        call = SparseAttentionCall(
            q=self.q, kv_cache=self.flat_cache, slots=self.slots, out=out, lse=lse, kv_lora_rank=self.rank,
            rope_dim=self.rope, softmax_scale=softmax_scale, kv_scale=scale, lengths=self.lengths,
        )  # fmt: skip
        attend(call, **kwargs)
        return out, lse


def cut_at_lengths(table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``table [T, K]`` with every column at or past ``clamp(lengths[t], 0, K)`` set to ``-1``."""
    columns = torch.arange(table.shape[1], device=table.device)[None, :]
    return torch.where(columns < lengths.to(torch.int64)[:, None], table, -1)


def _paged_table(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    needed = [max(1, -(-s // block_size)) for s in seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max(needed) + 1), generator=gen, dtype=torch.int64)
    cursor = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[cursor : cursor + n]
        cursor += n
    return table.to(torch.int32), num_blocks


def _row_windows(qlens: list[int], seq_lens: list[int], pad_rows: int) -> tuple[list[int], list[int]]:
    """Each row's request and visible key count (right-aligned causal); padding rows see none."""
    requests, keys = [], []
    for b, (qlen, s) in enumerate(zip(qlens, seq_lens, strict=True)):
        for i in range(qlen):
            requests.append(b)
            keys.append(max(0, s - qlen + i + 1))
    return requests + [0] * pad_rows, keys + [0] * pad_rows


def _topk_rows(keys: list[int], topk: int, gen: torch.Generator) -> torch.Tensor:
    """Random distinct visible positions per row at random columns, ``-1`` elsewhere; a row
    with room also gets one position outside its window, padding rows get junk."""
    rows = torch.full((len(keys), topk), -1, dtype=torch.int32)
    for t, visible in enumerate(keys):
        count = min(topk, visible)
        columns = torch.randperm(topk, generator=gen)
        rows[t, columns[:count]] = torch.randperm(max(visible, 1), generator=gen)[:count].to(torch.int32)
        if count < topk:
            rows[t, columns[count]] = visible + 3  # past the causal window: invalid, ignored
    return rows


def make_sparse_batch(
    *,
    qlens: list[int],
    seq_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    topk: int,
    block_size: int,
    q_dtype: torch.dtype,
    kv_format: str,
    pad_rows: int = 1,
    seed: int = 0,
    poison: bool = True,
    lengths: list[int] | None = None,
    device: torch.device = DEVICE,
) -> SparseBatch:
    """``lengths``: each row's :attr:`SparseAttentionCall.lengths` (the rows only the columns at
    or past it select are poisoned too)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = _paged_table(seq_lens, block_size, gen)
    requests, keys = _row_windows(qlens, seq_lens, pad_rows)
    indices = _topk_rows(keys, topk, gen)
    rows = len(keys)
    q = torch.randn(rows, heads, rank + rope, generator=gen).to(q_dtype)
    row_request = torch.tensor(requests, dtype=torch.int32)
    row_keys = torch.tensor(keys, dtype=torch.int32)
    slots = torch.empty_like(indices)
    torch_sparse_slots(
        SparseSlotsCall(
            indices=indices, block_table=table, row_request=row_request, row_keys=row_keys,
            block_size=block_size, num_blocks=num_blocks, slots=slots,
            invalid_count=torch.zeros(1, dtype=torch.int32),
        )
    )  # fmt: skip
    values = torch.randn(num_blocks * block_size, rank + rope, generator=gen)
    selected = torch.ones(num_blocks * block_size, dtype=torch.bool)
    length_tensor = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    if poison:
        kept = slots if length_tensor is None else cut_at_lengths(slots, length_tensor)
        selected.zero_()
        selected[kept[kept >= 0].long()] = True
    kv_dtype = FORMATS[kv_format]
    kv_scale = None
    if kv_dtype == DS_MLA_DTYPE:
        flat = pack_ds_mla(values[:, :rank], values[:, rank:])
        flat[~selected] = 0xFF  # NaN e4m3 values, NaN scales, NaN bf16 rope
    elif kv_dtype == FP8:
        kv_scale = 0.5
        flat = (values * 2).to(FP8)
        flat.view(torch.uint8)[~selected] = 0x7F  # NaN in e4m3fn
    else:
        flat = values.to(kv_dtype)
        flat[~selected] = math.nan
    return SparseBatch(
        q=q.to(device),
        cache=flat.view(num_blocks, block_size, -1).to(device),
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=indptr(qlens).to(device),
        indices=indices.to(device),
        row_request=row_request.to(device),
        row_keys=row_keys.to(device),
        slots=slots.to(device),
        kv_scale=kv_scale,
        rank=rank,
        rope=rope,
        lengths=None if length_tensor is None else length_tensor.to(device),
    )


# -- sparse attention (interpreter) ---------------------------------------------------------------

QLENS, SEQ_LENS = [1, 3, 2, 1], [30, 19, 2, 0]
"""Rows: 24 of 30 visible (full top-k), 17-19 (padded), 1-2, an empty request; plus padding."""

SPLIT2 = SparseLaunchConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=2)
SPLIT3 = attrs.evolve(SPLIT2, num_splits=3)
"""16-slot tiles, 16-head blocks (20 and 17 heads run as two), slot lists cut in 2 or 3."""

SMALL_CASES = [
    # q dtype, format, heads, rank, config (None: the heuristic), lse
    (torch.float16, "fp16", 5, 128, None, True),
    (torch.float32, "fp32", 20, 128, SPLIT3, False),
    (torch.float16, "fp8", 3, 128, SPLIT2, True),
    (torch.float16, "ds_mla", 4, 256, None, True),
    (torch.float32, "ds_mla", 17, 256, SPLIT2, True),
    (torch.bfloat16, "ds_mla", 6, 512, SPLIT2, False),  # four 128-wide tiles
]


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("q_dtype", "kv_format", "heads", "rank", "config", "with_lse"),
    SMALL_CASES,
    ids=[
        f"{c[1]}-q{str(c[0])[-2:]}-h{c[2]}-{'split' if c[4] else 'auto'}{'-lse' * c[5]}" for c in SMALL_CASES
    ],
)
def test_sparse_attention_matches_reference(
    q_dtype: torch.dtype,
    kv_format: str,
    heads: int,
    rank: int,
    config: SparseLaunchConfig | None,
    with_lse: bool,
) -> None:
    batch = make_sparse_batch(
        qlens=QLENS, seq_lens=SEQ_LENS, heads=heads, rank=rank, rope=64, topk=24, block_size=4,
        q_dtype=q_dtype, kv_format=kv_format, seed=heads,
    )  # fmt: skip
    ref_out, ref_lse = batch.reference(0.09)
    out, lse = batch.run(sparse_attention, softmax_scale=0.09, with_lse=with_lse, config=config)
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"{kv_format} {heads} heads")
    assert bool((out[-2:] == 0).all()), "rows with no slot must be written as zeros"
    if lse is not None:
        assert bool(torch.isneginf(lse[-2:]).all())


@pytest.mark.interpret
def test_sparse_attention_all_padding_and_bad_slots_read_nothing() -> None:
    """Slots of -1 everywhere, or past the cache, never read memory: zeros and -inf."""
    batch = make_sparse_batch(
        qlens=[2], seq_lens=[9], heads=2, rank=128, rope=64, topk=16, block_size=4,
        q_dtype=torch.float16, kv_format="fp16",
    )  # fmt: skip
    bad = torch.full_like(batch.slots, -1)
    bad[0, 3] = batch.flat_cache.shape[0]  # one past the cache
    bad[1, 0] = -7
    batch = attrs.evolve(batch, slots=bad)
    out, lse = batch.run(TRITON.sparse_attention, softmax_scale=0.1)
    assert lse is not None
    assert bool((out == 0).all())
    assert bool(torch.isneginf(lse).all())


LENGTHS = [29, 7, 0, -3, 13, 1, 24, 3]
"""Per row of :data:`QLENS` / :data:`SEQ_LENS` (8 rows with the padding row): past ``K`` (24,
clamped), cuts through selected slots, 0, negative (clamped to 0), ``K``."""
LENGTH_CASES = [
    # q dtype, format, heads, rank, config (None: the heuristic)
    (torch.float16, "fp16", 5, 128, None),
    (torch.float32, "fp32", 20, 128, SPLIT3),  # the second split of a row cut at 7 is empty
    (torch.float16, "fp8", 3, 128, SPLIT2),
    (torch.float32, "ds_mla", 17, 256, SPLIT2),
]


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("q_dtype", "kv_format", "heads", "rank", "config"),
    LENGTH_CASES,
    ids=[f"{c[1]}-q{str(c[0])[-2:]}-h{c[2]}-{'split' if c[4] else 'auto'}" for c in LENGTH_CASES],
)
def test_sparse_attention_with_lengths_matches_reference(
    q_dtype: torch.dtype, kv_format: str, heads: int, rank: int, config: SparseLaunchConfig | None
) -> None:
    """Row ``t`` attends only ``slots[t, :lengths[t]]``: the rows the columns past it select are
    NaN, the reference drops those columns."""
    batch = make_sparse_batch(
        qlens=QLENS, seq_lens=SEQ_LENS, heads=heads, rank=rank, rope=64, topk=24, block_size=4,
        q_dtype=q_dtype, kv_format=kv_format, seed=heads, lengths=LENGTHS,
    )  # fmt: skip
    assert batch.lengths is not None
    cut = cut_at_lengths(batch.slots, batch.lengths)
    assert int((cut >= 0).sum()) < int((batch.slots >= 0).sum()), "the lengths must cut selected slots"
    ref_out, ref_lse = batch.reference(0.09)
    out, lse = batch.run(sparse_attention, softmax_scale=0.09, config=config)
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"{kv_format} {heads} heads, lengths")
    assert lse is not None
    for row in (2, 3):  # length 0 and negative: nothing attended
        assert bool((out[row] == 0).all())
        assert bool(torch.isneginf(lse[row]).all())


@pytest.mark.interpret
@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(6, dtype=torch.int32)[::2],
    ],
    ids=["int64", "too-few-rows", "strided"],
)
def test_sparse_kernels_reject_bad_lengths(bad: torch.Tensor) -> None:
    batch = make_sparse_batch(
        qlens=[3], seq_lens=[9], heads=2, rank=128, rope=64, topk=8, block_size=4,
        q_dtype=torch.float16, kv_format="fp16", pad_rows=0,
    )  # fmt: skip
    message = r"^lengths: expected int32 \[3\] with stride 1"
    with pytest.raises(InvalidInputError, match=message):
        attrs.evolve(batch, lengths=bad.to(DEVICE)).run(sparse_attention, softmax_scale=0.1)
    slots_call = SparseSlotsCall(
        indices=batch.indices, block_table=batch.block_table, row_request=batch.row_request,
        row_keys=batch.row_keys, block_size=4, num_blocks=batch.cache.shape[0], slots=batch.slots.clone(),
        invalid_count=torch.zeros(1, dtype=torch.int32, device=DEVICE), lengths=bad.to(DEVICE),
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match=message):
        sparse_slots(slots_call)


def test_launch_config_heads_and_splits() -> None:
    one = sparse_launch_config(rows=1, heads=16, topk=2048, kv_elem_size=2, num_sms=132)
    assert (one.block_h, one.block_n, one.num_warps) == (16, 64, 4)
    assert one.num_splits == 16  # 2048 slots / 128 per split, well under the 132 SMs
    wide = sparse_launch_config(rows=4, heads=128, topk=2048, kv_elem_size=1, num_sms=132)
    assert (wide.block_h, wide.block_n, wide.num_stages) == (64, 64, 3)  # 1-byte rows, 3 deep
    assert wide.num_splits == 16  # 8 programs: 2 * 132 // 8, at most 2048 / 128
    decode = sparse_launch_config(rows=64, heads=16, topk=2048, kv_elem_size=2, num_sms=132)
    assert decode.num_splits == 4  # 64 programs: two per SM
    small = sparse_launch_config(rows=256, heads=16, topk=2048, kv_elem_size=1, num_sms=132)
    assert (small.block_n, small.num_stages, small.num_splits) == (32, 2, 1)
    busy = sparse_launch_config(rows=4096, heads=8, topk=2048, kv_elem_size=2, num_sms=132)
    assert busy.block_h == 16
    assert busy.num_splits == 1
    fp32 = sparse_launch_config(rows=4, heads=64, topk=2048, kv_elem_size=4, num_sms=132, q_elem_size=4)
    assert (fp32.block_n, fp32.num_stages) == (32, 1)  # a 64-slot fp32 tile does not fit twice


# -- indexer (interpreter) ------------------------------------------------------------------------


@attrs.frozen(eq=False)
class IndexBatch:
    q: torch.Tensor
    weights: torch.Tensor
    cache: torch.Tensor
    key_dtype: torch.dtype
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    row_request: torch.Tensor
    row_keys: torch.Tensor

    def call(self, *, topk: int, max_keys: int, scale: float, indices: torch.Tensor) -> IndexTopkCall:
        return IndexTopkCall(
            q=self.q, weights=self.weights, index_cache=self.cache, key_dtype=self.key_dtype,
            block_table=self.block_table, row_request=self.row_request, row_keys=self.row_keys,
            max_keys=max_keys, softmax_scale=scale, topk=topk, indices=indices,
        )  # fmt: skip

    def reference_scores(self, scale: float) -> list[torch.Tensor]:
        return reference_index_scores(
            self.q, self.weights, self.cache, self.block_table, self.seq_lens, self.query_start_loc,
            key_dtype=self.key_dtype, softmax_scale=scale,
        )  # fmt: skip


def make_index_batch(
    *,
    qlens: list[int],
    seq_lens: list[int],
    index_heads: int,
    head_dim: int,
    block_size: int,
    q_dtype: torch.dtype,
    key_dtype: torch.dtype,
    pad_rows: int = 1,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> IndexBatch:
    """Keys written through the torch format functions (every slot of the cache)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = _paged_table(seq_lens, block_size, gen)
    requests, keys = _row_windows(qlens, seq_lens, pad_rows)
    rows = len(keys)
    if key_dtype == E4M3:
        cache = torch.zeros(num_blocks, block_size, head_dim + 4, dtype=torch.uint8)
    else:
        cache = torch.zeros(num_blocks, block_size, head_dim, dtype=key_dtype)
    all_keys = torch.randn(num_blocks * block_size, head_dim, generator=gen)
    torch_write_index_keys(all_keys, cache, key_dtype, torch.arange(num_blocks * block_size))
    return IndexBatch(
        q=torch.randn(rows, index_heads, head_dim, generator=gen).to(q_dtype).to(device),
        weights=(torch.randn(rows, index_heads, generator=gen) * index_heads**-0.5).to(device),
        cache=cache.to(device),
        key_dtype=key_dtype,
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=indptr(qlens).to(device),
        row_request=torch.tensor(requests, dtype=torch.int32).to(device),
        row_keys=torch.tensor(keys, dtype=torch.int32).to(device),
    )


def assert_topk_matches(
    got: torch.Tensor, batch: IndexBatch, scale: float, topk: int, *, atol: float
) -> None:
    """Per row: exactly ``min(topk, row_keys)`` distinct visible positions, then ``-1``, whose
    reference scores are the reference's top scores (the selection is in no score order)."""
    scores = batch.reference_scores(scale)
    want = reference_topk(scores, topk)
    flat_scores = [row for score in scores for row in score]
    got = got.cpu().to(torch.int64)
    keys = batch.row_keys.cpu().tolist()
    for t, visible in enumerate(keys):
        count = min(topk, visible)
        assert bool((got[t, count:] == -1).all()), f"row {t}: -1 padding after {count} positions"
        chosen = got[t, :count]
        assert bool(((chosen >= 0) & (chosen < visible)).all()), f"row {t}: {chosen.tolist()}"
        assert chosen.unique().numel() == count, f"row {t}: repeated positions"
        if count:
            row = flat_scores[t]
            got_scores = row[chosen].sort(descending=True).values
            torch.testing.assert_close(got_scores, row[want[t, :count]], atol=atol, rtol=1e-3)


INDEX_CASES = [
    (torch.float16, torch.float16, 16),
    (torch.float32, torch.bfloat16, 16),
    (torch.float16, E4M3, 16),
    (torch.float32, E4M3, 48),  # top-k past max_keys: the last columns are -1
    (E4M3, E4M3, 16),  # fp8 queries: fp8 dots
]


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("q_dtype", "key_dtype", "topk"),
    INDEX_CASES,
    ids=[f"q{str(c[0])[-2:]}-{str(c[1]).removeprefix('torch.')}-k{c[2]}" for c in INDEX_CASES],
)
def test_index_topk_matches_reference(q_dtype: torch.dtype, key_dtype: torch.dtype, topk: int) -> None:
    batch = make_index_batch(
        qlens=QLENS, seq_lens=SEQ_LENS, index_heads=4, head_dim=32, block_size=4,
        q_dtype=torch.float16 if q_dtype == E4M3 else q_dtype, key_dtype=key_dtype,
    )  # fmt: skip
    if q_dtype == E4M3:
        q, weights = quantize_index_queries(batch.q, batch.weights)
        batch = attrs.evolve(batch, q=q, weights=weights)
    indices = torch.full((batch.q.shape[0], topk), 12345, dtype=torch.int32, device=DEVICE)
    TRITON.index_topk(batch.call(topk=topk, max_keys=37, scale=0.2, indices=indices))
    assert_topk_matches(indices, batch, 0.2, topk, atol=1e-5 if q_dtype == torch.float32 else 2e-3)


SCORE_CASES = [
    (4, None, E4M3, torch.float16, IndexScoresConfig(), "h4-whole-fp8"),
    (4, 128, torch.float16, torch.float16, IndexScoresConfig(), "h4-chunks-f16"),
    (130, 128, E4M3, torch.float16, IndexScoresConfig(), "h130-two-head-blocks-fp8"),
    # Two rows a program: rows 0-1 share a request, rows 2 and 3 do not (two passes), row 4
    # (graph padding) has no partner.
    (4, None, E4M3, torch.float16, IndexScoresConfig(rows=2), "h4-two-rows-fp8"),
    # 16-position tiles inside the 16-token blocks: one block id per tile.
    (4, 128, torch.float16, torch.float16, IndexScoresConfig(rows=2, block_p=16), "h4-block-tiles-f16"),
    # fp8 queries (quantized per (row, head), the scale in the weights): fp8 dots.
    (4, None, E4M3, E4M3, IndexScoresConfig(block_p=16), "h4-fp8-queries-block-tiles"),
    (4, 128, E4M3, E4M3, IndexScoresConfig(rows=4), "h4-fp8-queries-four-rows"),
]


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("index_heads", "chunk", "key_dtype", "q_dtype", "config"),
    [c[:5] for c in SCORE_CASES],
    ids=[c[5] for c in SCORE_CASES],
)
def test_index_scores_match_reference(
    index_heads: int,
    chunk: int | None,
    key_dtype: torch.dtype,
    q_dtype: torch.dtype,
    config: IndexScoresConfig,
) -> None:
    """Every score of the workspace: visible positions against the float64 reference, ``-inf``
    past each row's window and past its last tile (positions split into chunks or not, one or
    several head blocks per tile, one or several rows per program, tiles inside one cache block
    or across blocks, 16-bit or fp8 queries); each (row, chunk)'s least and greatest finite
    score."""
    batch = make_index_batch(
        qlens=[2, 1, 1], seq_lens=[300, 150, 0], index_heads=index_heads, head_dim=16, block_size=16,
        q_dtype=torch.float16, key_dtype=key_dtype,
    )  # fmt: skip
    if q_dtype == E4M3:
        q, weights = quantize_index_queries(batch.q, batch.weights)
        batch = attrs.evolve(batch, q=q, weights=weights)
    max_keys = 400
    rows = batch.q.shape[0]
    scores = torch.full((rows, max_keys), float("nan"), device=DEVICE)
    indices = torch.empty(rows, 8, dtype=torch.int32, device=DEVICE)
    call = batch.call(topk=8, max_keys=max_keys, scale=0.3, indices=indices)
    config = attrs.evolve(config, chunk=chunk)
    step = score_chunk(call, config, num_sms(DEVICE))
    chunks = -(-max_keys // step)
    stats = torch.full((2, rows, chunks), float("nan"), device=DEVICE)
    index_scores(call, scores, stats=stats, config=config)
    want = torch.full((rows, max_keys), float("-inf"), dtype=torch.float64)
    for t, row in enumerate(row for score in batch.reference_scores(0.3) for row in score):
        want[t, : row.numel()] = row
    torch.testing.assert_close(scores.cpu().to(torch.float64), want, atol=2e-3, rtol=2e-3)
    got = scores.cpu()
    for c in range(chunks):
        part = got[:, c * step : (c + 1) * step]
        finite = torch.isfinite(part)
        low = torch.where(finite, part, float("inf")).min(dim=1).values
        high = torch.where(finite, part, float("-inf")).max(dim=1).values
        assert torch.equal(stats[0, :, c].cpu(), low), c
        assert torch.equal(stats[1, :, c].cpu(), high), c


def test_index_scores_rejects_a_chunk_off_the_tile() -> None:
    batch = make_index_batch(
        qlens=[1], seq_lens=[10], index_heads=4, head_dim=16, block_size=4, q_dtype=torch.float16,
        key_dtype=torch.float16,
    )  # fmt: skip
    call = batch.call(topk=4, max_keys=10, scale=0.3, indices=torch.empty(2, 4, dtype=torch.int32))
    with pytest.raises(InvalidInputError, match="chunk"):
        index_scores(call, torch.empty(2, 10), chunk=100)


def test_position_chunk_fills_the_device_only_when_rows_do_not() -> None:
    assert position_chunk(rows=8192, max_keys=8192, num_sms=132) == 8192  # one program per row
    # 64 decode rows: 8 chunks fill the 4 x 132 program slots without a partial wave (9 would not)
    assert position_chunk(rows=64, max_keys=32768, num_sms=132) == 4096
    assert position_chunk(rows=1, max_keys=50, num_sms=132) == 64  # never below one tile
    assert position_chunk(rows=4, max_keys=4000, num_sms=132) >= 1024  # MIN_CHUNK positions


# -- writes and slots (interpreter) ----------------------------------------------------------------


def _write_slots(count: int, capacity: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(capacity, generator=gen)[:count].to(torch.int64)
    slots[1] = -1
    slots[3] = capacity  # past the cache
    slots[4] = capacity + 1000
    return slots


@pytest.mark.interpret
@pytest.mark.parametrize("key_dtype", [torch.float16, torch.bfloat16, E4M3], ids=str)
def test_write_index_keys_matches_formats(key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    blocks, block_size, head_dim = 3, 4, 32
    width = head_dim + 4 if key_dtype == E4M3 else head_dim
    storage = torch.uint8 if key_dtype == E4M3 else key_dtype
    cache = torch.randint(0, 255, (blocks, block_size, width), generator=gen, dtype=torch.uint8)
    if storage != torch.uint8:
        cache = torch.randn(blocks, block_size, width, generator=gen).to(storage)
    keys = torch.randn(9, head_dim, generator=gen) * torch.logspace(-3, 2, 9)[:, None]
    keys[0] = 0.0  # an all-zero key: the floor scale
    slots = _write_slots(9, blocks * block_size, gen)
    want = cache.clone()
    torch_write_index_keys(keys, want, key_dtype, slots)
    got = cache.to(DEVICE)
    call = WriteIndexKeysCall(
        keys=keys.to(DEVICE), index_cache=got, key_dtype=key_dtype, slot_mapping=slots.to(DEVICE)
    )
    write_index_keys(call)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.interpret
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_write_kv_ds_mla_matches_pack(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    blocks, block_size, rank, rope = 3, 4, 256, 64
    cache = torch.randint(
        0, 255, (blocks, block_size, ds_mla_row_bytes(rank, rope)), generator=gen, dtype=torch.uint8
    )
    kv_c = (torch.randn(8, rank, generator=gen) * torch.logspace(-4, 3, 8)[:, None]).to(kv_dtype)
    kv_c[2, :128] = 0.0  # an all-zero tile
    k_pe = torch.randn(8, rope, generator=gen).to(kv_dtype)
    slots = _write_slots(8, blocks * block_size, gen)
    want = cache.clone().view(blocks * block_size, -1)
    keep = (slots >= 0) & (slots < blocks * block_size)
    want[slots[keep]] = pack_ds_mla(kv_c[keep], k_pe[keep])
    got = cache.to(DEVICE)
    call = WriteKVCall(
        kv_c=kv_c.to(DEVICE), k_pe=k_pe.to(DEVICE), kv_cache=got, slot_mapping=slots.to(DEVICE), kv_scale=None
    )
    TRITON.write_kv(call)  # dispatches on the uint8 cache
    assert torch.equal(got.cpu().view(blocks * block_size, -1), want)
    got.copy_(cache)
    write_kv_ds_mla(call)
    assert torch.equal(got.cpu().view(blocks * block_size, -1), want)


def _slots_record(topk: int) -> dict[str, Any]:
    """A slot conversion's inputs: a block id outside the cache and a ``-1`` one in the table, a
    request past the table, junk in padding rows, a negative position, an invalid entry at a
    row's tail and a valid entry in another's last column."""
    gen = torch.Generator().manual_seed(8)
    block_size = 4
    qlens, seq_lens = [1, 3, 2], [30, 19, 60]
    table, num_blocks = _paged_table(seq_lens, block_size, gen)
    table[2, 3] = num_blocks + 2  # a block id outside the cache
    table[2, 4] = -1
    requests, keys = _row_windows(qlens, seq_lens, 2)
    indices = _topk_rows(keys, topk, gen)
    indices[-1, :3] = torch.tensor([0, 5, -4], dtype=torch.int32)  # junk in a padding row
    indices[0, 0] = -9
    indices[1, -2:] = torch.tensor([-1, 10_000], dtype=torch.int32)  # an invalid tail
    indices[4, -1] = 0  # a valid last column
    requests[1] = 99  # a request past the block table: clamped to its last row, as torch does
    return {
        "indices": indices, "block_table": table, "row_request": torch.tensor(requests, dtype=torch.int32),
        "row_keys": torch.tensor(keys, dtype=torch.int32), "block_size": block_size, "num_blocks": num_blocks,
    }  # fmt: skip


@pytest.mark.interpret
@pytest.mark.parametrize("topk", [40, 2100], ids=["k40-one-chunk", "k2100-two-chunks"])
def test_sparse_slots_kernel_matches_torch_default(topk: int) -> None:
    record = _slots_record(topk)
    indices = record["indices"]
    want = torch.full_like(indices, 77)
    want_count = torch.tensor([3], dtype=torch.int32)
    torch_sparse_slots(SparseSlotsCall(**record, slots=want, invalid_count=want_count))
    on_device: dict[str, Any] = {
        k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in record.items()
    }
    got = torch.full_like(indices, 77).to(DEVICE)
    count = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    sparse_slots(SparseSlotsCall(**on_device, slots=got, invalid_count=count))
    assert torch.equal(got.cpu(), want)
    assert int(count) == int(want_count) > 3
    # In place: slots may be the indices tensor itself.
    in_place = on_device["indices"].clone()
    in_place_record = {**on_device, "indices": in_place}
    TRITON.sparse_slots(SparseSlotsCall(**in_place_record, slots=in_place, invalid_count=count))
    assert torch.equal(in_place.cpu(), want)


@pytest.mark.interpret
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("topk", [40, 2100], ids=["k40-one-chunk", "k2100-two-chunks"])
def test_sparse_slots_kernel_writes_the_torch_default_lengths(topk: int, in_place: bool) -> None:
    """One program per row over every chunk: the same slots and count as without lengths, and
    the torch default's lengths (0 for rows with nothing valid, ``K`` for a valid last column,
    an invalid tail not counted in)."""
    record = _slots_record(topk)
    indices = record["indices"]
    rows = indices.shape[0]
    want = torch.full_like(indices, 77)
    want_count = torch.tensor([3], dtype=torch.int32)
    want_lengths = torch.full((rows,), 77, dtype=torch.int32)
    torch_sparse_slots(SparseSlotsCall(**record, slots=want, invalid_count=want_count, lengths=want_lengths))
    valid_columns = [[j for j in range(topk) if want[t, j] >= 0] for t in range(rows)]
    assert want_lengths.tolist() == [max(c, default=-1) + 1 for c in valid_columns]
    assert {0, topk} <= set(want_lengths.tolist())
    assert 0 < int(want_lengths[1]) < topk - 1, "row 1 ends in an invalid entry after a -1"
    on_device: dict[str, Any] = {
        k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in record.items()
    }
    got = on_device["indices"].clone() if in_place else torch.full_like(indices, 77).to(DEVICE)
    if in_place:
        on_device["indices"] = got
    count = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    lengths = torch.full((rows,), 77, dtype=torch.int32, device=DEVICE)
    TRITON.sparse_slots(SparseSlotsCall(**on_device, slots=got, invalid_count=count, lengths=lengths))
    assert torch.equal(got.cpu(), want)
    assert int(count) == int(want_count)
    assert torch.equal(lengths.cpu(), want_lengths)


@pytest.mark.interpret
def test_sparse_slots_kernel_of_zero_columns_zeroes_lengths() -> None:
    lengths = torch.full((3,), 77, dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    empty = torch.empty(3, 0, dtype=torch.int32, device=DEVICE)
    sparse_slots(
        SparseSlotsCall(
            indices=empty, block_table=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
            row_request=torch.zeros(3, dtype=torch.int32, device=DEVICE),
            row_keys=torch.full((3,), 5, dtype=torch.int32, device=DEVICE), block_size=4, num_blocks=2,
            slots=empty, invalid_count=count, lengths=lengths,
        )
    )  # fmt: skip
    assert lengths.tolist() == [0, 0, 0]
    assert int(count) == 0


# -- the providers' records and delegation ---------------------------------------------------------


def test_triton_and_gluon_declare_the_sparse_contracts() -> None:
    for provider, arch in ((TRITON, "cpu"), (TRITON, "sm90"), (GluonProvider(), "sm90")):
        caps = provider.capabilities(simulated_platform(arch))
        assert {Contract.SPARSE_ATTENTION, Contract.INDEXER} <= caps.contracts
        assert {torch.bfloat16, FP8, DS_MLA_DTYPE} <= caps.sparse_kv_dtypes
        assert E4M3 in caps.index_key_dtypes
    sm80 = TRITON.capabilities(simulated_platform("sm80"))
    assert DS_MLA_DTYPE not in sm80.sparse_kv_dtypes  # no e4m3 conversion before sm89
    assert E4M3 not in sm80.index_key_dtypes


@pytest.mark.interpret
def test_gluon_delegates_sparse_to_the_triton_kernels() -> None:
    batch = make_sparse_batch(
        qlens=[2, 1], seq_lens=[11, 6], heads=3, rank=128, rope=64, topk=8, block_size=4,
        q_dtype=torch.float16, kv_format="fp16",
    )  # fmt: skip
    got = batch.run(GluonProvider().sparse_attention, softmax_scale=0.2)
    want = batch.run(TRITON.sparse_attention, softmax_scale=0.2)
    assert torch.equal(got[0], want[0])
    assert got[1] is not None
    assert want[1] is not None
    assert torch.equal(got[1], want[1])


# -- GPU: DeepSeek dims on each GPU provider ---------------------------------------------------------

GPU_PROVIDERS = ["triton", "gluon"]
GPU_CASES = [
    # heads, qlens, seq_lens
    (8, [1, 1, 1, 1], [3000, 700, 1, 0]),
    (16, [2, 2, 1], [4100, 2049, 40]),
    (64, [4, 1], [2600, 1200]),
    (128, [1, 3], [5000, 300]),
]


def _gpu_provider(name: str) -> KernelProvider:
    provider = get_provider(name)
    support = provider.availability()
    if not support:
        pytest.skip(f"provider {name!r} is unavailable here: {support}")
    return provider


@pytest.mark.gpu
@pytest.mark.parametrize("provider", GPU_PROVIDERS)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "ds_mla"])
@pytest.mark.parametrize(
    ("heads", "qlens", "seq_lens"), GPU_CASES, ids=[f"h{c[0]}-q{max(c[1])}" for c in GPU_CASES]
)
def test_gpu_sparse_attention(
    provider: str, kv_format: str, heads: int, qlens: list[int], seq_lens: list[int]
) -> None:
    prov = _gpu_provider(provider)
    batch = make_sparse_batch(
        qlens=qlens, seq_lens=seq_lens, heads=heads, rank=512, rope=64, topk=2048, block_size=64,
        q_dtype=torch.bfloat16, kv_format=kv_format, pad_rows=2, seed=heads,
    )  # fmt: skip
    ref_out, ref_lse = batch.reference(576**-0.5)
    for with_lse in (True, False):
        out, lse = batch.run(prov.sparse_attention, softmax_scale=576**-0.5, with_lse=with_lse)
        torch.cuda.synchronize()
        assert_matches_reference(out, lse, ref_out, ref_lse, context=f"{provider} {kv_format} h{heads}")


GPU_LENGTHS = [2148, 1000, 0, -5, 2048, 1, 64, 1500, 700]
"""Row ``t`` of a GPU case gets ``GPU_LENGTHS[t % 9]``: past ``K``, cuts, 0, negative, ``K``."""


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "ds_mla"])
@pytest.mark.parametrize(
    ("heads", "qlens", "seq_lens"), GPU_CASES, ids=[f"h{c[0]}-q{max(c[1])}" for c in GPU_CASES]
)
def test_gpu_triton_sparse_attention_with_lengths(
    kv_format: str, heads: int, qlens: list[int], seq_lens: list[int]
) -> None:
    """The compiled Triton kernel (split or not, as the heuristic picks) walks only each row's
    first ``lengths[t]`` slots; the rows only the columns past them select are NaN."""
    prov = _gpu_provider("triton")
    rows = sum(qlens) + 2
    batch = make_sparse_batch(
        qlens=qlens, seq_lens=seq_lens, heads=heads, rank=512, rope=64, topk=2048, block_size=64,
        q_dtype=torch.bfloat16, kv_format=kv_format, pad_rows=2, seed=heads,
        lengths=[GPU_LENGTHS[t % len(GPU_LENGTHS)] for t in range(rows)],
    )  # fmt: skip
    ref_out, ref_lse = batch.reference(576**-0.5)
    for with_lse in (True, False):
        out, lse = batch.run(prov.sparse_attention, softmax_scale=576**-0.5, with_lse=with_lse)
        torch.cuda.synchronize()
        assert_matches_reference(out, lse, ref_out, ref_lse, context=f"lengths {kv_format} h{heads}")


@pytest.mark.gpu
@pytest.mark.parametrize("provider", GPU_PROVIDERS)
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, E4M3], ids=["bf16", "fp8"])
def test_gpu_index_topk(provider: str, key_dtype: torch.dtype) -> None:
    prov = _gpu_provider(provider)
    batch = make_index_batch(
        qlens=[1, 4, 2], seq_lens=[5000, 2600, 900], index_heads=64, head_dim=128, block_size=64,
        q_dtype=torch.bfloat16, key_dtype=key_dtype, pad_rows=2,
    )  # fmt: skip
    indices = torch.full((batch.q.shape[0], 2048), 12345, dtype=torch.int32, device=DEVICE)
    prov.index_topk(batch.call(topk=2048, max_keys=8192, scale=128**-0.5, indices=indices))
    torch.cuda.synchronize()
    # Exact bf16 (or widened e4m3) operands, fp32 accumulation: near ties may still swap.
    assert_topk_matches(indices, batch, 128**-0.5, 2048, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", GPU_PROVIDERS)
def test_gpu_writes_match_formats(provider: str) -> None:
    prov = _gpu_provider(provider)
    gen = torch.Generator().manual_seed(11)
    blocks, block_size = 40, 64
    capacity = blocks * block_size
    slots = _write_slots(1000, capacity, gen).to(DEVICE)
    keys = (torch.randn(1000, 128, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    got = torch.zeros(blocks, block_size, 132, dtype=torch.uint8, device=DEVICE)
    want = got.clone()
    prov.write_index_keys(WriteIndexKeysCall(keys=keys, index_cache=got, key_dtype=E4M3, slot_mapping=slots))
    torch_write_index_keys(keys, want, E4M3, slots)
    assert torch.equal(got, want)
    kv_c = (torch.randn(1000, 512, generator=gen) * 5).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(1000, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    cache = torch.zeros(blocks, block_size, 656, dtype=torch.uint8, device=DEVICE)
    prov.write_kv(WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_scale=None))
    keep = (slots >= 0) & (slots < capacity)
    expected = torch.zeros(capacity, 656, dtype=torch.uint8, device=DEVICE)
    expected[slots[keep]] = pack_ds_mla(kv_c[keep], k_pe[keep])
    assert torch.equal(cache.view(capacity, 656), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("with_lengths", [False, True], ids=["all-columns", "lengths"])
@pytest.mark.parametrize("provider", GPU_PROVIDERS)
@pytest.mark.parametrize("kv_format", ["bf16", "ds_mla"])
def test_gpu_sparse_graph_replay_sees_new_slots(provider: str, kv_format: str, with_lengths: bool) -> None:
    """Slot conversion and attention captured once; the replay reads the indices written in
    place afterwards (no value of a tensor is baked into the launch). With ``lengths`` the
    conversion writes them and the attention reads them, both inside the graph."""
    prov = _gpu_provider(provider)
    first = make_sparse_batch(
        qlens=[1, 1, 2], seq_lens=[3000, 900, 2500], heads=16, rank=512, rope=64, topk=2048,
        block_size=64, q_dtype=torch.bfloat16, kv_format=kv_format, pad_rows=0, seed=1, poison=False,
    )  # fmt: skip
    second = make_sparse_batch(
        qlens=[1, 1, 2], seq_lens=[3000, 900, 2500], heads=16, rank=512, rope=64, topk=2048,
        block_size=64, q_dtype=torch.bfloat16, kv_format=kv_format, pad_rows=0, seed=2, poison=False,
    )  # fmt: skip
    second = attrs.evolve(second, q=first.q, cache=first.cache, block_table=first.block_table)
    indices = first.indices.clone()
    slots = torch.empty_like(indices)
    out = torch.empty(first.q.shape[0], 16, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(first.q.shape[0], 16, dtype=torch.float32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lengths = torch.full((first.q.shape[0],), -1, dtype=torch.int32, device=DEVICE) if with_lengths else None

    def step() -> None:
        prov.sparse_slots(
            SparseSlotsCall(
                indices=indices, block_table=first.block_table, row_request=first.row_request,
                row_keys=first.row_keys, block_size=64, num_blocks=first.cache.shape[0], slots=slots,
                invalid_count=count, lengths=lengths,
            )
        )  # fmt: skip
        prov.sparse_attention(
            SparseAttentionCall(
                q=first.q, kv_cache=first.flat_cache, slots=slots, out=out, lse=lse, kv_lora_rank=512,
                rope_dim=64, softmax_scale=0.05, kv_scale=None, lengths=lengths,
            )
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    indices.copy_(second.indices)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = second.reference(0.05)
    assert_matches_reference(out, lse, ref_out, ref_lse, context=f"graph replay {provider} {kv_format}")
    if lengths is not None:
        valid = slots >= 0
        columns = torch.arange(1, slots.shape[1] + 1, dtype=torch.int32, device=DEVICE)
        assert torch.equal(lengths, torch.where(valid, columns, 0).amax(dim=1)), "the replay's lengths"
