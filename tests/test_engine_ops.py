"""The engine path: custom ops under torch.compile, builds without device-to-host copies, chunked
context sized by the batch, the top-level write_kv.

The compiled layers are small MLA layers (projection -> write_kv -> attention -> output
projection) compiled with ``fullgraph=True`` and compared with eager; a second step with new
metadata must reuse the compiled graph (the ops read the backend's current plan, so nothing about
the metadata is baked into the graph).
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs
import pytest
import torch
from gpu_providers import gpu_providers
from torch import nn
from torch._dynamo.utils import counters

import mla
from mla.engine.functional import plan_cache
from mla.testing import assert_matches_reference, emulated_provider, reference_provider_with
from mla.tools.reference import reference_decode

RANK, ROPE, HEADS, HIDDEN = 64, 16, 4, 32
NOPE, VDIM = 24, 32
BLOCK, NUM_BLOCKS = 16, 12
SCALE = 0.125


def _backend(**options: Any) -> mla.MLABackend:
    settings: dict[str, Any] = {"model_dtype": torch.float32, "provider": "torch", "platform": "cpu"}
    settings.update(options)
    limits = settings.pop("limits", mla.EngineLimits(4, 64, 64, max_decode_qlen=1))
    return mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, NOPE, VDIM, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=NUM_BLOCKS),
        limits,
        **settings,
    )


def _step(qlens: list[int], seq_lens: list[int], num_decodes: int, device: str = "cpu") -> mla.StepInputs:
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(3, -(-max(seq_lens) // BLOCK))
    table = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(len(seq_lens), width) % NUM_BLOCKS
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        block_table=table.to(device),
        num_decodes=num_decodes,
        num_decode_tokens=int(qsl[num_decodes]),
    )


def _slots(step: mla.StepInputs) -> torch.Tensor:
    """Flat cache slots of each step's new tokens (the last ``qlen`` positions of each request)."""
    qsl, lens = step.query_start_loc_cpu.tolist(), step.seq_lens_cpu
    assert lens is not None
    table = step.block_table.cpu()
    slots = []
    for b in range(len(qsl) - 1):
        qlen, seq = qsl[b + 1] - qsl[b], int(lens[b])
        for pos in range(seq - qlen, seq):
            slots.append(int(table[b, pos // BLOCK]) * BLOCK + pos % BLOCK)
    return torch.tensor(slots, dtype=torch.int64)


class DecodeLayer(nn.Module):
    """q/kv projection -> write_kv -> absorbed decode -> output projection.

    ``attention`` (when given) is a static ``[T, H, L]`` buffer that receives the decode output,
    so a test can compare it with the reference math.
    """

    def __init__(
        self, backend: mla.MLABackend, hidden: int = HIDDEN, attention: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.backend = backend
        dims = backend.dims
        self.heads, self.rank, self.rope = dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim
        self.q_proj = nn.Linear(hidden, self.heads * (self.rank + self.rope))
        self.kv_proj = nn.Linear(hidden, self.rank + self.rope)
        self.o_proj = nn.Linear(self.heads * self.rank, hidden)
        self.attention = attention

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x).view(x.shape[0], self.heads, self.rank + self.rope)

    def forward(
        self, metadata: mla.MLAMetadata, x: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.project_q(x)
        kv = self.kv_proj(x)
        self.backend.impl.write_kv(kv[:, : self.rank], kv[:, self.rank :], kv_cache, slots)
        out = self.attention
        if out is None:
            out = torch.empty(tokens, self.heads, self.rank, dtype=x.dtype, device=x.device)
        self.backend.impl.forward_decode(metadata, q, kv_cache, out=out)
        return self.o_proj(out.view(tokens, self.heads * self.rank))


class PrefillLayer(nn.Module):
    """MHA prefill with cached context expanded by the layer's own up-projection."""

    def __init__(self, backend: mla.MLABackend) -> None:
        super().__init__()
        self.backend = backend
        self.q_proj = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE))
        self.kv_proj = nn.Linear(HIDDEN, RANK + ROPE)
        self.kv_b_proj = nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=False)
        self.o_proj = nn.Linear(HEADS * VDIM, HIDDEN)
        self.expander = mla.register_context_expander(self.expand)
        self.expanded_rows: list[int] = []

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The context expander: records how many rows it was given."""
        self.expanded_rows.append(latent.shape[0])
        return self.up_project(latent)

    def up_project(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = latent.shape[0]
        kv = self.kv_b_proj(latent[:, :RANK]).view(rows, HEADS, NOPE + VDIM)
        k_pe = latent[:, None, RANK:].expand(rows, HEADS, ROPE)
        return torch.cat([kv[..., :NOPE], k_pe], dim=-1), kv[..., NOPE:].contiguous()

    def forward(
        self, metadata: mla.MLAMetadata, x: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, HEADS, NOPE + ROPE)
        kv = self.kv_proj(x)
        self.backend.impl.write_kv(kv[:, :RANK], kv[:, RANK:], kv_cache, slots)
        k, v = self.up_project(kv)
        out = torch.empty(tokens, HEADS, VDIM, dtype=x.dtype, device=x.device)
        self.backend.impl.forward_prefill(
            metadata, q, k, v, out=out, kv_cache=kv_cache, expand_context=self.expander
        )
        return self.o_proj(out.view(tokens, HEADS * VDIM))


def _run_compiled_steps(
    layer: nn.Module, steps: list[mla.StepInputs], *, prefill: bool, backend_name: str = "inductor"
) -> None:
    """Run each step eagerly and compiled on separate caches; outputs and caches must agree and
    the compiled layer must compile exactly once."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend=backend_name)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    backend: mla.MLABackend = layer.backend  # type: ignore[assignment]
    for index, step in enumerate(steps):
        tokens = int(step.query_start_loc_cpu[-1]) if prefill else step.num_decode_tokens
        x = torch.randn(tokens, HIDDEN, generator=gen)
        slots = _slots(step)
        metadata = backend.builder.build(step)
        with torch.no_grad():
            expected = layer(metadata, x, eager_cache, slots)
            got = compiled(metadata, x, compiled_cache, slots)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"step {index}")
        torch.testing.assert_close(compiled_cache, eager_cache, msg=f"cache after step {index}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    explanation = torch._dynamo.explain(layer)(metadata, x, compiled_cache.clone(), slots)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_decode_layer_matches_eager_without_recompiling() -> None:
    backend = _backend()
    layer = DecodeLayer(backend)
    steps = [_step([1, 1, 1], [20, 37, 5], 3), _step([1, 1, 1], [33, 2, 48], 3)]
    _run_compiled_steps(layer, steps, prefill=False)


def test_compiled_prefill_layer_with_cached_context_matches_eager() -> None:
    backend = _backend()
    layer = PrefillLayer(backend)
    # Two prefill requests with cached context, then the same token count with other lengths.
    steps = [_step([3, 4], [10, 4], 0), _step([3, 4], [30, 6], 0)]
    # aot_eager: Dynamo and the functionalization of the mutating ops, without the slow C++
    # codegen of Inductor on a CPU (the decode test above and the GPU tests use Inductor).
    _run_compiled_steps(layer, steps, prefill=True, backend_name="aot_eager")
    # Every expansion saw exactly the step's context rows (eager and compiled alike).
    assert set(layer.expanded_rows) == {7, 27 + 2}


def test_decode_op_reads_the_current_plan_and_rejects_stale_metadata() -> None:
    backend = _backend()
    first = backend.builder.build(_step([1, 1], [20, 37], 2))
    second = backend.builder.build(_step([1, 1], [5, 9], 2))
    assert backend.current_metadata is second
    q = torch.randn(2, HEADS, RANK + ROPE)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE)
    out = torch.full((2, HEADS, RANK), math.nan)
    with pytest.raises(mla.PlanMismatchError, match="current metadata"):
        backend.impl.forward_decode(first, q, cache, out=out)
    assert torch.isnan(out).all()
    lse = torch.full((2, HEADS), math.nan)
    mla.engine.backend.ops.decode(q, cache, out, lse, None, backend.op_id)
    step = _step([1, 1], [5, 9], 2)
    ref = reference_decode(
        q,
        cache,
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        softmax_scale=SCALE,
        kv_lora_rank=RANK,
    )
    assert_matches_reference(out, lse, *ref, context="op after rebuild")


