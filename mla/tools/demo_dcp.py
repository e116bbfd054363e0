"""``mla demo --dcp N``: the serving loop with its KV cache sharded over ``N`` processes.

Every rank runs the same loop (same seed, so the same requests, schedule and data) with the
single-process backend and cache as its reference, plus its shard: a
:class:`~mla.distributed.DecodeContextParallel` over ``heads / N`` heads, a local cache holding
its tokens (block ids allocated by the loop for the local shares), new rows written only on their
owning rank. Each step's decode and prefill run on the shards (collectives over gloo on a CPU,
NCCL on GPUs) and are compared, head slice by head slice, with the single-process outputs of
the same step. A cached prefix is copied from the single-process cache into the shards (an
engine's prefix cache would hold it sharded already).
"""

from __future__ import annotations

import os
import queue
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla.core.config import KVCacheSpec
from mla.distributed import DCPMetadata, DecodeContextParallel
from mla.engine.backend import StepInputs
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.tools.demo import LatentUpProjection, ServingLoop
from mla.tools.demo_records import (
    DemoConfig,
    DemoReport,
    PhaseStats,
    Request,
    ScheduledStep,
    StepRecord,
    _PhaseTally,
)

FP8_PREFILL_TOLERANCE = 0.1
"""The fp8 prefill quantizes q/k/v per tensor; a rank's tensor holds only its heads, so its
scales (and rounding) differ from the single-process run's at fp8 precision."""


