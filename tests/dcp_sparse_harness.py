"""Sparse MLA (DeepSeek Sparse Attention) under decode context parallelism, run on every rank.

Each rank builds the same random requests (same seed everywhere): the unsharded latent and
index-key caches on a single-process sparse backend, and its own shards of both. History rows
are written to the shards at positions this file computes independently of
:mod:`mla.distributed`; the step's new rows go through ``DecodeContextParallel.write_kv`` and
``write_index_keys`` (or through the layer). Each rank's indexer selects over its shard; the
ranks' selections are all-gathered and mapped to global positions, and:

* every rank's selection is checked against the float64 indexer scores restricted to the
  positions the rank holds in the row's causal window (tie-robust, ``selection_gap``);
* ``forward_sparse_decode`` (decode and verify rows, graph padding) on this rank's heads equals
  :func:`mla.tools.reference.reference_sparse` over the union of the selections;
* :class:`~mla.layers.MLAAttention` on the group equals the same layer on the single-process
  backend given the union as ``topk_indices``.

Used by ``test_distributed_sparse.py`` (gloo, CPU).
"""

from __future__ import annotations

import math
import os
import random
import zlib
from typing import Any

import attrs
import torch
import torch.distributed as dist
from dcp_harness import TOLERANCE, _lse_err, _rel

import mla
from mla.distributed import DCPLayout, DecodeContextParallel
from mla.layers import MLAAttention
from mla.testing import encode_latent_cache, poisoned_index_cache
from mla.testing.sparse import selection_tolerance
from mla.tools.demo_sparse import selection_gap
from mla.tools.reference import reference_index_scores, reference_sparse

HEADS, RANK, ROPE, NOPE, VDIM = 2, 128, 16, 16, 16
"""Heads per rank and the latent geometry (``fp8_ds_mla`` needs whole 128-wide tiles)."""
INDEX_HEADS, INDEX_DIM = 4, 32
TOPK = 5
"""Per rank: small enough that most rows keep a strict subset of their shard's window."""
MAX_LEN = 48
LIMITS = mla.EngineLimits(max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=32, max_decode_qlen=4)


@attrs.frozen
class Case:
    kv_dtype: str
    """``float32``, ``bf16`` or ``fp8_ds_mla`` (the model dtype follows: float32, bf16, bf16)."""
    block_size: int
    interleave: int
    qlen: int
    split_heads: bool

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.float32 if self.kv_dtype == "float32" else torch.bfloat16

    @property
    def key_dtype(self) -> str:
        return {"float32": "float32", "bf16": "bf16", "fp8_ds_mla": "fp8"}[self.kv_dtype]

    @property
    def label(self) -> str:
        heads = "split" if self.split_heads else "replicated"
        return f"{self.kv_dtype} bs{self.block_size} I{self.interleave} qlen{self.qlen} {heads}"