# -- builds without device-to-host copies ------------------------------------------------------


@pytest.mark.parametrize("emulate", ["torch", "aiter"])
@pytest.mark.parametrize("host_lens", [True, False], ids=["host-lens", "device-lens"])
def test_fast_build_copies_nothing_from_the_device(emulate: str, host_lens: bool) -> None:
    """The step's device tensors live on the meta device, which has no data: any device-to-host
    copy, ``.item()`` or ``bool()`` on them (or on anything computed from them) raises.

    torch: the reference capabilities' choices; aiter emulation (16 heads, bf16): the padded
    persistent paged decode with qlen padding and a device-planned schedule.
    """
    backend = mla.MLABackend(
        mla.MLADims(16, RANK, ROPE, NOPE, VDIM, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.bfloat16, num_blocks=NUM_BLOCKS),
        mla.EngineLimits(4, 64, 64, max_decode_qlen=2),
        model_dtype=torch.bfloat16,
        provider=emulated_provider(emulate, "gfx950"),
        platform="gfx950",
        device="meta",
    )
    for qlens, lens in (([1, 1, 1], [20, 37, 5]), ([2, 2], [20, 37]), ([2, 1], [20, 37])):
        step = _step(qlens, lens, len(lens), device="meta")
        if not host_lens:
            step = attrs.evolve(step, seq_lens_cpu=None)
        metadata = backend.builder.build(step)
        assert metadata.decode is not None