class DCPServingLoop(ServingLoop):
    """One rank of ``mla demo --dcp``: the single-process loop plus this rank's shard."""

    def __init__(self, config: DemoConfig) -> None:
        super().__init__(config)
        world, rank = dist.get_world_size(), dist.get_rank()
        per_rank = config.heads // world
        self.heads = slice(rank * per_rank, (rank + 1) * per_rank)
        num_blocks = self.kv_cache.shape[0]
        self.dcp = DecodeContextParallel(
            attrs.evolve(self.dims, num_heads=per_rank),
            KVCacheSpec(config.block_size, self.kv_dtype, num_blocks=num_blocks),
            self.limits,
            interleave=config.dcp_interleave,
            split_heads=True,
            model_dtype=self.model_dtype,
            provider=self.provider,
            platform=self.platform,
            device=self.device,
            context_chunk_tokens=self.backend.context_chunk_tokens,
        )
        # The shard's own random stream and allocator: the single-process loop's stay untouched.
        gen = torch.Generator().manual_seed(config.seed + 1)
        shape = (num_blocks, config.block_size, self.dims.latent_dim)
        self.local_cache = torch.randn(*shape, generator=gen).to(device=self.device, dtype=self.kv_dtype)
        self.local_free = list(range(num_blocks))
        random.Random(config.seed + 1).shuffle(self.local_free)
        self.local_blocks: dict[int, list[int]] = {}
        self.project_rank = LatentUpProjection(self.project.w_uk[self.heads], self.project.w_uv[self.heads])
        tol = self.decode_tally.tolerance
        self.dcp_tallies = {
            "decode": _PhaseTally("dcp decode", tol),
            "prefill": _PhaseTally("dcp prefill", tol),
            "prefill-fp8": _PhaseTally("dcp prefill (fp8 q/k/v)", max(tol, FP8_PREFILL_TOLERANCE)),
        }
        self.metadata: DCPMetadata | None = None

    # -- the shard's cache -------------------------------------------------------------------

    def _local_row(self, request: Request, length: int) -> list[int]:
        """The request's local block ids, covering rank 0's (the largest) share of ``length``."""
        layout, bs = self.dcp.layout, self.config.block_size
        first_seen = request.rid not in self.local_blocks
        blocks = self.local_blocks.setdefault(request.rid, [])
        while len(blocks) * bs < layout.max_local_length(length):
            blocks.append(self.local_free.pop())
        if first_seen and request.computed:
            self._copy_prefix(request, blocks)
        return blocks

    def _copy_prefix(self, request: Request, blocks: list[int]) -> None:
        layout, bs, width = self.dcp.layout, self.config.block_size, self.dims.latent_dim
        positions = torch.arange(request.computed)
        mine = positions[layout.owner(positions) == layout.rank]
        if not mine.numel():
            return
        local = layout.local_position(mine)
        table = torch.tensor(blocks, dtype=torch.int64)
        target = (table[local // bs] * bs + local % bs).to(self.device)
        source = torch.tensor(self._slots(request, 0, request.computed), dtype=torch.int64)[mine]
        flat_local = self.local_cache.view(-1, width).view(torch.uint8)
        flat_local[target] = self.kv_cache.view(-1, width).view(torch.uint8)[source.to(self.device)]

    def _release_finished(self) -> None:
        live = {request.rid for request in self.requests}
        for rid in [rid for rid in self.local_blocks if rid not in live]:
            self.local_free.extend(self.local_blocks.pop(rid))

    # -- hooks ------------------------------------------------------------------------------

    def _on_step(self, sched: ScheduledStep, inputs: StepInputs, latent: torch.Tensor) -> None:
        self._release_finished()
        rows: list[list[int]] = [self._local_row(r, r.computed + q) for r, q in sched.decodes]
        rows += [[] for _ in range(sched.padding_requests)]
        rows += [self._local_row(r, r.computed + q) for r, q in sched.prefills]
        width = max(1, *(len(row) for row in rows))
        table = torch.full((len(rows), width), -1, dtype=torch.int32)
        for index, row in enumerate(rows):
            table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.metadata = self.dcp.build(attrs.evolve(inputs, block_table=table.to(self.device)))
        rank = self.dims.kv_lora_rank
        self.dcp.write_kv(
            self.metadata, latent[:, :rank], latent[:, rank:], self.local_cache, kv_scale=self.kv_scale
        )

    def _on_decode(self, index: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        assert self.metadata is not None
        assert self.metadata.decode is not None
        assert self.metadata.decode.decode is not None
        q_rank = q[:, self.heads].contiguous()
        got = torch.full(
            (*q_rank.shape[:2], self.dims.kv_lora_rank), float("nan"), dtype=out.dtype, device=out.device
        )
        got_lse = torch.full(q_rank.shape[:2], float("nan"), dtype=torch.float32, device=out.device)
        self.dcp.forward_decode(
            self.metadata, q_rank, self.local_cache, out=got, lse=got_lse, kv_scale=self.kv_scale
        )
        # Against the float64 reference, as the unsharded decode is: the sharded error is then
        # comparable with the unsharded one (its own rounding is not counted twice).
        ref_out, ref_lse = self.decode_reference
        self._record(
            self.dcp_tallies["decode"],
            index,
            self.metadata.decode.decode.strategy,
            q.shape[0],
            (got, got_lse),
            (ref_out[:, self.heads], ref_lse[:, self.heads]),
        )

    def _on_prefill(
        self,
        index: int,
        strategy: str,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        assert self.metadata is not None
        assert self.metadata.prefill is not None
        assert self.metadata.prefill.prefill is not None
        q, k, v = (x[:, self.heads].contiguous() for x in qkv)
        got = torch.full(
            (q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=out.dtype, device=out.device
        )
        got_lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=out.device)
        self.dcp.forward_prefill(
            self.metadata,
            q,
            k,
            v,
            out=got,
            lse=got_lse,
            kv_cache=self.local_cache,
            kv_scale=self.kv_scale,
            expand_context=self.project_rank,
        )
        name = self.metadata.prefill.prefill.strategy
        fp8 = Fp8PersistentPrefill.NAME in (name, strategy)
        tally = self.dcp_tallies["prefill-fp8" if fp8 else "prefill"]
        self._record(tally, index, name, q.shape[0], (got, got_lse), (out[:, self.heads], lse[:, self.heads]))

    def report(self, steps: int, wall: float) -> DemoReport:
        extra = tuple(t.stats() for t in self.dcp_tallies.values() if t.steps)
        return attrs.evolve(super().report(steps, wall), extra=extra)


def _rank_device(config: DemoConfig, rank: int) -> tuple[str, str]:
    """(torch device, process-group backend) of one rank."""
    if config.device is not None:
        device = torch.device(config.device)
    elif config.arch is None and torch.cuda.is_available():
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    return str(device), "nccl" if device.type == "cuda" else "gloo"


def _serve_rank(rank: int, config: DemoConfig, init_file: str, messages: Any) -> None:
    """One spawned rank: serve every step, report progress (rank 0) and the final report."""
    try:
        device, backend = _rank_device(config, rank)
        if backend == "gloo":
            torch.set_num_threads(1)  # N processes share the host's cores
        else:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=config.dcp)
        try:
            start = time.perf_counter()
            loop = DCPServingLoop(attrs.evolve(config, device=device))
            for index in range(config.steps):
                record = loop.step(index)
                if rank == 0:
                    messages.put(("step", rank, record))
            messages.put(("report", rank, loop.report(config.steps, time.perf_counter() - start)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))


def _merge(reports: dict[int, DemoReport], wall: float) -> DemoReport:
    """Rank 0's report, with every rank's shard failures and the worst shard errors."""
    base = reports[0]
    # The single-process checks are the same on every rank; the shard checks are each rank's.
    failures = [f for f in base.failures if not f.phase.startswith("dcp")]
    extra: dict[str, PhaseStats] = {}
    for rank, report in sorted(reports.items()):
        failures += [
            attrs.evolve(f, phase=f"{f.phase} rank {rank}")
            for f in report.failures
            if f.phase.startswith("dcp")
        ]
        for stats in report.extra:
            seen = extra.setdefault(stats.phase, stats)
            extra[stats.phase] = attrs.evolve(
                seen,
                max_rel_error=max(seen.max_rel_error, stats.max_rel_error),
                max_lse_error=max(seen.max_lse_error, stats.max_lse_error),
            )
    return attrs.evolve(base, failures=tuple(failures), extra=tuple(extra.values()), wall_seconds=wall)


def run_dcp_demo(config: DemoConfig, progress: Callable[[StepRecord], None] | None = None) -> DemoReport:
    """:func:`mla.tools.demo.run_demo` over ``config.dcp`` processes (see the module docstring).

    A configuration the backend cannot serve raises here, before any process starts; a rank
    that fails otherwise raises :class:`RuntimeError` with its traceback.
    """
    ServingLoop(attrs.evolve(config, dcp=1))  # surfaces UnsupportedError etc. in this process
    start = time.perf_counter()
    context = mp.get_context("spawn")
    messages = context.Queue()
    reports: dict[int, DemoReport] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "dcp-init")
        ranks = [
            context.Process(target=_serve_rank, args=(rank, config, init_file, messages))
            for rank in range(config.dcp)
        ]
        for process in ranks:
            process.start()
        try:
            while len(reports) < config.dcp:
                try:
                    kind, rank, payload = messages.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in ranks if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a demo rank exited with code {dead[0].exitcode}") from None
                    continue
                if kind == "error":
                    raise RuntimeError(f"demo rank {rank} failed:\n{payload}")
                if kind == "step" and progress is not None:
                    progress(payload)
                elif kind == "report":
                    reports[rank] = payload
        finally:
            for process in ranks:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    return _merge(reports, time.perf_counter() - start)
