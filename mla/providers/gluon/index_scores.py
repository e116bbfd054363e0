# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Gluon (Hopper) indexer scores over a paged fp8 index-key cache: TMA key tiles, fp8 ``wgmma``.

The same scores as :func:`mla.providers.triton.indexer.index_scores` (the contract is stated
there): ``scores[t, p] = key_scale[p] · Σ_h relu(q[t, h] · k[p]) · w[t, h] · softmax_scale`` for
the positions row ``t`` sees whose cache block is inside the cache, ``-inf`` elsewhere, and with
``stats`` each (row, chunk)'s least and greatest finite score. The Triton kernel gathers each
64-key tile with per-thread loads; here each program (one row, one chunk of positions) streams
its tiles through a ring of ``NUM_STAGES`` shared-memory slots filled by TMA:

* an fp8 index-key cache block is ``block_size · D`` value bytes then ``block_size`` float32
  scales. Viewed as rows of ``D = 128`` bytes, block ``b`` is rows ``[b·R, (b+1)·R)`` with
  ``R = block_size · (D + 4) / D``: a 64-key tile at offset ``o`` in the block is one
  ``[64, 128]`` e4m3 box at row ``b·R + o`` (128-byte swizzle, the ``wgmma`` A operand as it
  lands) and its scales one ``[2, 32]`` float32 box at row ``b·R + block_size + o / 32`` of
  the same memory viewed as float32;
* the block id of the tile ``NUM_STAGES - 1`` ahead is read one iteration before its copy is
  issued (its latency hides behind a tile's work); a block outside the cache (or past the
  table) issues no copy: its barrier gets a plain arrival and the tile's keys score ``-inf``;
* ``Sᵀ = K·Qᵀ`` is one fp8 ``wgmma`` (M = 64 keys, N = the index heads padded to 16-128 with
  zero queries and zero weights, K = 128), so the sum over heads is along the accumulator's
  rows (within a quad of lanes).

One warpgroup a program; about 33 KB of shared memory at three stages, so several programs share
an SM and hide each other's epilogues (on the H200 about 9% faster than the Triton kernel at the
DSA decode shape: ``docs/performance.md``). :func:`gluon_scores_route` says which calls it takes;
the gluon provider's ``index_topk`` runs every other call on the Triton kernel.
"""

from __future__ import annotations

import attrs
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla.core.errors import InvalidInputError
from mla.providers.calls import IndexTopkCall
from mla.providers.formats import E4M3
from mla.providers.gluon.kernels import _wait_for_previous
from mla.providers.triton.decode import num_sms
from mla.providers.triton.indexer import (
    PREFILL_ROWS,
    IndexScoresConfig,
    check_score_operands,
    check_stats,
    index_scores,
    index_scores_config,
    score_chunk,
)
from mla.providers.triton.launch_cache import LaunchCache
from mla.providers.triton.pdl import pdl_options

HEAD_DIM = gl.constexpr(128)
"""The index head dim the kernel takes (one 128-byte TMA row a key)."""
TILE = gl.constexpr(64)
"""Keys per tile (the ``wgmma`` M of one warpgroup)."""
MAX_HEADS = 128
"""Most index heads (the ``wgmma`` N, padded to a power of two from 16)."""
MAX_ROWS = PREFILL_ROWS
"""Most rows the kernel takes: the count from which the Triton kernel's scores launch is its
prefill one (two rows a program share each key tile); more rows stay on it."""
KEY_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@attrs.frozen
class GluonScoresConfig:
    """The launch of :func:`index_scores_kernel`: ``num_stages`` ring slots."""

    num_stages: int = 3
    """Ring slots (tiles in flight: ``num_stages - 1``). Two and three measured fastest on the
    H200, six and more much slower (fewer programs fit an SM): ``docs/performance.md``, "Kernel
    choices"."""

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.num_stages <= 8:
            raise InvalidInputError("config", f"num_stages must be from 2 to 8, got {self.num_stages}")