def test_full_validation_reads_the_device_and_checks_block_ids() -> None:
    backend = _backend(device="meta", validate="full")
    with pytest.raises(NotImplementedError):
        backend.builder.build(_step([1, 1], [20, 37], 2, device="meta"))
    cpu_backend = _backend(validate="full")
    step = _step([1, 1], [20, 37], 2)
    step.block_table[1, 1] = NUM_BLOCKS
    with pytest.raises(mla.InvalidInputError, match="outside the cache"):
        cpu_backend.builder.build(step)
    _backend().builder.build(step)  # the fast default trusts block ids


@pytest.mark.parametrize("token_ids", [False, True], ids=["block-table", "per-token"])
def test_device_planned_indices_match_host_planned(token_ids: bool) -> None:
    """Without ``seq_lens_cpu`` a decode step plans its page indices on the device; the plan
    reads the same cache rows as the host-planned one (the same flat ids, for kernels that take
    them; no per-token list at all for kernels that read the block table)."""
    provider = reference_provider_with(decode_reads_block_table=not token_ids)
    backend = _backend(limits=mla.EngineLimits(4, 48, 64), provider=provider)
    step = _step([1, 1, 1], [20, 37, 0], 3)
    host_plan = backend.builder.build(step).decode
    assert host_plan is not None
    host_indptr = host_plan.kv_indptr.clone()
    if not token_ids:
        assert host_plan.kv_indices is None
        assert backend.index_buffers.kv_indices is None
    host_indices = (
        None if host_plan.kv_indices is None else host_plan.kv_indices[: int(host_indptr[-1])].clone()
    )
    device_step = mla.StepInputs(
        query_start_loc_cpu=step.query_start_loc_cpu,
        query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        num_decodes=3,
        num_decode_tokens=3,
    )
    device_plan = backend.builder.build(device_step).decode
    assert device_plan is not None
    torch.testing.assert_close(device_plan.kv_indptr, host_indptr)
    if host_indices is not None:
        assert device_plan.kv_indices is not None
        torch.testing.assert_close(device_plan.kv_indices[: int(host_indptr[-1])], host_indices)


# -- work sized by the batch --------------------------------------------------------------------


def test_expand_context_sees_exactly_the_cached_rows() -> None:
    """25 cached tokens are up-projected as 25 rows, with the engine limits of the docs."""
    backend = mla.MLABackend(
        mla.MLADims(HEADS, RANK, ROPE, NOPE, VDIM, softmax_scale=SCALE),
        mla.KVCacheSpec(BLOCK, torch.float32, num_blocks=NUM_BLOCKS),
        mla.EngineLimits(256, 32768, 8192),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
    )
    assert backend.context_chunk_tokens == 64 * 1024
    step = _step([5], [30], 0)
    metadata = backend.builder.build(step)
    rows: list[int] = []

    def expand(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows.append(latent.shape[0])
        return torch.randn(latent.shape[0], HEADS, NOPE + ROPE), torch.randn(latent.shape[0], HEADS, VDIM)

    q, k = torch.randn(5, HEADS, NOPE + ROPE), torch.randn(5, HEADS, NOPE + ROPE)
    out = torch.empty(5, HEADS, VDIM)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE)
    backend.impl.forward_prefill(
        metadata, q, k, torch.randn(5, HEADS, VDIM), out=out, kv_cache=cache, expand_context=expand
    )
    assert rows == [25]


