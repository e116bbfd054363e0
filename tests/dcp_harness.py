"""Decode context parallelism checked against the single-process backend, run on every rank.

Each rank builds the same random requests (same seed everywhere), the unsharded cache and
backend of the single-process engine, and its own shard of the cache. History rows are written
to the shard at positions this file computes independently of :mod:`mla.distributed`; the
step's new rows go through ``DecodeContextParallel.write_kv``. Then:

* decode (qlen 1, or a verify of qlen 3, with graph padding): ``forward_decode`` output and LSE
  on this rank's heads against the single-process decode;
* a mixed step through :class:`~mla.layers.MLAAttention` (decodes, a verify, prefills with and
  without cached context, a context shorter than the group) against the same layer on the
  single-process backend.

Used by ``test_distributed.py`` (gloo, CPU) and its NCCL variant on GPUs.
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

import attrs
import torch
import torch.distributed as dist

import mla
from mla.distributed import DecodeContextParallel
from mla.layers import MLAAttention


@attrs.frozen
class Case:
    kv_dtype: str
    block_size: int
    interleave: int
    qlen: int
    split_heads: bool
    model_dtype: torch.dtype = torch.float32

    @property
    def label(self) -> str:
        dtype = str(self.model_dtype).removeprefix("torch.")
        heads = "split" if self.split_heads else "replicated"
        return f"{self.kv_dtype} bs{self.block_size} I{self.interleave} qlen{self.qlen} {heads} {dtype}"


@attrs.frozen
class Geometry:
    heads: int = 2
    """Heads per rank."""
    kv_lora_rank: int = 32
    rope: int = 16
    nope: int = 16
    v: int = 16
    provider: str = "torch"


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
FP8_KV_SCALE = 1.0 / 16.0


def cases() -> list[Case]:
    """Every (kv dtype, block size, interleave, qlen) combination; head modes and model dtypes
    alternate so both appear with each of the others."""
    out = []
    index = 0
    for kv_dtype in ("bf16", "fp8"):
        for block_size in (1, 16):
            for interleave in (1, 16):
                for qlen in (1, 3):
                    out.append(
                        Case(
                            kv_dtype,
                            block_size,
                            interleave,
                            qlen,
                            split_heads=index % 2 == 0,
                            model_dtype=torch.bfloat16 if index % 5 == 4 else torch.float32,
                        )
                    )
                    index += 1
    return out


def _owner(position: int, world: int, interleave: int) -> int:
    return (position // interleave) % world


def _local(position: int, world: int, interleave: int) -> int:
    return (position // (interleave * world)) * interleave + position % interleave


class Scenario:
    """One step's requests on the unsharded engine and on this rank's shard."""

    def __init__(
        self,
        case: Case,
        geo: Geometry,
        *,
        group: Any,
        device: torch.device,
        requests: list[tuple[int, int]],
        num_decodes: int,
        padding: bool,
        seed: int,
    ) -> None:
        """``requests``: ``(seq_len, new tokens)`` each, decodes first."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.case, self.device = case, device
        self.gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        bs = case.block_size
        global_heads = geo.heads * world if case.split_heads else geo.heads
        self.heads = (
            slice(rank * geo.heads, (rank + 1) * geo.heads) if case.split_heads else slice(0, geo.heads)
        )
        dims = mla.MLADims(
            num_heads=geo.heads,
            kv_lora_rank=geo.kv_lora_rank,
            qk_rope_head_dim=geo.rope,
            qk_nope_head_dim=geo.nope,
            v_head_dim=geo.v,
            softmax_scale=(geo.nope + geo.rope) ** -0.5,
        )
        self.dims_global = attrs.evolve(dims, num_heads=global_heads)
        max_len = 80
        limits = mla.EngineLimits(
            max_num_seqs=8, max_model_len=max_len, max_num_batched_tokens=64, max_decode_qlen=4
        )
        common: dict[str, Any] = {"model_dtype": case.model_dtype, "provider": geo.provider, "device": device}
        kv = mla.core.config.normalize_dtype(case.kv_dtype)
        blocks_global = len(requests) * -(-max_len // bs) + 1
        local_max = sum(1 for p in range(max_len) if _owner(p, world, case.interleave) == 0)
        blocks_local = len(requests) * -(-local_max // bs) + 1
        self.reference = mla.MLABackend(
            self.dims_global, mla.KVCacheSpec(bs, kv, num_blocks=blocks_global), limits, **common
        )
        kv = self.reference.capabilities.fp8_dtype if mla.core.config.is_fp8(kv) else kv
        self.reference = mla.MLABackend(
            self.dims_global, mla.KVCacheSpec(bs, kv, num_blocks=blocks_global), limits, **common
        )
        self.dcp = DecodeContextParallel(
            dims,
            mla.KVCacheSpec(bs, kv, num_blocks=blocks_local),
            limits,
            group=group,
            interleave=case.interleave,
            split_heads=case.split_heads,
            **common,
        )
        self.kv_scale = FP8_KV_SCALE if mla.core.config.is_fp8(kv) else None
        width = geo.kv_lora_rank + geo.rope
        self.cache_global = self._randn(blocks_global, bs, width).to(kv)
        self.cache_local = self._randn(blocks_local, bs, width).to(kv)
        free_global = list(range(blocks_global))
        free_local = list(range(blocks_local))
        rng.shuffle(free_global)
        rng.shuffle(free_local)
        self.rows = [self._randn(seq, width) for seq, _ in requests]
        table_global, table_local = [], []
        cols_global, cols_local = -(-max_len // bs), -(-local_max // bs)
        for seq, _ in requests:
            local_len = sum(1 for p in range(seq) if _owner(p, world, case.interleave) == 0)
            need_g, need_l = -(-seq // bs), -(-local_len // bs)
            row_g = [free_global.pop() for _ in range(need_g)]
            row_l = [free_local.pop() for _ in range(need_l)]
            table_global.append(row_g + [-1] * (cols_global - need_g))
            table_local.append(row_l + [-1] * (cols_local - need_l))
        self.table_global = torch.tensor(table_global, dtype=torch.int32, device=device)
        self.table_local = torch.tensor(table_local, dtype=torch.int32, device=device)
        # History (everything before the step's new tokens) on both layouts.
        g_slots, l_slots, g_rows, l_rows = [], [], [], []
        for b, (seq, new) in enumerate(requests):
            for p in range(seq - new):
                g_slots.append(table_global[b][p // bs] * bs + p % bs)
                g_rows.append(self.rows[b][p])
                if _owner(p, world, case.interleave) == rank:
                    lp = _local(p, world, case.interleave)
                    l_slots.append(table_local[b][lp // bs] * bs + lp % bs)
                    l_rows.append(self.rows[b][p])
        self._write(self.reference, self.cache_global, g_slots, g_rows)
        self._write(self.dcp.decode_backend, self.cache_local, l_slots, l_rows)
        # The step: decode requests, then (with ``padding``) a CUDA-graph padding request
        # (seq_len 0) and one extra padding row, then the prefills.
        zero = torch.zeros(width, dtype=case.model_dtype, device=device)
        assert not padding or num_decodes == len(requests), "padding only in decode-only steps"
        qlens, seq_lens, slots, new_rows = [], [], [], []
        for b, (seq, new) in enumerate(requests):
            qlens.append(new)
            seq_lens.append(seq)
            for p in range(seq - new, seq):
                slots.append(table_global[b][p // bs] * bs + p % bs)
                new_rows.append(self.rows[b][p])
        if padding:
            qlens.append(case.qlen)
            seq_lens.append(0)
            slots += [-1] * (case.qlen + 1)
            new_rows += [zero] * (case.qlen + 1)
            self.table_global = torch.cat([self.table_global, self.table_global[:1]])
            self.table_local = torch.cat([self.table_local, self.table_local[:1]])
            num_decodes += 1
        owned_decode = sum(qlens[:num_decodes])
        num_decode_tokens = owned_decode + (1 if padding else 0)
        self.slots_global = torch.tensor(slots, dtype=torch.int64, device=device)
        self.new_rows = torch.stack(new_rows)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)

        def step(table: torch.Tensor) -> mla.StepInputs:
            return mla.StepInputs(
                query_start_loc_cpu=qsl,
                query_start_loc=qsl.to(device),
                seq_lens=seq_t.to(device),
                seq_lens_cpu=seq_t,
                block_table=table,
                num_decodes=num_decodes,
                num_decode_tokens=num_decode_tokens,
            )

        self.meta_global = self.reference.builder.build(step(self.table_global))
        self.meta_dcp = self.dcp.build(step(self.table_local))
        self.num_rows = self.new_rows.shape[0]

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=self.case.model_dtype)

    def _write(
        self, backend: mla.MLABackend, cache: torch.Tensor, slots: list[int], rows: list[torch.Tensor]
    ) -> None:
        if not slots:
            return
        data = torch.stack(rows)
        lora = self.dims_global.kv_lora_rank
        backend.impl.write_kv(
            data[:, :lora],
            data[:, lora:],
            cache,
            torch.tensor(slots, dtype=torch.int64, device=self.device),
            kv_scale=self.kv_scale,
        )

    def write_new_rows(self) -> None:
        lora = self.dims_global.kv_lora_rank
        kv_c, k_pe = self.new_rows[:, :lora], self.new_rows[:, lora:]
        self.reference.impl.write_kv(kv_c, k_pe, self.cache_global, self.slots_global, kv_scale=self.kv_scale)
        self.dcp.write_kv(self.meta_dcp, kv_c, k_pe, self.cache_local, kv_scale=self.kv_scale)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)


def _lse_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    finite = torch.isfinite(ref)
    if not bool((torch.isfinite(got) == finite).all()) or bool(torch.isnan(got).any()):
        return float("inf")
    if not bool((got[~finite] == ref[~finite]).all()):
        return float("inf")
    return float((got[finite] - ref[finite]).abs().max()) if bool(finite.any()) else 0.0


def check_decode(case: Case, geo: Geometry, *, group: Any, device: torch.device) -> list[str]:
    """DCP decode vs the single-process decode; returns failure descriptions."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q = case.qlen
    lengths = [q, q + 1, 37, 70] + ([1, 2] if q == 1 else [])
    scenario = Scenario(
        case,
        geo,
        group=group,
        device=device,
        requests=[(s, q) for s in lengths],
        num_decodes=len(lengths),
        padding=True,
        seed=zlib.crc32(case.label.encode()),
    )
    scenario.write_new_rows()
    dims = scenario.dims_global
    rows = scenario.num_rows
    gen = torch.Generator().manual_seed(5)
    q_all = torch.randn(rows, dims.num_heads, dims.latent_dim, generator=gen).to(device, case.model_dtype)
    ref_out = torch.full(
        (rows, dims.num_heads, dims.kv_lora_rank), float("nan"), dtype=case.model_dtype, device=device
    )
    ref_lse = torch.full((rows, dims.num_heads), float("nan"), device=device)
    scenario.reference.impl.forward_decode(
        scenario.meta_global,
        q_all,
        scenario.cache_global,
        out=ref_out,
        lse=ref_lse,
        kv_scale=scenario.kv_scale,
    )
    heads = scenario.heads
    q_rank = q_all[:, heads].contiguous()
    out = torch.full(
        (rows, q_rank.shape[1], dims.kv_lora_rank), float("nan"), dtype=case.model_dtype, device=device
    )
    lse = torch.full((rows, q_rank.shape[1]), float("nan"), device=device)
    scenario.dcp.forward_decode(
        scenario.meta_dcp, q_rank, scenario.cache_local, out=out, lse=lse, kv_scale=scenario.kv_scale
    )
    tol = TOLERANCE[case.model_dtype]
    failures = []
    rel, lse_err = _rel(out, ref_out[:, heads]), _lse_err(lse, ref_lse[:, heads])
    if rel > tol or lse_err > max(tol, 1e-4):
        failures.append(f"rank {rank}/{world} decode {case.label}: rel err {rel:.3e}, lse err {lse_err:.3e}")
    if device.type == "cuda":
        rel = _captured_decode_error(scenario, q_rank, ref_out[:, heads])
        if rel > tol:
            failures.append(f"rank {rank}/{world} graph-replayed decode {case.label}: rel err {rel:.3e}")
    return failures


def _captured_decode_error(scenario: Scenario, q: torch.Tensor, ref: torch.Tensor) -> float:
    """Run the DCP decode with host syncs turned into errors, then capture it in a CUDA graph
    (collectives included) and replay it; return the replay's error."""
    dcp, meta, cache, scale = scenario.dcp, scenario.meta_dcp, scenario.cache_local, scenario.kv_scale
    out = torch.full_like(ref, float("nan"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        dcp.forward_decode(meta, q, cache, out=out, kv_scale=scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dcp.forward_decode(meta, q, cache, out=out, kv_scale=scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dcp.forward_decode(meta, q, cache, out=out, kv_scale=scale)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return _rel(out, ref)


def check_layer_step(case: Case, geo: Geometry, *, group: Any, device: torch.device) -> list[str]:
    """A mixed step through MLAAttention on the shard vs the single-process layer."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q = case.qlen
    requests = [(37, q), (5, 2), (29, 9), (2, 1), (6, 6)]  # decode, verify, prefills: ctx 20, ctx 1, none
    scenario = Scenario(
        case,
        geo,
        group=group,
        device=device,
        requests=requests,
        num_decodes=2,
        padding=False,
        seed=zlib.crc32(case.label.encode()) + 1,
    )
    dims = scenario.dims_global
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(
        dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=gen
    )
    weight = weight / dims.kv_lora_rank**0.5
    reference = MLAAttention(scenario.reference, weight)
    if case.split_heads:
        layer = MLAAttention(scenario.dcp, weight, tp_rank=rank, tp_size=world)
    else:
        layer = MLAAttention(scenario.dcp, weight)
    rows = scenario.num_rows
    q_nope = torch.randn(rows, dims.num_heads, dims.qk_nope_head_dim, generator=gen).to(
        device, case.model_dtype
    )
    q_pe = torch.randn(rows, dims.num_heads, dims.qk_rope_head_dim, generator=gen).to(
        device, case.model_dtype
    )
    lora = dims.kv_lora_rank
    kv_c, k_pe = scenario.new_rows[:, :lora], scenario.new_rows[:, lora:]
    ref = reference(
        scenario.meta_global,
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        scenario.cache_global,
        slot_mapping=scenario.slots_global,
        kv_scale=scenario.kv_scale,
    )
    heads = scenario.heads
    out = layer(
        scenario.meta_dcp,
        q_nope[:, heads].contiguous(),
        q_pe[:, heads].contiguous(),
        kv_c,
        k_pe,
        scenario.cache_local,
        kv_scale=scenario.kv_scale,
    )
    rel = _rel(out, ref[:, heads])
    if rel <= TOLERANCE[case.model_dtype]:
        return []
    return [f"rank {rank}/{world} layer step {case.label}: rel err {rel:.3e}"]


def worker(
    rank: int, world: int, init_file: str, backend: str, geo: Geometry, plan: list[tuple[int, list[Case]]]
) -> None:
    """``torch.multiprocessing.spawn`` entry: for each ``(group size, cases)`` of ``plan`` the
    ranks split into consecutive groups of that size (each a DCP group), group ``g`` of ``n``
    running ``cases[g::n]``; raises on any failure."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        failures: list[str] = []
        for size, selected in plan:
            count = world // size
            # Every rank creates every group, in the same order (a torch.distributed rule).
            groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(count)]
            index = rank // size
            for case in selected[index::count]:
                for check in (check_decode, check_layer_step):
                    failures += check(case, geo, group=groups[index], device=device)
        if failures:
            raise AssertionError("\n".join(failures))
    finally:
        dist.destroy_process_group()


def spawn(world: int, backend: str, geo: Geometry, plan: list[tuple[int, list[Case]]], tmp_dir: str) -> None:
    import torch.multiprocessing as mp

    init_file = os.path.join(tmp_dir, f"dcp-init-{world}-{backend}")
    mp.spawn(worker, args=(world, init_file, backend, geo, plan), nprocs=world, join=True)
