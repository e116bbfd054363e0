"""The torch provider's sparse contracts against the float64 references.

Sparse attention over every cache format (float32, bf16, per-tensor fp8 with ``kv_scale``,
``fp8_ds_mla``), with cache rows no row selected (the null block included) and the output
buffers poisoned with NaN first; the default ``sparse_slots`` conversion (invalid entries
masked and counted); the indexer's top-k against :func:`reference_topk`; index-key and
``fp8_ds_mla`` KV writes read back. fp8 formats are compared with the reference computed on
the same quantized cache (it dequantizes), so the tolerance is float32's. The device-side
functions also run on the ``meta`` device, which has no values: a host read or a
value-dependent shape there raises.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla.core.config import DS_MLA_DTYPE, DS_MLA_TILE, ds_mla_row_bytes
from mla.providers import TorchProvider, formats, torch_sparse
from mla.providers.calls import (
    IndexTopkCall,
    SparseAttentionCall,
    SparseSlotsCall,
    WriteIndexKeysCall,
    WriteKVCall,
)
from mla.tools.reference import (
    causal_visible,
    reference_index_scores,
    reference_sparse,
    reference_topk,
)

PROVIDER = TorchProvider()
RANK, ROPE = 256, 32
BLOCK = 8
E4M3 = torch.float8_e4m3fn
META = torch.device("meta")


@attrs.frozen
class KVFormat:
    name: str
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    kv_scale: float | None
    rtol: float


FORMATS = [
    KVFormat("float32", torch.float32, torch.float32, None, 1e-5),
    KVFormat("bf16", torch.bfloat16, torch.bfloat16, None, 2e-2),
    KVFormat("fp8", torch.float32, E4M3, 0.0625, 1e-4),
    KVFormat("fp8_ds_mla", torch.float32, DS_MLA_DTYPE, None, 1e-4),
    KVFormat("fp8_ds_mla-bf16q", torch.bfloat16, DS_MLA_DTYPE, None, 2e-2),
]


def _encode(values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Cache rows ``[N, W]`` of float rows ``[N, L+R]`` in ``fmt`` (NaN rows stay NaN)."""
    if fmt.cache_dtype == DS_MLA_DTYPE:
        return formats.pack_ds_mla(values[:, :RANK], values[:, RANK:])
    if fmt.kv_scale is not None:
        return (values / fmt.kv_scale).to(fmt.cache_dtype)
    return values.to(fmt.cache_dtype)


@attrs.frozen
class SparseCase:
    """Requests of ``seq_lens`` keys, the last ``qlens`` of them queried, plus ``pad`` graph
    padding rows; every row selects a random subset of its causal window."""

    q: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    indices: torch.Tensor
    row_request: torch.Tensor
    row_keys: torch.Tensor
    num_blocks: int