def test_context_chunks_split_only_past_the_workspace() -> None:
    backend = _backend(context_chunk_tokens=4 * BLOCK, limits=mla.EngineLimits(4, 160, 256))
    step = _step([2, 2], [90, 12], 0)
    plan = backend.builder.build(step).prefill
    assert plan is not None
    counts = [chunk.num_tokens for chunk in plan.context_chunks]
    assert sum(counts) == 88 + 10
    assert all(chunk.token_indices.numel() == chunk.num_tokens for chunk in plan.context_chunks)
    assert max(counts) <= 4 * BLOCK


def test_two_token_decode_with_large_limits_is_sized_by_the_batch() -> None:
    """A 2-token decode on a backend built for 256 sequences of 32k tokens (torch provider
    under the aiter emulation's persistent split-KV schedule): the kernels are launched for the
    batch's longest sequence and the schedule's live items, not for ``max_model_len`` and the
    schedule's capacity. Took 22-64 s per step when sized by the limits."""
    backend = mla.MLABackend(
        mla.MLADims(16, softmax_scale=192**-0.5),
        mla.KVCacheSpec(64, torch.bfloat16, num_blocks=64),
        mla.EngineLimits(256, 32768, 32768),
        provider=emulated_provider("aiter", "gfx950"),
        platform="gfx950",
        device="cpu",
    )
    qsl, lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([10, 20], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl,
        seq_lens=lens,
        seq_lens_cpu=lens,
        block_table=table,
        num_decodes=2,
        num_decode_tokens=2,
    )
    q = torch.randn(2, 16, 576).to(torch.bfloat16)
    cache = torch.randn(64, 64, 576).to(torch.bfloat16)
    out, lse = torch.empty(2, 16, 512, dtype=torch.bfloat16), torch.empty(2, 16)
    start = time.perf_counter()
    metadata = backend.builder.build(step)
    backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse)
    elapsed = time.perf_counter() - start
    assert metadata.decode is not None
    assert metadata.decode.strategy == "asm-padded-persistent"
    assert metadata.decode.geometry.max_seqlen_k == 20
    ref = reference_decode(q, cache, table, lens, qsl, softmax_scale=backend.dims.scale)
    assert_matches_reference(out, lse, *ref, context="2-token decode, large limits")
    assert elapsed < 1.0, f"build + decode took {elapsed:.2f} s"  # the generous bound


# -- write_kv -----------------------------------------------------------------------------------


def test_write_kv_matches_a_plain_scatter_and_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    expected = cache.clone()
    kv_c, k_pe = torch.randn(3, RANK, generator=gen), torch.randn(3, ROPE, generator=gen)
    slots = torch.tensor([5, -1, 40])
    mla.write_kv(kv_c, k_pe, cache, slots, provider="torch")
    flat = expected.view(-1, RANK + ROPE)
    flat[5] = torch.cat([kv_c[0], k_pe[0]])
    flat[40] = torch.cat([kv_c[2], k_pe[2]])
    torch.testing.assert_close(cache, expected)


def test_write_kv_fp8_with_a_device_scale() -> None:
    cache = torch.zeros(NUM_BLOCKS, BLOCK, RANK + ROPE, dtype=torch.float8_e4m3fn)
    kv_c, k_pe = torch.full((1, RANK), 0.5), torch.full((1, ROPE), -0.25)
    mla.write_kv(kv_c, k_pe, cache, torch.tensor([7]), kv_scale=torch.tensor(0.25), provider="torch")
    row = cache.view(-1, RANK + ROPE)[7].float()
    torch.testing.assert_close(row, torch.cat([torch.full((RANK,), 2.0), torch.full((ROPE,), -1.0)]))