def _owner(position: int, world: int, interleave: int) -> int:
    return (position // interleave) % world


def _local(position: int, world: int, interleave: int) -> int:
    return (position // (interleave * world)) * interleave + position % interleave


def _dims(heads: int, topk: int) -> mla.MLADims:
    return mla.MLADims(heads, RANK, ROPE, NOPE, VDIM, softmax_scale=(NOPE + ROPE) ** -0.5, index_topk=topk)


class Scenario:
    """One decode step (``requests``: ``(seq_len, new tokens)``) on both layouts; a graph-padding
    request (seq_len 0) and one extra padding row follow the requests."""

    def __init__(self, case: Case, *, group: Any, requests: list[tuple[int, int]], seed: int) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.case, self.rank, self.world, self.group = case, rank, world, group
        self.gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        bs, inter = case.block_size, case.interleave
        self.global_heads = HEADS * world if case.split_heads else HEADS
        self.heads = slice(rank * HEADS, (rank + 1) * HEADS) if case.split_heads else slice(0, HEADS)
        self.spec = mla.IndexerSpec(num_heads=INDEX_HEADS, head_dim=INDEX_DIM, key_dtype=case.key_dtype)
        common: dict[str, Any] = {
            "model_dtype": case.model_dtype,
            "provider": "torch",
            "platform": "cpu",
            "indexer": self.spec,
        }
        local_max = sum(1 for p in range(MAX_LEN) if _owner(p, world, inter) == 0)
        cols_g, cols_l = -(-MAX_LEN // bs), -(-local_max // bs)
        blocks_g, blocks_l = len(requests) * cols_g + 1, len(requests) * cols_l + 1
        # The single-process backend takes the union of every rank's selection per row.
        self.reference = mla.MLABackend(
            _dims(self.global_heads, TOPK * world),
            mla.KVCacheSpec(bs, case.kv_dtype, num_blocks=blocks_g),
            LIMITS,
            **common,
        )
        self.dcp = DecodeContextParallel(
            _dims(HEADS, TOPK),
            mla.KVCacheSpec(bs, case.kv_dtype, num_blocks=blocks_l),
            LIMITS,
            group=group,
            interleave=inter,
            split_heads=case.split_heads,
            **common,
        )
        kv = self.reference.cache.dtype
        self.cache_global = self._poisoned_cache(blocks_g, kv)
        self.cache_local = self._poisoned_cache(blocks_l, kv)
        self.index_global = poisoned_index_cache(self.spec, blocks_g, bs)
        self.index_local = poisoned_index_cache(self.spec, blocks_l, bs)
        free_g, free_l = list(range(blocks_g)), list(range(blocks_l))
        rng.shuffle(free_g)
        rng.shuffle(free_l)
        self.latent = [self._randn(seq, RANK + ROPE) for seq, _ in requests]
        self.keys = [self._randn(seq, INDEX_DIM) for seq, _ in requests]
        table_g, table_l = [], []
        for seq, _ in requests:
            local_len = sum(1 for p in range(seq) if _owner(p, world, inter) == rank)
            need_g, need_l = -(-seq // bs), -(-local_len // bs)
            table_g.append([free_g.pop() for _ in range(need_g)] + [0] * (cols_g - need_g))
            table_l.append([free_l.pop() for _ in range(need_l)] + [0] * (cols_l - need_l))
        # History on both layouts.
        g_slots, l_slots, g_rows, l_rows, g_keys, l_keys = [], [], [], [], [], []
        for b, (seq, new) in enumerate(requests):
            for p in range(seq - new):
                g_slots.append(table_g[b][p // bs] * bs + p % bs)
                g_rows.append(self.latent[b][p])
                g_keys.append(self.keys[b][p])
                if _owner(p, world, inter) == rank:
                    lp = _local(p, world, inter)
                    l_slots.append(table_l[b][lp // bs] * bs + lp % bs)
                    l_rows.append(self.latent[b][p])
                    l_keys.append(self.keys[b][p])
        self._write(self.reference.impl, self.cache_global, self.index_global, g_slots, g_rows, g_keys)
        self._write(self.dcp.decode_backend.impl, self.cache_local, self.index_local, l_slots, l_rows, l_keys)
        # The step's new tokens, then the padding request and the extra padding row.
        qlens, seq_lens, slots, new_rows, new_keys = [], [], [], [], []
        self.windows: list[int | None] = []
        """Per row: positions ``0 .. window - 1`` visible, ``None`` for padding rows."""
        for b, (seq, new) in enumerate(requests):
            qlens.append(new)
            seq_lens.append(seq)
            for i, p in enumerate(range(seq - new, seq)):
                slots.append(table_g[b][p // bs] * bs + p % bs)
                new_rows.append(self.latent[b][p])
                new_keys.append(self.keys[b][p])
                self.windows.append(seq - new + i + 1)
        qlens.append(case.qlen)
        seq_lens.append(0)
        pad = case.qlen + 1
        slots += [-1] * pad
        new_rows += [torch.zeros(RANK + ROPE, dtype=case.model_dtype)] * pad
        new_keys += [torch.zeros(INDEX_DIM, dtype=case.model_dtype)] * pad
        self.windows += [None] * pad
        table_g.append(table_g[0])
        table_l.append(table_l[0])
        self.num_rows = len(slots)
        self.slots_global = torch.tensor(slots, dtype=torch.int64)
        self.new_rows = torch.stack(new_rows)
        self.new_keys = torch.stack(new_keys)
        self.qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        self.qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.table_global = torch.tensor(table_g, dtype=torch.int32)
        self.meta_global = self.reference.builder.build(self._step(self.table_global))
        self.meta_dcp = self.dcp.build(self._step(torch.tensor(table_l, dtype=torch.int32)))
        gen = self.gen
        self.index_q = torch.randn(self.num_rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(case.model_dtype)
        self.index_weights = torch.randn(self.num_rows, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5

    def _step(self, table: torch.Tensor) -> mla.StepInputs:
        requests = self.seq_lens.numel()
        return mla.StepInputs(
            query_start_loc_cpu=self.qsl,
            query_start_loc=self.qsl.clone(),
            seq_lens=self.seq_lens.clone(),
            seq_lens_cpu=self.seq_lens,
            block_table=table,
            num_decodes=requests,
            num_decode_tokens=self.num_rows,
        )

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.case.model_dtype)

    def _poisoned_cache(self, blocks: int, kv: torch.dtype) -> torch.Tensor:
        nan_rows = torch.full((blocks * self.case.block_size, RANK + ROPE), math.nan)
        cache = encode_latent_cache(nan_rows, kv, kv_lora_rank=RANK)
        return cache.view(blocks, self.case.block_size, -1)

    @staticmethod
    def _write(
        impl: Any,
        cache: torch.Tensor,
        index_cache: torch.Tensor,
        slots: list[int],
        rows: list[torch.Tensor],
        keys: list[torch.Tensor],
    ) -> None:
        if not slots:
            return
        data = torch.stack(rows)
        where = torch.tensor(slots, dtype=torch.int64)
        impl.write_kv(data[:, :RANK], data[:, RANK:], cache, where)
        impl.write_index_keys(torch.stack(keys), index_cache, where)

    def write_new_rows_globally(self) -> None:
        kv_c, k_pe = self.new_rows[:, :RANK], self.new_rows[:, RANK:]
        self.reference.impl.write_kv(kv_c, k_pe, self.cache_global, self.slots_global)
        self.reference.impl.write_index_keys(self.new_keys, self.index_global, self.slots_global)

    def union(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """This rank's selection (``dcp.index_topk``, local positions), and every rank's gathered
        and mapped to global positions: int32 ``[rows, W * TOPK]`` (``-1`` pads); plus the
        failures of the per-rank selection checks."""
        selected = torch.full((self.num_rows, TOPK), -7, dtype=torch.int32)
        self.dcp.index_topk(self.meta_dcp, self.index_q, self.index_weights, self.index_local, out=selected)
        gathered = [torch.empty_like(selected) for _ in range(self.world)]
        dist.all_gather(gathered, selected, group=self.group)
        scores = reference_index_scores(
            self.index_q,
            self.index_weights,
            self.index_global,
            self.table_global,
            self.seq_lens,
            self.qsl,
            key_dtype=self.spec.key_dtype,
            softmax_scale=self.spec.scale,
        )
        failures = []
        mapped = []
        for r, local in enumerate(gathered):
            layout = DCPLayout(self.world, r, self.case.interleave)
            positions = torch.where(local >= 0, layout.global_position(local.long()), -1)
            mapped.append(positions)
            # The rank's scores: only the positions it holds.
            mine = [s.masked_fill(layout.owner(torch.arange(s.shape[1])) != r, -math.inf) for s in scores]
            gap = selection_gap(mine, positions, TOPK)
            if gap > selection_tolerance(self.index_q.dtype):
                failures.append(f"rank {r}'s selection: gap {gap} ({self.case.label})")
            padding = [t for t, w in enumerate(self.windows) if w is None]
            if bool((local[padding] != -1).any()):
                failures.append(f"rank {r} selects positions for padding rows ({self.case.label})")
        return selected, torch.cat(mapped, dim=1).to(torch.int32), failures


def check_decode(case: Case, *, group: Any) -> list[str]:
    """Per-rank sparse decode, combined, vs the float64 sparse reference over the union."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q = case.qlen
    lengths = [q, q + 1, 13, 40] + ([1, 2] if q == 1 else [])
    sc = Scenario(case, group=group, requests=[(s, q) for s in lengths], seed=zlib.crc32(case.label.encode()))
    kv_c, k_pe = sc.new_rows[:, :RANK], sc.new_rows[:, RANK:]
    sc.dcp.write_kv(sc.meta_dcp, kv_c, k_pe, sc.cache_local)
    sc.dcp.write_index_keys(sc.meta_dcp, sc.new_keys, sc.index_local)
    sc.write_new_rows_globally()
    local, union, failures = sc.union()
    gen = torch.Generator().manual_seed(5)
    q_all = torch.randn(sc.num_rows, sc.global_heads, RANK + ROPE, generator=gen).to(case.model_dtype)
    q_rank = q_all[:, sc.heads].contiguous()
    out = torch.full((sc.num_rows, HEADS, RANK), math.nan, dtype=case.model_dtype)
    lse = torch.full((sc.num_rows, HEADS), math.nan)
    sc.dcp.forward_sparse_decode(sc.meta_dcp, q_rank, sc.cache_local, local, out=out, lse=lse)
    ref_out, ref_lse = reference_sparse(
        q_all,
        sc.cache_global,
        sc.table_global,
        sc.seq_lens,
        sc.qsl,
        union,
        softmax_scale=sc.reference.dims.scale,
        kv_lora_rank=RANK,
    )
    tol = TOLERANCE[case.model_dtype]
    rel, lse_err = _rel(out, ref_out[:, sc.heads]), _lse_err(lse, ref_lse[:, sc.heads])
    if rel > tol or lse_err > max(tol, 1e-4):
        failures.append(
            f"rank {rank}/{world} sparse decode {case.label}: rel err {rel:.3e}, lse err {lse_err:.3e}"
        )
    if sc.dcp.decode_backend.invalid_index_count() or sc.reference.invalid_index_count():
        failures.append(f"rank {rank}/{world} sparse decode {case.label}: masked positions")
    return failures


def check_layer_step(case: Case, *, group: Any) -> list[str]:
    """MLAAttention on the group (index keys written, indexer run per rank) vs the layer on the
    single-process backend with the union as ``topk_indices``; a decode, verifies of other
    lengths and a request shorter than the group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    requests = [(37, case.qlen), (9, 2), (2, 1), (20, 3), (3, 3)]
    sc = Scenario(case, group=group, requests=requests, seed=zlib.crc32(case.label.encode()) + 1)
    gen = torch.Generator().manual_seed(9)
    g = sc.global_heads
    weight = torch.randn(g * (NOPE + VDIM), RANK, generator=gen) / RANK**0.5
    reference = MLAAttention(sc.reference, weight)
    if case.split_heads:
        layer = MLAAttention(sc.dcp, weight, tp_rank=rank, tp_size=world)
    else:
        layer = MLAAttention(sc.dcp, weight)
    rows = sc.num_rows
    q_nope = torch.randn(rows, g, NOPE, generator=gen).to(case.model_dtype)
    q_pe = torch.randn(rows, g, ROPE, generator=gen).to(case.model_dtype)
    kv_c, k_pe = sc.new_rows[:, :RANK], sc.new_rows[:, RANK:]
    out = layer(
        sc.meta_dcp,
        q_nope[:, sc.heads].contiguous(),
        q_pe[:, sc.heads].contiguous(),
        kv_c,
        k_pe,
        sc.cache_local,
        index_q=sc.index_q,
        index_k=sc.new_keys,
        index_weights=sc.index_weights,
        index_cache=sc.index_local,
    )
    sc.write_new_rows_globally()
    _, union, failures = sc.union()
    ref = reference(
        sc.meta_global,
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        sc.cache_global,
        slot_mapping=sc.slots_global,
        topk_indices=union,
    )
    rel = _rel(out, ref[:, sc.heads])
    if rel > TOLERANCE[case.model_dtype]:
        failures.append(f"rank {rank}/{world} sparse layer step {case.label}: rel err {rel:.3e}")
    return failures


def check_prefill_refused(*, group: Any) -> list[str]:
    """A step with a prefill request raises InvalidInputError naming num_decodes on every rank."""
    case = Case("float32", 4, 1, 1, split_heads=True)
    sc = Scenario(case, group=group, requests=[(7, 1)], seed=3)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    seq = torch.tensor([7, 3], dtype=torch.int32)
    table = torch.zeros(2, sc.dcp.local_blocks, dtype=torch.int32)
    step = mla.StepInputs(qsl, qsl.clone(), seq.clone(), table, 1, 1, seq)
    try:
        sc.dcp.build(step)
    except mla.InvalidInputError as error:
        if error.argument == "num_decodes" and "sparse" in str(error):
            return []
        return [f"sparse prefill refused with {error!r}"]
    return ["a sparse prefill step under DCP was not refused"]


def worker(rank: int, world: int, init_file: str, plan: list[tuple[int, list[Case]]]) -> None:
    """``torch.multiprocessing.spawn`` entry, as :func:`dcp_harness.worker`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        failures: list[str] = []
        for size, selected in plan:
            count = world // size
            groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(count)]
            index = rank // size
            for case in selected[index::count]:
                failures += check_decode(case, group=groups[index])
                failures += check_layer_step(case, group=groups[index])
        failures += check_prefill_refused(group=None)
        if failures:
            raise AssertionError("\n".join(failures))
    finally:
        dist.destroy_process_group()


def spawn(world: int, plan: list[tuple[int, list[Case]]], tmp_dir: str) -> None:
    import torch.multiprocessing as mp

    init_file = os.path.join(tmp_dir, f"dcp-sparse-init-{world}")
    mp.spawn(worker, args=(world, init_file, plan), nprocs=world, join=True)