@gluon.jit
def _issue_tile(key_desc, scale_desc, bar, key_slot, scale_slot, block, ok, offset, R: gl.constexpr,
                BLOCK_SIZE: gl.constexpr):  # fmt: skip
    """Copy the tile at ``offset`` of cache block ``block`` into its ring slot (``ok``), or arrive
    on ``bar`` without a copy."""
    row = block * R + offset
    mbarrier.expect(bar, key_desc.block_type.nbytes + scale_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(key_desc, [row, 0], bar, key_slot, pred=ok)
    scale_row = block * R + BLOCK_SIZE + offset // 32
    tma.async_copy_global_to_shared(scale_desc, [scale_row, 0], bar, scale_slot, pred=ok)
    mbarrier.arrive(bar, pred=~ok)


@gluon.jit
def _tile_block(block_table_ptr, req, stride_bt, p0, max_blocks, num_blocks, BLOCK_SIZE: gl.constexpr):
    """``(block id, inside the cache)`` of the tile starting at position ``p0``."""
    column = p0 // BLOCK_SIZE
    in_table = column < max_blocks
    entry = block_table_ptr + req * stride_bt + gl.where(in_table, column, 0)
    block = gl.load(entry, mask=in_table, other=-1)
    ok = in_table & (block >= 0) & (block < num_blocks)
    return gl.where(ok, block, 0).to(gl.int32), ok


@gluon.jit
def index_scores_kernel(
    q_ptr, w_ptr, key_desc, scale_desc, block_table_ptr, row_request_ptr, row_keys_ptr, scores_ptr, stats_ptr,
    Hi, max_keys, chunk, last_request, max_blocks, num_blocks,
    stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_bt, stride_sc_t, stride_st_k, stride_st_t,
    softmax_scale, BLOCK_SIZE: gl.constexpr, HP: gl.constexpr, NUM_STAGES: gl.constexpr,
    STATS: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Program (row ``t``, chunk ``c``): the scores of positions ``[c·chunk, min((c+1)·chunk,
    max_keys))`` of row ``t`` (and, with ``STATS``, their least and greatest finite one)."""
    _wait_for_previous(PDL)
    D: gl.constexpr = HEAD_DIM
    R: gl.constexpr = BLOCK_SIZE * (D + 4) // D
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 32]
    )
    keys_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    heads_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    q_ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    t = gl.program_id(0).to(gl.int64)
    lo = gl.program_id(1) * chunk
    end = gl.minimum(lo + chunk, max_keys)
    row_keys = gl.load(row_keys_ptr + t)
    row_hi = gl.maximum(gl.minimum(end, row_keys), lo)
    req = gl.minimum(gl.maximum(gl.load(row_request_ptr + t), 0), last_request).to(gl.int64)
    n_tiles = gl.cdiv(row_hi - lo, TILE)

    k_ring = gl.allocate_shared_memory(key_desc.dtype, [NUM_STAGES, TILE, D], KEY_LAYOUT)
    s_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 2, 32], SCALE_LAYOUT)
    q_smem = gl.allocate_shared_memory(key_desc.dtype, [HP, D], KEY_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # The first NUM_STAGES - 1 tiles in flight, and the block id of the next one.
    valid = 0
    for i in gl.static_range(NUM_STAGES - 1):
        p0 = lo + i * TILE
        block, ok = _tile_block(block_table_ptr, req, stride_bt, p0, max_blocks, num_blocks, BLOCK_SIZE)
        ok = ok & (i < n_tiles)
        _issue_tile(key_desc, scale_desc, ready.index(i), k_ring.index(i), s_ring.index(i), block, ok,
                    p0 % BLOCK_SIZE, R, BLOCK_SIZE)  # fmt: skip
        valid = valid | (ok.to(gl.int32) << i)
    next_p0 = lo + (NUM_STAGES - 1) * TILE
    next_block, next_ok = _tile_block(
        block_table_ptr, req, stride_bt, next_p0, max_blocks, num_blocks, BLOCK_SIZE
    )

    # The row's queries (zero past Hi) into shared memory, its weights (zero past Hi) in registers.
    offs_h = gl.arange(0, HP, layout=gl.SliceLayout(1, q_ld))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, q_ld))
    q = gl.load(
        q_ptr + t * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :],
        mask=(offs_h < Hi)[:, None],
        other=0.0,
    )
    q_smem.store(q)
    heads = gl.arange(0, HP, layout=heads_layout)
    w = gl.load(w_ptr + t * stride_w_t + heads * stride_w_h, mask=heads < Hi, other=0.0) * softmax_scale
    fence_async_shared()
    gl.thread_barrier()

    offs_p = gl.arange(0, TILE, layout=keys_layout)
    out_row = scores_ptr + t * stride_sc_t
    zero = gl.zeros([TILE, HP], gl.float32, layout=acc_layout)
    low = gl.full([TILE], float("inf"), gl.float32, layout=keys_layout)
    high = gl.full([TILE], float("-inf"), gl.float32, layout=keys_layout)
    for j in range(n_tiles):
        # Issue the tile NUM_STAGES - 1 ahead into the slot tile j - 1 left, once every warp is
        # done with it (its wgmma and its scales).
        gl.thread_barrier()
        ahead = j + NUM_STAGES - 1
        sa = ahead % NUM_STAGES
        ok = next_ok & (ahead < n_tiles)
        _issue_tile(key_desc, scale_desc, ready.index(sa), k_ring.index(sa), s_ring.index(sa), next_block, ok,
                    next_p0 % BLOCK_SIZE, R, BLOCK_SIZE)  # fmt: skip
        valid = valid | (ok.to(gl.int32) << (NUM_STAGES - 1))
        next_p0 = next_p0 + TILE
        next_block, next_ok = _tile_block(
            block_table_ptr, req, stride_bt, next_p0, max_blocks, num_blocks, BLOCK_SIZE
        )

        s = j % NUM_STAGES
        mbarrier.wait(ready.index(s), (j // NUM_STAGES) & 1)
        logits = warpgroup_mma(k_ring.index(s), q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        logits = warpgroup_mma_wait(num_outstanding=0, deps=(logits,))
        tile_ok = (valid & 1) != 0
        valid = valid >> 1
        key_scale = s_ring.index(s)._reinterpret(gl.float32, [TILE], flat).load(keys_layout)
        score = gl.sum(gl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
        p = lo + j * TILE + offs_p
        visible = tile_ok & (p < row_hi)
        score = gl.where(visible, score, float("-inf"))
        if STATS:
            finite = visible & (gl.abs(score) < float("inf"))
            low = gl.minimum(low, gl.where(finite, score, float("inf")))
            high = gl.maximum(high, gl.where(finite, score, float("-inf")))
        gl.store(out_row + p, score, mask=p < end)
    # Positions of the chunk past the row's last visible one.
    for p0 in range(lo + n_tiles * TILE, end, TILE):
        p = p0 + offs_p
        gl.store(out_row + p, gl.full([TILE], float("-inf"), gl.float32, layout=keys_layout), mask=p < end)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    if STATS:
        stat = stats_ptr + t * stride_st_t + gl.program_id(1)
        gl.store(stat, gl.min(low, 0))
        gl.store(stat + stride_st_k, gl.max(high, 0))


def gluon_scores_route(
    call: IndexTopkCall, config: IndexScoresConfig, capability: tuple[int, int] | None
) -> tuple[bool, str]:
    """Whether :func:`gluon_index_scores` runs ``call`` on the Gluon kernel under the Triton
    launch ``config`` (its chunk) on a device of ``capability`` (``None``: not a CUDA device),
    and why not (pure Python: dtypes, shapes, strides, addresses)."""
    q, cache = call.q, call.index_cache
    rows, heads, dim = q.shape
    if capability != (9, 0):
        return False, f"the Gluon scores kernel needs an sm_90 GPU (got {capability})"
    if q.dtype != E4M3 or call.key_dtype != E4M3:
        return False, f"fp8 (e4m3) queries and keys only (got {q.dtype} queries, {call.key_dtype} keys)"
    if dim != HEAD_DIM.value:
        return False, f"index head dim {HEAD_DIM.value} only (got {dim})"
    if not 1 <= heads <= MAX_HEADS:
        return False, f"1 to {MAX_HEADS} index heads (got {heads})"
    if rows > MAX_ROWS:
        return False, f"at most {MAX_ROWS} rows (the Triton kernel's prefill launch shares key tiles)"
    block_size = cache.shape[1]
    if block_size % TILE.value:
        return False, f"cache blocks of a multiple of {TILE.value} keys (got {block_size})"
    if not cache.is_contiguous() or cache.data_ptr() % 16:
        return False, "a contiguous index cache at a 16-byte-aligned address"
    if q.stride(-1) != 1 or call.weights.stride(-1) != 1:
        return False, "q and weights with a contiguous last dim"
    if config.chunk is None or config.chunk % TILE.value:
        return False, f"a chunk of a multiple of {TILE.value} positions (got {config.chunk})"
    return True, "Gluon scores kernel"


def gluon_index_scores(
    call: IndexTopkCall,
    scores: torch.Tensor,
    *,
    stats: torch.Tensor | None = None,
    config: IndexScoresConfig | None = None,
    gluon_config: GluonScoresConfig | None = None,
) -> None:
    """:func:`mla.providers.triton.indexer.index_scores` on the Gluon kernel where
    :func:`gluon_scores_route` takes the call (the Triton kernel otherwise); same arguments,
    same outputs. ``gluon_config``: the Gluon launch (default :class:`GluonScoresConfig`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    q, cache, table = call.q, call.index_cache, call.block_table
    rows, heads, _dim = q.shape
    if config is None:
        config = index_scores_config(rows=rows, fp8_dot=q.dtype == E4M3)
    if config.chunk is None:
        config = attrs.evolve(config, chunk=score_chunk(call, config, num_sms(q.device)))
    capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    on_gluon = bool(rows and call.max_keys) and gluon_scores_route(call, config, capability)[0]
    if not on_gluon:
        index_scores(call, scores, stats=stats, config=config)
        return
    chunk = int(config.chunk or 0)
    chunks = triton.cdiv(call.max_keys, chunk)
    check_score_operands(call, scores, fp8=True)
    check_stats(stats, rows, chunks)
    blocks, block_size = cache.shape[0], cache.shape[1]
    dim, tile = HEAD_DIM.value, TILE.value
    lines = blocks * block_size * (dim + 4) // dim
    key_view = cache.view(-1).view(E4M3).view(lines, dim)
    scale_view = cache.view(-1).view(torch.float32).view(lines, dim // 4)
    key_desc = TensorDescriptor(key_view, [lines, dim], [dim, 1], [tile, dim], KEY_LAYOUT)
    scale_desc = TensorDescriptor(scale_view, [lines, dim // 4], [dim // 4, 1], [2, 32], SCALE_LAYOUT)
    launch = gluon_config or GluonScoresConfig()
    width = table.shape[1] if table.shape[0] else 0  # an empty table: no position is in range
    weights = call.weights
    INDEX_SCORES_LAUNCH.launch(
        (rows, chunks),
        q, weights, key_desc, scale_desc, table, call.row_request, call.row_keys, scores,
        scores if stats is None else stats,
        heads, call.max_keys, chunk, max(table.shape[0] - 1, 0), width, blocks,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), table.stride(0), scores.stride(0),
        0 if stats is None else stats.stride(0), 0 if stats is None else stats.stride(1), call.softmax_scale,
        BLOCK_SIZE=block_size, HP=max(16, triton.next_power_of_2(heads)), NUM_STAGES=launch.num_stages,
        STATS=stats is not None, **pdl_options(q.device), num_warps=4,
    )  # fmt: skip


INDEX_SCORES_LAUNCH = LaunchCache(index_scores_kernel)
"""``index_scores_kernel[grid](...)`` through the cached launch (:mod:`mla.providers.triton.launch_cache`)."""


__all__ = ["GluonScoresConfig", "gluon_index_scores", "gluon_scores_route", "index_scores_kernel"]