@pytest.mark.parametrize(
    ("argument", "change", "match"),
    [
        ("kv_c", {"kv_c": torch.randn(2, 3, RANK)}, "expected 2 dims"),
        ("k_pe", {"k_pe": torch.randn(3, ROPE)}, "3 rows"),
        ("slot_mapping", {"slot_mapping": torch.tensor([1.0, 2.0])}, "int32 or int64"),
        ("slot_mapping", {"slot_mapping": torch.tensor([1, 2, 3])}, "3 entries"),
        ("kv_cache", {"kv_cache": torch.zeros(NUM_BLOCKS, BLOCK, RANK)}, "last dim"),
        ("slot_mapping", {"slot_mapping": torch.tensor([1, 2], device="meta")}, "is on meta"),
        (
            "kv_scale",
            {"kv_cache": torch.zeros(NUM_BLOCKS, BLOCK, RANK + ROPE, dtype=torch.float8_e4m3fn)},
            "needs",
        ),
        ("kv_scale", {"kv_scale": 0.5}, "only fp8"),
    ],
)
def test_write_kv_rejects_bad_input(argument: str, change: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "kv_c": torch.randn(2, RANK),
        "k_pe": torch.randn(2, ROPE),
        "kv_cache": torch.zeros(NUM_BLOCKS, BLOCK, RANK + ROPE),
        "slot_mapping": torch.tensor([1, 2]),
    }
    args.update(change)
    with pytest.raises(mla.InvalidInputError, match=match) as info:
        mla.write_kv(provider="torch", **args)
    assert info.value.argument == argument


# -- functional API --------------------------------------------------------------------------------


def test_mla_decode_reuses_its_plan_and_writes_given_outputs() -> None:
    plan_cache.DECODE_PLANS.clear()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, HEADS, RANK + ROPE, generator=gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    table = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32)
    args: dict[str, Any] = {
        "softmax_scale": SCALE,
        "kv_lora_rank": RANK,
        "provider": "torch",
        "platform": "cpu",
    }
    for lens in ([20, 37], [48, 1]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        out = torch.full((2, HEADS, RANK), math.nan)
        lse = torch.full((2, HEADS), math.nan)
        got = mla.mla_decode(q, cache, table, seq_lens, out=out, lse=lse, **args)
        assert got[0] is out
        assert got[1] is lse
        ref = reference_decode(q, cache, table, seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK)
        assert_matches_reference(out, lse, *ref, context=f"lens {lens}")
        only_out = mla.mla_decode(q, cache, table, seq_lens, return_lse=False, **args)
        assert isinstance(only_out, torch.Tensor)
        torch.testing.assert_close(only_out, out)
    assert len(plan_cache.DECODE_PLANS) == 1


def test_mla_decode_plan_cache_is_bounded() -> None:
    plan_cache.DECODE_PLANS.clear()
    cache = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE)
    for batch in range(1, plan_cache.PLAN_CACHE_SIZE + 4):
        q = torch.randn(batch, HEADS, RANK + ROPE)
        table = torch.zeros(batch, 1, dtype=torch.int32)
        lens = torch.ones(batch, dtype=torch.int32)
        mla.mla_decode(q, cache, table, lens, softmax_scale=SCALE, kv_lora_rank=RANK, provider="torch")
    assert len(plan_cache.DECODE_PLANS) == plan_cache.PLAN_CACHE_SIZE


def test_mla_decode_device_kv_scale() -> None:
    gen = torch.Generator().manual_seed(6)
    values = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=gen)
    cache = (values / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = torch.randn(2, HEADS, RANK + ROPE, generator=gen)
    table = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32)
    lens = torch.tensor([20, 37], dtype=torch.int32)
    args: dict[str, Any] = {"softmax_scale": SCALE, "kv_lora_rank": RANK, "provider": "torch"}
    for scale in (torch.tensor(0.05), torch.tensor([0.05])):
        out, lse = mla.mla_decode(q, cache, table, lens, kv_scale=scale, **args)
        ref = reference_decode(q, cache, table, lens, softmax_scale=SCALE, kv_lora_rank=RANK, kv_scale=0.05)
        assert_matches_reference(out, lse, *ref, context=f"kv_scale {tuple(scale.shape)}")
    with pytest.raises(mla.InvalidInputError, match="one-element") as info:
        mla.mla_decode(q, cache, table, lens, kv_scale=torch.ones(2), **args)
    assert info.value.argument == "kv_scale"


