# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The rounds of the Gluon prefill's persistent layouts (:mod:`.prefill_persistent`, bf16, and
:mod:`.prefill_fp8_persistent`, fp8): which query tile a program takes in each round, the
``cu_seqlens`` entries of its request loaded a round ahead, and the query tile's load once the
previous one is released.

Query tiles are numbered as in :func:`.prefill_parts._query_tile_at` (each (request, head)'s
tiles together, the heaviest first). Program ``p`` of ``G`` takes, in round ``r``, tile ``r·G +
p`` when ``r`` is even and ``r·G + G - 1 - p`` when it is odd (a snake over the rounds), which
evens the programs' causal work without a device-side queue.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from mla.providers.gluon.prefill_parts import _copy_boxes, _key_range_from, _query_tile_from, _tile_request


@gluon.jit
def _grid():
    """The number of programs, read where it is used: ``gl.num_programs(0)`` is read once at the
    kernel's entry and handed to the partitions through local memory, which each query tile
    then reloaded (Nsight Compute, persistent layout at H16 16 x 1024: 6% of a consumer
    warpgroup's stall samples)."""
    return gl.inline_asm_elementwise(
        "mov.u32 $0, %nctaid.x;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _snake_tile(r, num_tiles):
    """This program's tile of round ``r`` (``num_tiles`` when it has none): ``r·G + p`` in even
    rounds, ``r·G + G - 1 - p`` in odd ones (``G`` programs, this one ``p``)."""
    grid = _grid()
    pid = gl.program_id(0)
    slot = gl.where(r % 2 == 0, pid, grid - 1 - pid)
    return gl.minimum(r * grid + slot, num_tiles)


@gluon.jit
def _tile_bounds(r, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks):
    """The ``cu_seqlens_q`` and ``cu_seqlens_k`` entries ``b``, ``b + 1`` of the request of this
    program's tile of round ``r`` (zeros past the last tile): loaded a round ahead, so a query
    tile's start waits for no global load."""
    tile = _snake_tile(r, num_tiles)
    live = tile < num_tiles
    b, _h, _m_block = _tile_request(tile, num_heads, num_m_blocks)
    q_lo = gl.load(cu_seqlens_q_ptr + b, mask=live, other=0)
    q_hi = gl.load(cu_seqlens_q_ptr + b + 1, mask=live, other=0)
    k_lo = gl.load(cu_seqlens_k_ptr + b, mask=live, other=0)
    k_hi = gl.load(cu_seqlens_k_ptr + b + 1, mask=live, other=0)
    return q_lo, q_hi, k_lo, k_hi


@gluon.jit
def _round_bounds(
    r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, AHEAD: gl.constexpr
):  # fmt: skip
    """``(round r's bounds, the bounds to carry)`` (:func:`_tile_bounds`): with ``AHEAD``, the
    carried ``bounds`` of round ``r`` and round ``r + 1``'s loaded now; without, round ``r``'s
    loaded now and ``bounds`` unchanged (the appended-keys form's consumers: carried across the
    loop, the bounds made them spill)."""
    if AHEAD:
        current = bounds
        bounds = _tile_bounds(r + 1, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    else:
        current = _tile_bounds(r, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks)
    return current, bounds


@gluon.jit
def _load_query(q_desc, q_begin, m0, h, stride_qh, q_bar, q_smem, q_empty, done):
    """Once both consumer warpgroups have released the program's previous query tile (the
    ``done``-th phase of ``q_empty``), the query tile at row ``m0`` of the request whose
    tokens start at ``q_begin``, head ``h``, into ``q_smem`` on ``q_bar``."""
    mbarrier.wait(q_empty, done & 1)
    _copy_boxes(q_desc, q_begin + m0, h * stride_qh, q_bar, q_smem, 0, q_smem.shape[0], False)


@gluon.jit
def _round_query_tile(
    r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, num_q_rows, num_k_rows,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """This program's query tile of round ``r`` with its bounds a round ahead
    (:func:`_round_bounds`): ``(live, h, q_begin, seq_q, m0, k_begin, seq_k, shift, n_full,
    n_tiles, bounds)``, ``live`` false past the last tile and for a row block past its request's
    queries (the bounds past the last tile are zeros: no query)."""
    tile = _snake_tile(r, num_tiles)
    current, bounds = _round_bounds(
        r, bounds, num_tiles, cu_seqlens_q_ptr, cu_seqlens_k_ptr, num_heads, num_m_blocks, True
    )
    q_lo, q_hi, k_lo, k_hi = current
    _b, h, q_begin, seq_q, m0 = _query_tile_from(tile, q_lo, q_hi, num_heads, num_m_blocks, num_q_rows)
    k_begin, seq_k, shift, n_full, n_tiles = _key_range_from(
        k_lo, k_hi, num_k_rows, seq_q, m0, CAUSAL, BLOCK_N
    )
    live = (tile < num_tiles) & (m0 < seq_q)
    return live, h, q_begin, seq_q, m0, k_begin, seq_k, shift, n_full, n_tiles, bounds
