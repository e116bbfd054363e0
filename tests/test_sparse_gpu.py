"""The sparse engine path on a GPU: DeepSeek-V3.2's geometry (latent 512 + rope 64, top-k 2048,
index heads 64 x 128) on the ``triton`` and ``gluon`` providers (skipped without CUDA; Gluon runs
bf16, per-tensor fp8 and ``fp8_ds_mla`` caches on its decode kernels, ``fp8_ds_mla`` rows of 8 and 16
heads on the kernel of ``mla/providers/gluon/ds_mla_rows.py``, and the indexer on Triton's).

- Engine steps (``builder.build``, ``impl.write_kv``/``write_index_keys``, the sparse decode of
  verify rows of qlen 1 to 4 and the sparse prefill of a long request) with bf16, per-tensor fp8
  (e4m3 with ``kv_scale``) and ``fp8_ds_mla`` caches at 8, 16, 64 and 128 heads, against
  :func:`~mla.tools.reference.reference_sparse` (bf16 tolerance 3e-2); one request is shorter
  than the top-k, so its selection ends in ``-1``. Caches are NaN wherever no request owns the
  position and outputs NaN before each call.
- The indexer (bf16 and fp8 keys) against :func:`~mla.tools.reference.reference_index_scores`,
  without depending on how ties break.
- ``impl.index_topk`` + ``impl.forward_sparse_decode`` captured in a CUDA graph for a fixed
  (batch, qlen) shape and replayed after ``builder.build`` of steps with other lengths, keys and
  queries (one with a graph-padding request), checked against the references after each replay.

Run: ``pytest -m gpu tests/test_sparse_gpu.py`` (about a minute on an H200, mostly the float64
references on the host).
"""

from __future__ import annotations

import math
import random
from typing import Any

import attrs
import pytest
import sparse_steps
import torch
from gpu_providers import gpu_providers

import mla
from mla.core.config import DS_MLA_DTYPE, dtype_name
from mla.testing import encode_latent_cache, poisoned_index_cache
from mla.testing.sparse import SELECTION_POISON

pytestmark = pytest.mark.gpu

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
PROVIDERS = ["triton", "gluon"]
KV_FORMATS = {"bf16": (BF16, None), "fp8": (E4M3, 0.05), "fp8_ds_mla": (DS_MLA_DTYPE, None)}
"""name -> (cache dtype, kv_scale)."""
TOL = 3e-2


@attrs.frozen
class Geometry:
    """The model and engine shape (DeepSeek-V3.2's by default)."""

    rank: int = 512
    rope: int = 64
    topk: int = 2048
    block_size: int = 64
    index_heads: int = 64
    index_dim: int = 128
    max_model_len: int = 8192

    @property
    def scale(self) -> float:
        return float((self.rank + self.rope) ** -0.5)


DEEPSEEK = Geometry()


@attrs.frozen
class StepShape:
    """Decode requests first (``extra`` graph-padding rows after them in a decode-only step)."""

    qlens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_decodes: int
    extra: int = 0

    @property
    def owned(self) -> int:
        return sum(self.qlens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.qlens[: self.num_decodes]) + self.extra

    @property
    def rows(self) -> int:
        return self.owned + self.extra

    def windows(self) -> list[tuple[int, int] | None]:
        """Per row ``(request, visible positions)``; ``None`` for a padding row."""
        out: list[tuple[int, int] | None] = []
        for b, (q, s) in enumerate(zip(self.qlens, self.seq_lens, strict=True)):
            out += [(b, max(0, s - q + i + 1)) for i in range(q)]
        return out + [None] * self.extra


MIXED = StepShape((1, 2, 3, 4, 12), (2300, 2600, 1000, 2100, 2400), num_decodes=4)
"""Verify rows of qlen 1 to 4 (request 2 sees fewer positions than the top-k) and a prefill with
cached context."""
PADDED = StepShape((2, 2, 2, 2), (5000, 1500, 0, 3000), num_decodes=4, extra=2)
"""A decode-only step with a graph-padding request and two padding rows."""


def _provider(name: str) -> str:
    if name not in gpu_providers():
        pytest.skip(f"provider {name!r} is not available here")
    return name