def test_mla_prefill_reuses_its_plan_and_accepts_outputs() -> None:
    plan_cache.PREFILL_PLANS.clear()
    gen = torch.Generator().manual_seed(7)
    q, k = (
        torch.randn(6, HEADS, NOPE + ROPE, generator=gen),
        torch.randn(6, HEADS, NOPE + ROPE, generator=gen),
    )
    v = torch.randn(6, HEADS, VDIM, generator=gen)
    for cu in ([0, 2, 6], [0, 5, 6]):
        cu_t = torch.tensor(cu, dtype=torch.int32)
        out = torch.full((6, HEADS, VDIM), math.nan)
        got = mla.mla_prefill(
            q, k, v, cu_t, cu_t, 5, 5, softmax_scale=SCALE, provider="torch", out=out, return_lse=False
        )
        assert got is out
        assert not torch.isnan(out).any()
    assert len(plan_cache.PREFILL_PLANS) == 1


# -- GPU: compiled steps in CUDA graphs, no syncs in builds ---------------------------------------


G_HEADS, G_BLOCK, G_SEQS, G_MAX_LEN, G_HIDDEN = 16, 64, 4, 1024, 256


def _gpu_backend(provider: str, kv_dtype: torch.dtype = torch.bfloat16) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(G_HEADS, 512, 64, softmax_scale=0.07),
        mla.KVCacheSpec(G_BLOCK, kv_dtype, num_blocks=G_SEQS * G_MAX_LEN // G_BLOCK),
        mla.EngineLimits(G_SEQS, G_MAX_LEN, G_SEQS, graph_mode=mla.GraphMode.FULL),
        model_dtype=torch.bfloat16,
        provider=provider,
        device="cuda",
    )


def _gpu_step(
    backend: mla.MLABackend, seq_lens: torch.Tensor, table: torch.Tensor, lens: list[int]
) -> mla.StepInputs:
    """Write a new batch into the static ``seq_lens``/``table`` buffers; the last request is a
    graph-padding one."""
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    perm = torch.randperm(table.numel())
    table.copy_(perm.view_as(table).to(torch.int32))
    qsl = torch.arange(G_SEQS + 1, dtype=torch.int32)
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.cuda(),
        seq_lens=seq_lens,
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        block_table=table,
        num_decodes=G_SEQS,
        num_decode_tokens=G_SEQS,
    )