def _make_sparse_case(fmt: KVFormat, heads: int, *, seed: int, topk: int = 12, pad: int = 2) -> SparseCase:
    gen = torch.Generator().manual_seed(seed)
    seq_lens, qlens = [30, 5, 17, 1], [3, 5, 1, 1]
    blocks_per = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per) + 3  # block 0 is the null block, a few stay free
    order = 1 + torch.randperm(num_blocks - 1, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    rows: list[list[int]] = []
    row_request: list[int] = []
    row_keys: list[int] = []
    for b, (s, qlen) in enumerate(zip(seq_lens, qlens, strict=True)):
        for i in range(qlen):
            window = s - qlen + i + 1
            take = int(torch.randint(0, min(topk, window) + 1, (1,), generator=gen))
            if b == 1 and i == 0:
                take = 0  # a real row that selected nothing
            chosen = torch.randperm(window, generator=gen)[:take].tolist()
            if b == 0 and i == 0:
                chosen = [*chosen[: topk - 2], window, s + 4]  # past its window: masked, counted
            rows.append(chosen + [-1] * (topk - len(chosen)))
            row_request.append(b)
            row_keys.append(window)
    for _ in range(pad):  # graph padding: no keys, garbage indices
        rows.append(torch.randint(-1, 40, (topk,), generator=gen).tolist())
        row_request.append(0)
        row_keys.append(0)
    num_rows = len(rows)
    values = torch.randn(num_blocks * BLOCK, RANK + ROPE, generator=gen)
    q = torch.randn(num_rows, heads, RANK + ROPE, generator=gen).to(fmt.q_dtype)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    return SparseCase(
        q=q,
        cache=_encode(values, fmt).view(num_blocks, BLOCK, -1),
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        indices=torch.tensor(rows, dtype=torch.int32),
        row_request=torch.tensor(row_request, dtype=torch.int32),
        row_keys=torch.tensor(row_keys, dtype=torch.int32),
        num_blocks=num_blocks,
    )


def _slots(case: SparseCase) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.full_like(case.indices, 7)
    invalid = torch.tensor([3], dtype=torch.int32)
    PROVIDER.sparse_slots(
        SparseSlotsCall(
            indices=case.indices,
            block_table=case.block_table,
            row_request=case.row_request,
            row_keys=case.row_keys,
            block_size=BLOCK,
            num_blocks=case.num_blocks,
            slots=slots,
            invalid_count=invalid,
        )
    )
    return slots, invalid - 3


def _poison_unselected(case: SparseCase, slots: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The cache with every row no slot names set to NaN (in the format's own encoding)."""
    flat = case.cache.clone().view(case.num_blocks * BLOCK, -1)
    keep = torch.zeros(flat.shape[0], dtype=torch.bool)
    keep[slots[slots >= 0].long()] = True
    nan_rows = _encode(torch.full((flat.shape[0], RANK + ROPE), float("nan")), fmt)
    flat[~keep] = nan_rows[~keep]
    assert not keep[0], "the null block's row 0 (where masked slots clamp) must be poisoned"
    return flat


def _assert_close_rel(got: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    scale = max(float(ref.abs().max()), 1e-30)
    err = float((got.to(torch.float64) - ref).abs().max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} x {scale:.3g}"


def _check_lse(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    empty = ref == float("-inf")
    assert torch.equal(got == float("-inf"), empty), "rows with no slot: lse -inf, and only they"
    diff = (got.to(torch.float64) - ref).abs()[~empty]
    bound = rtol * torch.clamp(ref.abs()[~empty], min=1.0)
    assert bool((diff <= bound).all()), f"lse: max error {float(diff.max()):.3g}"


@pytest.mark.parametrize(
    ("heads", "want_lse"),
    [(1, True), (3, True), (16, True), (3, False)],
    ids=["h1", "h3", "h16", "h3-no-lse"],
)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_sparse_attention_matches_the_float64_reference(fmt: KVFormat, heads: int, want_lse: bool) -> None:
    case = _make_sparse_case(fmt, heads, seed=heads)
    slots, invalid = _slots(case)
    # Row 0 had two positions past its window, each padding row all its non -1 entries.
    padding = case.indices[-2:]
    assert int(invalid) == 2 + int((padding != -1).sum())
    flat = _poison_unselected(case, slots, fmt)
    num_rows = case.q.shape[0]
    out = torch.full((num_rows, heads, RANK), float("nan"), dtype=fmt.q_dtype)
    lse = torch.full((num_rows, heads), float("nan")) if want_lse else None
    kv_scale = None if fmt.kv_scale is None else torch.tensor([fmt.kv_scale])
    PROVIDER.sparse_attention(
        SparseAttentionCall(
            q=case.q,
            kv_cache=flat,
            slots=slots,
            out=out,
            lse=lse,
            kv_lora_rank=RANK,
            rope_dim=ROPE,
            softmax_scale=(RANK + ROPE) ** -0.5,
            kv_scale=kv_scale,
        )
    )
    ref_out, ref_lse = reference_sparse(
        case.q,
        flat.view(case.num_blocks, BLOCK, -1),
        case.block_table,
        case.seq_lens,
        case.query_start_loc,
        case.indices,
        softmax_scale=(RANK + ROPE) ** -0.5,
        kv_lora_rank=RANK,
        kv_scale=fmt.kv_scale,
    )
    # The reference gives padding rows (no request) o = 0 and lse = -inf too.
    assert ref_out.shape == out.shape
    assert out.dtype == fmt.q_dtype
    assert bool(torch.isfinite(out).all())
    empty = ref_lse[:, 0] == float("-inf")
    assert int(empty.sum()) >= 3  # the row that selected nothing and the two padding rows
    assert bool((out[empty] == 0).all())
    _assert_close_rel(out, ref_out, fmt.rtol, "out")
    if lse is not None:
        _check_lse(lse, ref_lse, max(fmt.rtol, 1e-5))


def test_sparse_attention_in_small_chunks_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = FORMATS[3]
    case = _make_sparse_case(fmt, 4, seed=11)
    slots, _ = _slots(case)
    flat = _poison_unselected(case, slots, fmt)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full((case.q.shape[0], 4, RANK), float("nan"))
        lse = torch.full((case.q.shape[0], 4), float("nan"))
        PROVIDER.sparse_attention(
            SparseAttentionCall(
                q=case.q, kv_cache=flat, slots=slots, out=out, lse=lse, kv_lora_rank=RANK,
                rope_dim=ROPE, softmax_scale=0.1, kv_scale=None,
            )
        )  # fmt: skip
        return out, lse

    whole = run()
    monkeypatch.setattr(torch_sparse, "CHUNK_BYTES", 1)  # one row per chunk
    chunked = run()
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(chunked, whole, strict=True))


def test_sparse_attention_masks_a_nan_row_behind_minus_one() -> None:
    """A ``-1`` slot clamps to row 0; a NaN there must not reach the output (no ``0 * NaN``)."""
    cache = torch.randn(4, RANK + ROPE)
    cache[0] = float("nan")
    slots = torch.tensor([[2, -1, 3, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    q = torch.randn(2, 2, RANK + ROPE)
    out = torch.full((2, 2, RANK), float("nan"))
    lse = torch.full((2, 2), float("nan"))
    PROVIDER.sparse_attention(
        SparseAttentionCall(
            q=q, kv_cache=cache, slots=slots, out=out, lse=lse, kv_lora_rank=RANK, rope_dim=ROPE,
            softmax_scale=0.05, kv_scale=None,
        )
    )  # fmt: skip
    keys = cache[[2, 3]].double()
    scores = torch.einsum("hd,kd->hk", q[0].double(), keys) * 0.05
    ref = torch.softmax(scores, -1) @ keys[:, :RANK]
    assert torch.allclose(out[0].double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse[0].double(), torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-6)
    assert bool((out[1] == 0).all())
    assert bool((lse[1] == float("-inf")).all())


# -- lengths: row t attends only slots[t, :lengths[t]] ------------------------------------------


def _attend(
    q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the torch sparse attention into NaN-poisoned outputs."""
    rows, heads = q.shape[:2]
    out = torch.full((rows, heads, RANK), float("nan"))
    lse = torch.full((rows, heads), float("nan"))
    PROVIDER.sparse_attention(
        SparseAttentionCall(
            q=q, kv_cache=cache, slots=slots, out=out, lse=lse, kv_lora_rank=RANK, rope_dim=ROPE,
            softmax_scale=0.07, kv_scale=None, lengths=lengths,
        )
    )  # fmt: skip
    return out, lse


def _cut_tails(slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``slots`` with every column at or past ``clamp(lengths[t], 0, K)`` set to ``-1``."""
    columns = torch.arange(slots.shape[1])[None, :]
    return torch.where(columns < lengths.to(torch.int64)[:, None], slots, -1)


def _tail_poisoned_cache(cache_rows: int, kept: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random rows where a kept slot names them, NaN everywhere else (a tail's rows included)."""
    cache = torch.randn(cache_rows, RANK + ROPE, generator=gen)
    named = torch.zeros(cache_rows, dtype=torch.bool)
    named[kept[kept >= 0].long()] = True
    cache[~named] = float("nan")
    return cache


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_lengths_give_the_result_of_minus_one_tails(data: st.DataObject) -> None:
    """Any lengths (negative, 0, inside, ``K``, past ``K``) equal the same slots with the
    columns at or past the clamped length set to ``-1``; the tails name NaN rows."""
    rows = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 9))
    cache_rows = 12
    table = []
    for _ in range(rows):
        chosen = data.draw(st.permutations(range(cache_rows)))[:width]
        holes = data.draw(st.lists(st.booleans(), min_size=width, max_size=width))
        table.append([-1 if hole else s for s, hole in zip(chosen, holes, strict=True)])
    slots = torch.tensor(table, dtype=torch.int32).view(rows, width)
    lengths = torch.tensor(
        data.draw(st.lists(st.integers(-3, width + 3), min_size=rows, max_size=rows)), dtype=torch.int32
    )
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    cut = _cut_tails(slots, lengths)
    cache = _tail_poisoned_cache(cache_rows, cut, gen)
    q = torch.randn(rows, 2, RANK + ROPE, generator=gen)
    got = _attend(q, cache, slots, lengths)
    want = _attend(q, cache, cut, None)
    assert bool(torch.isfinite(got[0]).all())
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


LENGTH_EDGES = [
    # name, lengths of every row (K = 6), what it must equal
    ("zero", 0, "empty"),
    ("negative-clamped-to-0", -5, "empty"),
    ("K", 6, "all"),
    ("past-K-clamped", 1 << 20, "all"),
]


@pytest.mark.parametrize(
    ("length", "expect"), [e[1:] for e in LENGTH_EDGES], ids=[e[0] for e in LENGTH_EDGES]
)
def test_lengths_edges(length: int, expect: str) -> None:
    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([[3, -1, 7, 1, -1, 9], [0, 2, 4, 6, 8, 10]], dtype=torch.int32)
    cache = torch.randn(12, RANK + ROPE, generator=gen)
    q = torch.randn(2, 3, RANK + ROPE, generator=gen)
    out, lse = _attend(q, cache, slots, torch.full((2,), length, dtype=torch.int32))
    if expect == "empty":  # rows with valid slots attend none of them
        assert bool((out == 0).all())
        assert bool(torch.isneginf(lse).all())
        return
    want = _attend(q, cache, slots, None)
    assert torch.equal(out, want[0])
    assert torch.equal(lse, want[1])


# -- sparse_slots -------------------------------------------------------------------------------


def _slots_by_definition(
    indices: list[list[int]],
    table: list[list[int]],
    row_request: list[int],
    row_keys: list[int],
    block_size: int,
    num_blocks: int,
) -> tuple[list[list[int]], int]:
    out: list[list[int]] = []
    bad = 0
    for t, row in enumerate(indices):
        got: list[int] = []
        for p in row:
            blocks = table[row_request[t]]
            ok = 0 <= p < row_keys[t] and p // block_size < len(blocks)
            block = blocks[p // block_size] if ok else -1
            if ok and 0 <= block < num_blocks:
                got.append(block * block_size + p % block_size)
            else:
                got.append(-1)
                bad += p != -1
        out.append(got)
    return out, bad


def _lengths_by_definition(slots: list[list[int]]) -> list[int]:
    """``1 +`` the last column of each row whose slot is valid, 0 for a row with none."""
    return [max((j + 1 for j, s in enumerate(row) if s != -1), default=0) for row in slots]


def _run_slots(
    indices: list[list[int]],
    table: list[list[int]],
    row_request: list[int],
    row_keys: list[int],
    block_size: int,
    num_blocks: int,
    *,
    width: int | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(slots, invalid entries, lengths)``: the conversion run with a poisoned lengths output,
    after a run without one whose slots and count must be the same."""
    shape = (len(indices), len(indices[0]) if indices else (width or 0))
    runs = []
    for lengths in (None, torch.full((shape[0],), 99, dtype=torch.int32)):
        slots = torch.full(shape, 99, dtype=torch.int32)
        invalid = torch.tensor([5], dtype=torch.int32)
        PROVIDER.sparse_slots(
            SparseSlotsCall(
                indices=torch.tensor(indices, dtype=torch.int32).view(shape),
                block_table=torch.tensor(table, dtype=torch.int32),
                row_request=torch.tensor(row_request, dtype=torch.int32),
                row_keys=torch.tensor(row_keys, dtype=torch.int32),
                block_size=block_size,
                num_blocks=num_blocks,
                slots=slots,
                invalid_count=invalid,
                lengths=lengths,
            )
        )
        runs.append((slots, int(invalid) - 5, lengths))
    (plain, plain_bad, _), (slots, bad, lengths) = runs
    assert torch.equal(slots, plain), "the lengths output changes no slot"
    assert bad == plain_bad
    assert lengths is not None
    return slots, bad, lengths


def test_sparse_slots_masks_and_counts_every_kind_of_invalid_entry() -> None:
    table = [[3, 1, 9], [2, -1, 0]]  # block 9 is outside a 4-block cache; -1 is no block
    indices = [
        [0, 5, 9, -1],  # 0 and 5 in blocks 3 and 1 (block size 4), 9 in block 9: outside
        [6, 7, 8, -1],  # 6 valid, 7 at row_keys, 8 past it
        [8, 2, 4, 12],  # 8 in block 0 and 2 in block 2 valid, 4 in block -1, 12 past the table
        [0, 1, 2, 3],  # graph padding (no keys): all invalid
    ]
    slots, bad, lengths = _run_slots(indices, table, [0, 0, 1, 0], [10, 7, 13, 0], 4, 4)
    assert slots.tolist() == [
        [12, 5, -1, -1],
        [6, -1, -1, -1],
        [0, 10, -1, -1],
        [-1, -1, -1, -1],
    ]
    assert bad == 1 + 2 + 2 + 4
    assert lengths.tolist() == [2, 1, 2, 0]


def test_sparse_slots_lengths_end_at_the_last_valid_column() -> None:
    """Invalid entries in the middle do not cut a row; at its tail they do; a row of only
    invalid or ``-1`` entries gets 0; a valid last column gives ``K``."""
    table = [[0, 1, 2, 3]]
    indices = [
        [-1, 3, 99, 5, -1],  # invalid in the middle and -1 at the tail: 4
        [2, 99, -7, 50, 60],  # invalid tail: 1
        [-1, -1, -1, -1, -1],
        [99, 40, -3, 100, -1],  # all invalid: 0
        [-1, -1, -1, -1, 0],  # valid last column: K
    ]
    slots, bad, lengths = _run_slots(indices, table, [0] * 5, [8] * 5, 4, 4)
    assert lengths.tolist() == [4, 1, 0, 0, 5] == _lengths_by_definition(slots.tolist())
    assert bad == 1 + 4 + 4


def test_sparse_slots_of_zero_columns_write_zero_lengths() -> None:
    slots, bad, lengths = _run_slots([[], []], [[0]], [0, 0], [3, 3], 4, 1, width=0)
    assert slots.shape == (2, 0)
    assert bad == 0
    assert lengths.tolist() == [0, 0]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_sparse_slots_follows_its_definition(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = data.draw(st.integers(1, 6))
    requests = data.draw(st.integers(1, 3))
    width = data.draw(st.integers(1, 4))
    table = data.draw(
        st.lists(
            st.lists(st.integers(-1, num_blocks + 1), min_size=width, max_size=width),
            min_size=requests,
            max_size=requests,
        )
    )
    rows = data.draw(st.integers(0, 5))
    row_request = data.draw(st.lists(st.integers(0, requests - 1), min_size=rows, max_size=rows))
    capacity = width * block_size
    row_keys = data.draw(st.lists(st.integers(0, capacity + 2), min_size=rows, max_size=rows))
    k = data.draw(st.integers(1, 5))
    indices = data.draw(
        st.lists(
            st.lists(st.integers(-1, capacity + 3), min_size=k, max_size=k), min_size=rows, max_size=rows
        )
    )
    if rows == 0:
        indices = []
    expect, expect_bad = _slots_by_definition(indices, table, row_request, row_keys, block_size, num_blocks)
    slots, bad, lengths = _run_slots(indices, table, row_request, row_keys, block_size, num_blocks)
    if rows:
        assert slots.tolist() == expect
        assert lengths.tolist() == _lengths_by_definition(expect)
    assert bad == expect_bad


# -- indexer ------------------------------------------------------------------------------------

INDEX_HEADS, INDEX_DIM = 16, 32


@attrs.frozen
class IndexCase:
    q: torch.Tensor
    weights: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    row_request: torch.Tensor
    row_keys: torch.Tensor
    real_rows: int


def _make_index_case(key_dtype: torch.dtype, *, seed: int, pad: int = 2) -> IndexCase:
    gen = torch.Generator().manual_seed(seed)
    seq_lens, qlens = [37, 6, 20, 3], [4, 6, 1, 3]
    blocks_per = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per)
    order = 1 + torch.randperm(num_blocks - 1, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    fp8 = key_dtype == E4M3
    width = INDEX_DIM + 4 if fp8 else INDEX_DIM
    cache = torch.zeros(num_blocks, BLOCK, width, dtype=torch.uint8 if fp8 else key_dtype)
    # Poison the whole cache first: every key a row reads is written below.
    if fp8:
        cache.fill_(0x7F)
    else:
        cache.fill_(float("nan"))
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        keys = torch.randn(s, INDEX_DIM, generator=gen)
        PROVIDER.write_index_keys(
            WriteIndexKeysCall(keys=keys, index_cache=cache, key_dtype=key_dtype, slot_mapping=slots)
        )
    row_request = [b for b, n in enumerate(qlens) for _ in range(n)] + [0] * pad
    row_keys = [s - n + i + 1 for s, n in zip(seq_lens, qlens, strict=True) for i in range(n)] + [0] * pad
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    rows = len(row_request)
    return IndexCase(
        q=torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(
            torch.bfloat16 if key_dtype == torch.bfloat16 else torch.float32
        ),
        weights=torch.rand(rows, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5,
        cache=cache,
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        row_request=torch.tensor(row_request, dtype=torch.int32),
        row_keys=torch.tensor(row_keys, dtype=torch.int32),
        real_rows=sum(qlens),
    )


def _run_topk(case: IndexCase, key_dtype: torch.dtype, topk: int, max_keys: int) -> torch.Tensor:
    indices = torch.full((case.q.shape[0], topk), 1234, dtype=torch.int32)
    PROVIDER.index_topk(
        IndexTopkCall(
            q=case.q,
            weights=case.weights,
            index_cache=case.cache,
            key_dtype=key_dtype,
            block_table=case.block_table,
            row_request=case.row_request,
            row_keys=case.row_keys,
            max_keys=max_keys,
            softmax_scale=INDEX_DIM**-0.5,
            topk=topk,
            indices=indices,
        )
    )
    return indices


KEY_DTYPES = [torch.float32, torch.bfloat16, E4M3]


@pytest.mark.parametrize("topk", [8, 45], ids=["topk8", "topk45"])
@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["float32", "bf16", "fp8"])
def test_index_topk_matches_the_reference(key_dtype: torch.dtype, topk: int) -> None:
    case = _make_index_case(key_dtype, seed=topk)
    max_keys = case.block_table.shape[1] * BLOCK  # the table's capacity, a static bound
    got = _run_topk(case, key_dtype, topk, max_keys)
    scores = reference_index_scores(
        case.q,
        case.weights,
        case.cache,
        case.block_table,
        case.seq_lens,
        case.query_start_loc,
        key_dtype=key_dtype,
        softmax_scale=INDEX_DIM**-0.5,
    )
    ref = reference_topk(scores, topk)
    real = got[: case.real_rows].long()
    # -1 exactly past each row's visible positions (short rows padded), everywhere -1 on padding.
    counts = torch.clamp(case.row_keys[: case.real_rows].long(), max=topk)
    assert torch.equal(real >= 0, torch.arange(topk)[None, :] < counts[:, None])
    assert bool((got[case.real_rows :] == -1).all())
    if topk > 40:
        assert int((counts < topk).sum()) > 0, "some rows must be shorter than topk"
    by_row = torch.full((case.real_rows, max_keys), float("-inf"), dtype=torch.float64)
    row = 0
    for score in scores:
        by_row[row : row + score.shape[0], : score.shape[1]] = score
        row += score.shape[0]
    chosen = torch.where(real >= 0, by_row.gather(1, real.clamp(min=0)), float("-inf"))
    best = torch.where(ref >= 0, by_row.gather(1, ref.clamp(min=0)), float("-inf"))
    if key_dtype == E4M3:
        # The same dequantized keys: only float32 against float64 rounding may reorder.
        overlap = sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(real, ref, strict=True))
        assert overlap >= 0.99 * int((ref >= 0).sum())
        assert torch.allclose(chosen, best, rtol=1e-5, atol=1e-6)
        return
    # Tie-free data: each row's top scores (one past the cut included) are distinct.
    for row in by_row:
        finite = row[torch.isfinite(row)]
        top = torch.sort(finite, descending=True).values[: topk + 1]
        assert bool((top[:-1] - top[1:] > 1e-6).all()), "the case must be tie-free"
    assert torch.equal(real, ref), "descending score order, same positions"
    assert torch.allclose(chosen, best, rtol=1e-5, atol=1e-6)


def test_index_topk_beyond_max_keys_and_in_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _make_index_case(torch.float32, seed=3)
    max_keys = case.block_table.shape[1] * BLOCK
    whole = _run_topk(case, torch.float32, max_keys + 7, max_keys)
    assert bool((whole[:, max_keys:] == -1).all()), "columns past max_keys are -1"
    monkeypatch.setattr(torch_sparse, "CHUNK_BYTES", 1)  # one row, one position per chunk
    assert torch.equal(_run_topk(case, torch.float32, max_keys + 7, max_keys), whole)


@pytest.mark.parametrize("key_dtype", KEY_DTYPES, ids=["float32", "bf16", "fp8"])
def test_index_keys_round_trip(key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    fp8 = key_dtype == E4M3
    width = INDEX_DIM + 4 if fp8 else INDEX_DIM
    cache = torch.randint(0, 255, (4, BLOCK, width), dtype=torch.uint8, generator=gen)
    if not fp8:
        cache = torch.randn(4, BLOCK, width, generator=gen).to(key_dtype)
    before = cache.clone()
    keys = torch.randn(6, INDEX_DIM, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    slots = torch.tensor([3, -1, 31, 32, 9, 100])  # -1, 32 and 100 are outside: skipped
    # Zero new tokens write nothing.
    PROVIDER.write_index_keys(
        WriteIndexKeysCall(keys=keys[:0], index_cache=cache, key_dtype=key_dtype, slot_mapping=slots[:0])
    )
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    PROVIDER.write_index_keys(
        WriteIndexKeysCall(keys=keys, index_cache=cache, key_dtype=key_dtype, slot_mapping=slots)
    )
    written = torch.tensor([0, 2, 4])
    back = formats.read_index_keys(cache, key_dtype, slots[written], INDEX_DIM)
    if fp8:
        values, scale = formats.quantize_index_keys(keys[written])
        assert torch.equal(back, values.to(torch.float32) * scale[:, None])
        amax = keys[written].abs().amax(-1, keepdim=True)
        assert bool(((back - keys[written]).abs() <= amax * 2.0**-3).all())
    else:
        assert torch.equal(back, keys[written].to(key_dtype).to(torch.float32))
    others = torch.tensor([s for s in range(4 * BLOCK) if s not in (3, 31, 9)])
    assert torch.equal(  # random bytes: some are NaN, so compare the bytes read back
        formats.read_index_keys(cache, key_dtype, others, INDEX_DIM).view(torch.int32),
        formats.read_index_keys(before, key_dtype, others, INDEX_DIM).view(torch.int32),
    )


# -- write_kv into fp8_ds_mla -------------------------------------------------------------------


def test_write_kv_into_fp8_ds_mla_round_trips_within_a_tile_step() -> None:
    gen = torch.Generator().manual_seed(9)
    width = ds_mla_row_bytes(RANK, ROPE)
    cache = torch.randint(0, 255, (3, BLOCK, width), dtype=torch.uint8, generator=gen)
    before = cache.clone()
    tokens = 5
    # Tiles of very different magnitudes, so a per-row (not per-tile) scale would fail.
    kv_c = torch.randn(tokens, RANK, generator=gen) * torch.tensor([1e-3, 50.0]).repeat_interleave(
        DS_MLA_TILE
    )
    k_pe = torch.randn(tokens, ROPE, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([4, -1, 23, 24, 0])  # -1 and 24 (past 3 x 8 rows) skipped
    call = WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_scale=None)
    PROVIDER.write_kv(attrs.evolve(call, kv_c=kv_c[:0], k_pe=k_pe[:0], slot_mapping=slots[:0]))
    assert torch.equal(cache, before), "zero new tokens write nothing"
    PROVIDER.write_kv(call)
    flat, old = cache.view(-1, width), before.view(-1, width)
    written = torch.tensor([0, 2, 4])
    assert torch.equal(flat[slots[written]], formats.pack_ds_mla(kv_c[written], k_pe[written]))
    rest = torch.tensor([s for s in range(3 * BLOCK) if s not in (4, 23, 0)])
    assert torch.equal(flat[rest], old[rest])
    back = formats.unpack_ds_mla(flat[slots[written]], RANK, ROPE)
    tiles = (back[:, :RANK] - kv_c[written]).view(3, -1, DS_MLA_TILE).abs().amax(-1)
    amax = kv_c[written].view(3, -1, DS_MLA_TILE).abs().amax(-1)
    assert bool((tiles <= amax * 2.0**-3).all())
    assert torch.equal(back[:, RANK:], k_pe[written].to(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
def test_write_kv_of_zero_tokens_is_a_no_op(dtype: torch.dtype) -> None:
    cache = torch.randn(2, BLOCK, RANK + ROPE).to(dtype)
    before = cache.clone()
    PROVIDER.write_kv(
        WriteKVCall(
            kv_c=torch.empty(0, RANK),
            k_pe=torch.empty(0, ROPE),
            kv_cache=cache,
            slot_mapping=torch.empty(0, dtype=torch.int64),
            kv_scale=torch.tensor([1.0]) if dtype == E4M3 else None,
        )
    )
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


# -- no host sync: the meta device --------------------------------------------------------------


@pytest.mark.parametrize("with_lengths", [False, True], ids=["all-columns", "lengths"])
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2], FORMATS[3]], ids=lambda f: f.name)
def test_sparse_attention_runs_on_meta(fmt: KVFormat, with_lengths: bool) -> None:
    width = ds_mla_row_bytes(RANK, ROPE) if fmt.cache_dtype == DS_MLA_DTYPE else RANK + ROPE
    torch_sparse.sparse_attention(
        SparseAttentionCall(
            q=torch.empty(5, 3, RANK + ROPE, device=META),
            kv_cache=torch.empty(64, width, dtype=fmt.cache_dtype, device=META),
            slots=torch.empty(5, 7, dtype=torch.int32, device=META),
            out=torch.empty(5, 3, RANK, device=META),
            lse=torch.empty(5, 3, device=META),
            kv_lora_rank=RANK,
            rope_dim=ROPE,
            softmax_scale=0.1,
            kv_scale=None if fmt.kv_scale is None else torch.empty(1, device=META),
            lengths=torch.empty(5, dtype=torch.int32, device=META) if with_lengths else None,
        )
    )


def test_sparse_slots_runs_on_meta() -> None:
    PROVIDER.sparse_slots(
        SparseSlotsCall(
            indices=torch.empty(5, 7, dtype=torch.int32, device=META),
            block_table=torch.empty(2, 3, dtype=torch.int32, device=META),
            row_request=torch.empty(5, dtype=torch.int32, device=META),
            row_keys=torch.empty(5, dtype=torch.int32, device=META),
            block_size=BLOCK,
            num_blocks=6,
            slots=torch.empty(5, 7, dtype=torch.int32, device=META),
            invalid_count=torch.empty(1, dtype=torch.int32, device=META),
            lengths=torch.empty(5, dtype=torch.int32, device=META),
        )
    )


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, E4M3], ids=["bf16", "fp8"])
def test_indexer_runs_on_meta(key_dtype: torch.dtype) -> None:
    fp8 = key_dtype == E4M3
    cache = torch.empty(
        6, BLOCK, INDEX_DIM + 4 if fp8 else INDEX_DIM, dtype=torch.uint8 if fp8 else key_dtype, device=META
    )
    torch_sparse.index_topk(
        IndexTopkCall(
            q=torch.empty(4, 2, INDEX_DIM, device=META),
            weights=torch.empty(4, 2, device=META),
            index_cache=cache,
            key_dtype=key_dtype,
            block_table=torch.empty(2, 3, dtype=torch.int32, device=META),
            row_request=torch.empty(4, dtype=torch.int32, device=META),
            row_keys=torch.empty(4, dtype=torch.int32, device=META),
            max_keys=3 * BLOCK,
            softmax_scale=0.2,
            topk=30,
            indices=torch.empty(4, 30, dtype=torch.int32, device=META),
        )
    )


def test_causal_windows_of_the_sparse_case_are_what_the_reference_applies() -> None:
    """The case's ``row_keys`` are the reference's right-aligned causal windows."""
    case = _make_sparse_case(FORMATS[0], 1, seed=0)
    rows = 0
    for s, q0, q1 in zip(
        case.seq_lens.tolist(),
        case.query_start_loc[:-1].tolist(),
        case.query_start_loc[1:].tolist(),
        strict=True,
    ):
        windows = causal_visible(q1 - q0, s).sum(-1)
        assert case.row_keys[q0:q1].tolist() == windows.tolist()
        rows += q1 - q0
    assert bool((case.row_keys[rows:] == 0).all())
