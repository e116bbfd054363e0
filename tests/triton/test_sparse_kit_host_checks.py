"""The host checks of the Triton kernels around the sparse attention (the indexer's scores, the
top-k, the index-key and ``fp8_ds_mla`` writes, the slot conversion): each operand a kernel
cannot read is refused with an :class:`InvalidInputError` naming it, before any launch. CPU
tensors; nothing reaches Triton.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from layouts import strided_last_dim
from rejections import expect_invalid

from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
from mla.providers.calls import IndexTopkCall, SparseSlotsCall, WriteIndexKeysCall, WriteKVCall
from mla.providers.triton.indexer import index_scores
from mla.providers.triton.sparse import sparse_slots, write_index_keys, write_kv_ds_mla
from mla.providers.triton.topk import radix_topk

E4M3 = torch.float8_e4m3fn
ROWS, HEADS, DIM, BLOCK, BLOCKS = 4, 2, 32, 8, 6
KEYS = BLOCK * BLOCKS


def _index_call(
    *, q: torch.Tensor | None = None, cache: torch.Tensor | None = None, fp8: bool = False
) -> IndexTopkCall:
    """An indexer call over ``BLOCKS`` blocks of ``BLOCK`` positions (fp8 keys: one byte a lane
    and a float32 scale a row)."""
    width = DIM + 4 if fp8 else DIM
    default_cache = torch.zeros(BLOCKS, BLOCK, width, dtype=torch.uint8 if fp8 else torch.float32)
    return IndexTopkCall(
        q=torch.zeros(ROWS, HEADS, DIM) if q is None else q,
        weights=torch.ones(ROWS, HEADS),
        index_cache=default_cache if cache is None else cache,
        key_dtype=E4M3 if fp8 else torch.float32,
        block_table=torch.arange(BLOCKS, dtype=torch.int32)[None].repeat(ROWS, 1),
        row_request=torch.arange(ROWS, dtype=torch.int32),
        row_keys=torch.full((ROWS,), KEYS, dtype=torch.int32),
        max_keys=KEYS,
        softmax_scale=DIM**-0.5,
        topk=8,
        indices=torch.zeros(ROWS, 8, dtype=torch.int32),
    )


def _scores() -> torch.Tensor:
    return torch.zeros(ROWS, KEYS)


def _ds_mla_write(**changes: torch.Tensor) -> WriteKVCall:
    rank, rope = 128, 64
    values = {
        "kv_c": torch.zeros(3, rank, dtype=torch.bfloat16),
        "k_pe": torch.zeros(3, rope, dtype=torch.bfloat16),
        "kv_cache": torch.zeros(BLOCKS, BLOCK, ds_mla_row_bytes(rank, rope), dtype=DS_MLA_DTYPE),
        "slot_mapping": torch.arange(3),
    }
    values.update(changes)
    return WriteKVCall(**values, kv_scale=None)


def _slots_call(indices: torch.Tensor) -> SparseSlotsCall:
    return SparseSlotsCall(
        indices=indices,
        block_table=torch.arange(BLOCKS, dtype=torch.int32)[None].repeat(ROWS, 1),
        row_request=torch.arange(ROWS, dtype=torch.int32),
        row_keys=torch.full((ROWS,), KEYS, dtype=torch.int32),
        block_size=BLOCK,
        num_blocks=BLOCKS,
        slots=torch.zeros(ROWS, 8, dtype=torch.int32),
        invalid_count=torch.zeros(1, dtype=torch.int32),
    )


BAD_CALLS: dict[str, tuple[str, Callable[[], object], str]] = {
    "scores-fp8-q-float-keys": (
        "q",
        lambda: index_scores(_index_call(q=torch.zeros(ROWS, HEADS, DIM, dtype=E4M3)), _scores()),
        "need fp8 index keys",
    ),
    "scores-fp8-cache-strided": (
        "index_cache",
        lambda: index_scores(
            _index_call(cache=torch.zeros(BLOCKS, BLOCK * 2, DIM + 4, dtype=torch.uint8)[:, ::2], fp8=True),
            _scores(),
        ),
        "must be contiguous",
    ),
    "scores-q-strided": (
        "q",
        lambda: index_scores(_index_call(q=strided_last_dim(torch.zeros(ROWS, HEADS, DIM))), _scores()),
        "contiguous last dim",
    ),
    "scores-stats-shape": (
        "stats",
        lambda: index_scores(_index_call(), _scores(), stats=torch.zeros(2, ROWS + 1, 1)),
        "expected [2, 4,",
    ),
    "topk-float64": (
        "scores",
        lambda: radix_topk(
            torch.zeros(ROWS, KEYS, dtype=torch.float64), torch.zeros(ROWS, 8, dtype=torch.int32), k=8
        ),
        "expected float32 scores",
    ),
    "topk-strided": (
        "scores",
        lambda: radix_topk(
            strided_last_dim(torch.zeros(ROWS, KEYS)), torch.zeros(ROWS, 8, dtype=torch.int32), k=8
        ),
        "contiguous last dim",
    ),
    "index-keys-fp8-cache-strided": (
        "index_cache",
        lambda: write_index_keys(
            WriteIndexKeysCall(
                keys=torch.zeros(3, DIM),
                index_cache=torch.zeros(BLOCKS, BLOCK * 2, DIM + 4, dtype=torch.uint8)[:, ::2],
                key_dtype=E4M3,
                slot_mapping=torch.arange(3),
            )
        ),
        "must be contiguous",
    ),
    "index-keys-strided": (
        "keys",
        lambda: write_index_keys(
            WriteIndexKeysCall(
                keys=strided_last_dim(torch.zeros(3, DIM)),
                index_cache=torch.zeros(BLOCKS, BLOCK, DIM),
                key_dtype=torch.float32,
                slot_mapping=torch.arange(3),
            )
        ),
        "contiguous last dim",
    ),
    "ds-mla-write-strided": (
        "kv_cache",
        lambda: write_kv_ds_mla(_ds_mla_write(kv_c=torch.zeros(128, 3, dtype=torch.bfloat16).t())),
        "contiguous last dim",
    ),
    "slots-strided": (
        "indices",
        lambda: sparse_slots(_slots_call(torch.zeros(8, ROWS, dtype=torch.int32).t())),
        "contiguous last dim",
    ),
}
"""name -> (the argument named, a call with one bad operand, a fragment of the message)."""


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_operand_is_named_before_any_launch(case: str) -> None:
    argument, call, match = BAD_CALLS[case]
    expect_invalid(argument, call, re.escape(match))