def _step_slots(step: mla.StepInputs) -> torch.Tensor:
    """Slot of each request's newest token (-1 for a graph-padding request)."""
    lens = step.seq_lens_cpu
    assert lens is not None
    table = step.block_table.cpu()
    slots = [
        int(table[b, (s - 1) // G_BLOCK]) * G_BLOCK + (s - 1) % G_BLOCK if s > 0 else -1
        for b, s in enumerate(lens.tolist())
    ]
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_compiled_decode_step_replays_in_a_cuda_graph_after_rebuild(provider: str) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    backend = _gpu_backend(provider)
    num_blocks = backend.cache.num_blocks or 0
    cache = torch.randn(num_blocks, G_BLOCK, 576, device="cuda").to(torch.bfloat16)
    x = torch.randn(G_SEQS, G_HIDDEN, device="cuda", dtype=torch.bfloat16)
    slots = torch.empty(G_SEQS, dtype=torch.int64, device="cuda")
    seq_lens = torch.empty(G_SEQS, dtype=torch.int32, device="cuda")
    table = torch.empty(G_SEQS, num_blocks // G_SEQS, dtype=torch.int32, device="cuda")
    attention = torch.empty(G_SEQS, G_HEADS, 512, dtype=torch.bfloat16, device="cuda")
    layer = DecodeLayer(backend, G_HIDDEN, attention).to(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)

    def check(step: mla.StepInputs, cache_after: torch.Tensor, label: str) -> None:
        """The replayed graph's attention output (in the static buffer) against the reference
        math on the cache it wrote; then the eager op with LSE at the reference tolerance."""
        graph_attention = attention.clone()
        q = layer.project_q(x)
        ref = reference_decode(
            q, cache_after, step.block_table, step.seq_lens, step.query_start_loc, softmax_scale=0.07
        )
        torch.testing.assert_close(
            graph_attention.double().cpu(), ref[0].cpu(), rtol=3e-2, atol=3e-2, msg=lambda m: f"{label}: {m}"
        )
        lse = torch.full((G_SEQS, G_HEADS), math.nan, device="cuda")
        backend.impl.forward_decode(backend.current_metadata, q, cache_after, out=attention, lse=lse)
        assert_matches_reference(attention, lse, *ref, context=label)

    step = _gpu_step(backend, seq_lens, table, [700, 33, 1024, 0])
    slots.copy_(_step_slots(step))
    metadata = backend.builder.build(step)
    with torch.no_grad():
        eager_cache = cache.clone()
        expected = layer(metadata, x, eager_cache, slots)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                work = cache.clone()
                got = compiled(metadata, x, work, slots)
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(metadata, x, cache, slots)
        for round_, lens in enumerate(([12, 1000, 64, 0], [1024, 1, 500, 0])):
            step = _gpu_step(backend, seq_lens, table, lens)
            slots.copy_(_step_slots(step))
            x.copy_(torch.randn_like(x))
            rebuilt = backend.builder.build(step)
            assert rebuilt.decode is not None
            before = cache.clone()
            attention.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            check(step, cache, f"{provider} replay {round_}")
            eager_cache = before.clone()
            expected = layer(rebuilt, x, eager_cache, slots)
            torch.testing.assert_close(static_out, expected, rtol=2e-2, atol=2e-2, msg=f"replay {round_}")
            torch.testing.assert_close(cache, eager_cache, msg=f"cache after replay {round_}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert torch._dynamo.explain(layer)(metadata, x, cache.clone(), slots).graph_break_count == 0


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
def test_decode_graph_replays_with_the_current_device_kv_scale(provider: str) -> None:
    fp8 = torch.float8_e4m3fn
    backend = _gpu_backend(provider, fp8)
    num_blocks = backend.cache.num_blocks or 0
    values = torch.randn(num_blocks, G_BLOCK, 576, device="cuda")
    cache = values.clamp(-400, 400).to(fp8)
    seq_lens = torch.empty(G_SEQS, dtype=torch.int32, device="cuda")
    table = torch.empty(G_SEQS, num_blocks // G_SEQS, dtype=torch.int32, device="cuda")
    step = _gpu_step(backend, seq_lens, table, [700, 33, 1024, 0])
    metadata = backend.builder.build(step)
    q = torch.randn(G_SEQS, G_HEADS, 576, device="cuda").to(torch.bfloat16)
    out = torch.empty(G_SEQS, G_HEADS, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(G_SEQS, G_HEADS, device="cuda")
    kv_scale = torch.full((1,), 0.02, device="cuda")

    def forward() -> None:
        backend.impl.forward_decode(metadata, q, cache, out=out, lse=lse, kv_scale=kv_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for scale in (0.02, 0.005, 0.05):
        kv_scale.fill_(scale)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_decode(
            q,
            cache,
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            softmax_scale=0.07,
            kv_scale=scale,
        )
        assert_matches_reference(out, lse, *ref, context=f"{provider} kv_scale {scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("provider", gpu_providers())
@pytest.mark.parametrize("block", [1, 64])
def test_builds_and_mla_decode_do_not_sync(provider: str, block: int) -> None:
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronizing call (a
    device-to-host copy, ``.item()``, a blocking host-to-device copy)."""
    batch, max_len = 128, 1024
    backend = mla.MLABackend(
        mla.MLADims(16, 512, 64, softmax_scale=0.07),
        mla.KVCacheSpec(block, torch.bfloat16, num_blocks=batch * max_len // block),
        mla.EngineLimits(batch, max_len, batch),
        model_dtype=torch.bfloat16,
        provider=provider,
        device="cuda",
    )
    lens_cpu = torch.randint(1, max_len + 1, (batch,), dtype=torch.int32)
    qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
    table = torch.randperm(batch * max_len // block, dtype=torch.int32).view(batch, -1).cuda()
    step = mla.StepInputs(
        query_start_loc_cpu=qsl_cpu,
        query_start_loc=qsl_cpu.cuda(),
        seq_lens=lens_cpu.cuda(),
        seq_lens_cpu=lens_cpu,
        block_table=table,
        num_decodes=batch,
        num_decode_tokens=batch,
    )
    q = torch.randn(batch, 16, 576, device="cuda").to(torch.bfloat16)
    cache = torch.randn(batch * max_len // block, block, 576, device="cuda").to(torch.bfloat16)
    args: dict[str, Any] = {"softmax_scale": 0.07, "provider": provider}
    mla.mla_decode(q, cache, table, step.seq_lens, **args)  # the first call plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            backend.builder.build(step)
            out = mla.mla_decode(q, cache, table, step.seq_lens, return_lse=False, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_out, _ = reference_decode(q, cache, table, step.seq_lens, softmax_scale=0.07)
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), rtol=2e-2, atol=2e-2)