def _backend(
    provider: str,
    heads: int,
    kv_dtype: torch.dtype,
    num_blocks: int,
    *,
    key_dtype: torch.dtype = BF16,
    geo: Geometry = DEEPSEEK,
    graph: bool = False,
    device: str = "cuda",
) -> mla.MLABackend:
    return mla.MLABackend(
        mla.MLADims(heads, geo.rank, geo.rope, softmax_scale=geo.scale, index_topk=geo.topk),
        mla.KVCacheSpec(geo.block_size, kv_dtype, num_blocks=num_blocks),
        mla.EngineLimits(
            8,
            geo.max_model_len,
            64,
            max_decode_qlen=4,
            graph_mode=mla.GraphMode.FULL if graph else mla.GraphMode.NONE,
        ),
        model_dtype=BF16,
        provider=provider,
        device=device,
        indexer=mla.IndexerSpec(num_heads=geo.index_heads, head_dim=geo.index_dim, key_dtype=key_dtype),
    )


def _num_blocks(shape: StepShape, geo: Geometry) -> int:
    return sum(-(-s // geo.block_size) for s in shape.seq_lens) + 4


def _block_table(shape: StepShape, geo: Geometry, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[B, max_model_len / block_size]`` over a random block permutation; columns past a
    request's blocks hold random (stale) ids."""
    width = geo.max_model_len // geo.block_size
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(shape.qlens), width), generator=gen)
    cursor = 0
    for b, seq in enumerate(shape.seq_lens):
        need = -(-seq // geo.block_size)
        table[b, :need] = perm[cursor : cursor + need]
        cursor += need
    return table.to(torch.int32)


def _step_inputs(shape: StepShape, table: torch.Tensor, device: str) -> mla.StepInputs:
    qsl = torch.zeros(len(shape.qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(shape.qlens), 0)
    lens = torch.tensor(shape.seq_lens, dtype=torch.int32)
    return mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.to(device),
        seq_lens=lens.to(device),
        seq_lens_cpu=lens,
        block_table=table.to(device),
        num_decodes=shape.num_decodes,
        num_decode_tokens=shape.num_decode_tokens,
    )


def _owned_slots(shape: StepShape, table: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """int64 flat slots of every owned position, request by request."""
    bs = geo.block_size
    table64 = table.cpu().to(torch.int64)
    parts = [
        table64[b, torch.arange(s) // bs] * bs + torch.arange(s) % bs for b, s in enumerate(shape.seq_lens)
    ]
    return torch.cat(parts)


def _fill_caches(
    backend: mla.MLABackend,
    shape: StepShape,
    table: torch.Tensor,
    kv_dtype: torch.dtype,
    kv_scale: float | None,
    num_blocks: int,
    gen: torch.Generator,
    *,
    geo: Geometry = DEEPSEEK,
    kv_cache: torch.Tensor | None = None,
    index_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN caches (or the given ones, poisoned again in place), then every owned position's
    latent row and index key written through the impl."""
    device = backend.device
    nan_rows = torch.full((num_blocks, geo.block_size, geo.rank + geo.rope), math.nan, device=device)
    poison = encode_latent_cache(nan_rows, kv_dtype, kv_lora_rank=geo.rank, kv_scale=kv_scale)
    if kv_cache is None:
        kv_cache = poison
    else:
        kv_cache.copy_(poison)
    assert backend.indexer is not None
    index_poison = poisoned_index_cache(backend.indexer.spec, num_blocks, geo.block_size, device)
    if index_cache is None:
        index_cache = index_poison
    else:
        index_cache.copy_(index_poison)
    slots = _owned_slots(shape, table, geo).to(device)
    count = slots.numel()
    latent = torch.randn(count, geo.rank + geo.rope, generator=gen).to(BF16).to(device)
    backend.impl.write_kv(latent[:, : geo.rank], latent[:, geo.rank :], kv_cache, slots, kv_scale=kv_scale)
    keys = torch.randn(count, geo.index_dim, generator=gen).to(BF16).to(device)
    backend.impl.write_index_keys(keys, index_cache, slots)
    return kv_cache, index_cache


def _hand_selection(shape: StepShape, topk: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows, topk]``: distinct positions of each row's window scattered over random
    columns, ``-1`` between and after them; padding rows only ``-1``."""
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    out = torch.full((shape.rows, topk), -1, dtype=torch.int32)
    for t, where in enumerate(shape.windows()):
        if where is None or where[1] == 0:
            continue
        window = where[1]
        most = min(topk, window)
        count = rng.choice((most, most - rng.randint(0, most // 4)))
        out[t, torch.randperm(topk, generator=gen)[:count]] = torch.randperm(window, generator=gen)[
            :count
        ].to(torch.int32)
    return out


def _reference(
    step: mla.StepInputs,
    shape: StepShape,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    kv_scale: float | None,
    geo: Geometry,
) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_steps.reference(
        step, shape.num_decodes, shape.num_decode_tokens, shape.rows, q, kv_cache, selection, kv_scale,
        softmax_scale=geo.scale, kv_lora_rank=geo.rank,
    )  # fmt: skip


def _assert_close(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], context: str
) -> None:
    """:func:`sparse_steps.assert_close` at :data:`TOL`."""
    sparse_steps.assert_close(got, want, TOL, context)


def _attend(
    backend: mla.MLABackend,
    metadata: mla.MLAMetadata,
    shape: StepShape,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    kv_scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rank = backend.dims.kv_lora_rank
    out = torch.full((shape.rows, q.shape[1], rank), math.nan, dtype=BF16, device=q.device)
    lse = torch.full((shape.rows, q.shape[1]), math.nan, device=q.device)
    return sparse_steps.attend(
        backend, metadata, shape.num_decode_tokens, q, kv_cache, selection, kv_scale, out, lse
    )


def run_engine_step(
    provider: str, kv: str, heads: int, *, geo: Geometry = DEEPSEEK, device: str = "cuda", seed: int = 0
) -> None:
    """One mixed step (verify rows and a prefill) through the engine against the reference."""
    kv_dtype, kv_scale = KV_FORMATS[kv]
    gen = torch.Generator().manual_seed(seed)
    shape = MIXED
    num_blocks = _num_blocks(shape, geo)
    backend = _backend(provider, heads, kv_dtype, num_blocks, geo=geo, device=device)
    table = _block_table(shape, geo, num_blocks, gen)
    step = _step_inputs(shape, table, device)
    metadata = backend.builder.build(step)
    assert metadata.sparse_decode is not None
    assert metadata.sparse_prefill is not None
    kv_cache, _ = _fill_caches(backend, shape, table, kv_dtype, kv_scale, num_blocks, gen, geo=geo)
    q = torch.randn(shape.rows, heads, geo.rank + geo.rope, generator=gen).to(BF16).to(device)
    selection = _hand_selection(shape, geo.topk, gen).to(device)
    got = _attend(backend, metadata, shape, q, kv_cache, selection, kv_scale)
    want = _reference(step, shape, q, kv_cache, selection, kv_scale, geo)
    _assert_close(got, want, f"{provider} {kv} h{heads}")
    assert backend.invalid_index_count() == 0


def run_indexer_step(
    provider: str, key_dtype: torch.dtype, *, geo: Geometry = DEEPSEEK, device: str = "cuda", seed: int = 0
) -> None:
    """The indexer over a mixed step and a padded decode-only step."""
    gen = torch.Generator().manual_seed(seed)
    for shape in (MIXED, PADDED):
        num_blocks = _num_blocks(shape, geo)
        backend = _backend(provider, 8, BF16, num_blocks, key_dtype=key_dtype, geo=geo, device=device)
        assert backend.indexer is not None
        spec = backend.indexer.spec
        table = _block_table(shape, geo, num_blocks, gen)
        step = _step_inputs(shape, table, device)
        metadata = backend.builder.build(step)
        _, index_cache = _fill_caches(backend, shape, table, BF16, None, num_blocks, gen, geo=geo)
        index_q = torch.randn(shape.rows, spec.num_heads, spec.head_dim, generator=gen).to(BF16).to(device)
        weights = (torch.randn(shape.rows, spec.num_heads, generator=gen) * spec.num_heads**-0.5).to(device)
        selected = torch.full((shape.rows, geo.topk), SELECTION_POISON, dtype=torch.int32, device=device)
        backend.impl.index_topk(metadata, index_q, weights, index_cache, out=selected)
        context = f"{provider} {dtype_name(key_dtype)} keys, {shape.qlens}"
        sparse_steps.check_selection(
            step, shape.owned, selected, index_q, weights, index_cache, spec, geo.topk, context
        )


def run_graph_replay(
    provider: str, kv: str, *, geo: Geometry = DEEPSEEK, heads: int = 16, capture: bool = True
) -> None:
    """index_topk + forward_sparse_decode captured once for 4 requests of qlen 2 and replayed
    after each rebuild (``capture=False`` runs the same calls eagerly: a dry run off the GPU)."""
    device = "cuda" if capture else "cpu"
    kv_dtype, kv_scale = KV_FORMATS[kv]
    gen = torch.Generator().manual_seed(7)
    steps = [
        StepShape((2, 2, 2, 2), (3000, 700, 8000, 2049), num_decodes=4),
        StepShape((2, 2, 2, 2), (12, 6000, 2048, 4500), num_decodes=4),
        StepShape((2, 2, 2, 2), (5000, 1800, 7000, 0), num_decodes=4),
    ]
    num_blocks = max(_num_blocks(s, geo) for s in steps)
    backend = _backend(provider, heads, kv_dtype, num_blocks, geo=geo, graph=True, device=device)
    assert backend.indexer is not None
    spec = backend.indexer.spec
    rows = 8
    # Static buffers: the step's device tensors, the caches, the inputs and the outputs.
    seq_lens = torch.zeros(4, dtype=torch.int32, device=device)
    table = torch.zeros(4, geo.max_model_len // geo.block_size, dtype=torch.int32, device=device)
    qsl = torch.arange(0, 2 * 4 + 1, 2, dtype=torch.int32)
    kv_cache: torch.Tensor | None = None
    index_cache: torch.Tensor | None = None
    q = torch.empty(rows, heads, geo.rank + geo.rope, dtype=BF16, device=device)
    index_q = torch.empty(rows, spec.num_heads, spec.head_dim, dtype=BF16, device=device)
    weights = torch.empty(rows, spec.num_heads, device=device)
    topk = torch.empty(rows, geo.topk, dtype=torch.int32, device=device)
    out = torch.empty(rows, heads, geo.rank, dtype=BF16, device=device)
    lse = torch.empty(rows, heads, device=device)
    scale = None if kv_scale is None else torch.full((1,), kv_scale, device=device)
    graph: Any = None
    metadata: mla.MLAMetadata | None = None

    def forward() -> None:
        assert metadata is not None
        assert kv_cache is not None
        assert index_cache is not None
        backend.impl.index_topk(metadata, index_q, weights, index_cache, out=topk)
        backend.impl.forward_sparse_decode(metadata, q, kv_cache, topk, out=out, lse=lse, kv_scale=scale)

    for index, shape in enumerate(steps):
        host_table = _block_table(shape, geo, num_blocks, gen)
        seq_lens.copy_(torch.tensor(shape.seq_lens, dtype=torch.int32))
        table.copy_(host_table)
        step = mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.to(device),
            seq_lens=seq_lens,
            seq_lens_cpu=torch.tensor(shape.seq_lens, dtype=torch.int32),
            block_table=table,
            num_decodes=4,
            num_decode_tokens=rows,
        )
        metadata = backend.builder.build(step)
        kv_cache, index_cache = _fill_caches(
            backend, shape, host_table, kv_dtype, kv_scale, num_blocks, gen, geo=geo,
            kv_cache=kv_cache, index_cache=index_cache,
        )  # fmt: skip
        q.copy_(torch.randn(q.shape, generator=gen).to(BF16))
        index_q.copy_(torch.randn(index_q.shape, generator=gen).to(BF16))
        weights.copy_(torch.randn(weights.shape, generator=gen) * spec.num_heads**-0.5)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        topk.fill_(SELECTION_POISON)
        if not capture:
            forward()
        elif graph is None:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward()  # compiles the kernels outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            out.fill_(math.nan)
            lse.fill_(math.nan)
            topk.fill_(SELECTION_POISON)
            graph.replay()
        else:
            graph.replay()
        if capture:
            torch.cuda.synchronize()
        context = f"{provider} {kv} replay {index}"
        sparse_steps.check_selection(
            step, shape.owned, topk, index_q, weights, index_cache, spec, geo.topk, context
        )
        want = _reference(step, shape, q, kv_cache, topk, kv_scale, geo)
        _assert_close((out, lse), want, context)
    assert backend.invalid_index_count() == 0


# -- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [8, 16, 64, 128], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("kv", list(KV_FORMATS))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_gpu_engine_step_matches_the_reference(provider: str, kv: str, heads: int) -> None:
    run_engine_step(_provider(provider), kv, heads, seed=heads)


@pytest.mark.parametrize("key_dtype", [BF16, E4M3], ids=["bf16-keys", "fp8-keys"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_gpu_indexer_matches_the_reference(provider: str, key_dtype: torch.dtype) -> None:
    run_indexer_step(_provider(provider), key_dtype)


@pytest.mark.parametrize("kv", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_gpu_sparse_decode_replays_in_a_cuda_graph_after_rebuild(provider: str, kv: str) -> None:
    run_graph_replay(_provider(provider), kv)
