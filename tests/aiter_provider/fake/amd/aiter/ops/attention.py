"""Fake ``aiter/ops/attention.py``: persistent metadata (decode and fp8 prefill), the reduce and
the fp8 persistent prefill kernel, checking what real aiter checks."""

from __future__ import annotations

import math
from typing import Any

import torch

from aiter import _state
from aiter._asm_table import check_reduce
from aiter._math import attend, causal_visible, check, merge, require_fp8, undefined_where_empty

WORK_FIELDS = 8
"""Dwords per work item: bs_index, partial_loc, q_start, q_end, kv_start, kv_end, kv_offset, heads."""
UNUSED = 0x7FFFFFFF
"""What the fake leaves in buffer entries past the plan (consumers must stop at the indptrs)."""


def _is_index(tensor: Any, name: str) -> None:
    check(isinstance(tensor, torch.Tensor), f"{name} must be a tensor, got {type(tensor).__name__}")
    check(tensor.dtype == torch.int32 and tensor.dim() == 1, f"{name} must be 1-D int32, got {tensor.dtype}")


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _tiles_per_batch(arch: str, qlen: int, heads: int, q_fp8: bool, kv_fp8: bool) -> int:
    """``get_mla_metadata_info_v1``'s q tiles per request (16, 64 or 128 packed rows per tile)."""
    packed = qlen * heads
    bf16 = not q_fp8 and not kv_fp8
    fp8 = q_fp8 and kv_fp8
    if (arch == "gfx950" and bf16 and packed >= 64 and heads <= 64 and (packed < 128 or heads == 48)) or (
        arch == "gfx950" and fp8 and heads == 32 and qlen == 3
    ):
        return qlen if heads * 2 > 64 else math.ceil(packed / 64)
    if (
        heads == 16
        or (arch == "gfx942" and heads == 128 and fp8)
        or (arch == "gfx950" and fp8 and ((heads == 32 and qlen == 4) or heads in (64, 128)))
        or (heads == 64 and fp8 and qlen == 1)
    ):
        return math.ceil(packed / 128)
    if arch == "gfx950" and (packed >= 128 or heads > 64) and bf16 and heads != 48:
        return qlen if heads * 2 > 128 else math.ceil(packed / 128)
    return math.ceil(packed / 16)


def _decode_sizes(
    batch: int, qlen: int, heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> dict[str, int]:
    tiles = _tiles_per_batch(_state.arch(), qlen, heads, _is_fp8(q_dtype), _is_fp8(kv_dtype))
    splits = _state.cu_num()
    return {
        "splits": splits,
        "works": (batch + splits - 1) * tiles,
        "tiles": batch * tiles,
        "partials": min(batch + splits - 1, (splits - 1) * 2) * tiles,
    }


def get_mla_metadata_info_v1(
    batch_size: int,
    max_seqlen_qo: int,
    num_head_qo: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    is_sparse: bool,
    fast_mode: bool = True,
    num_kv_splits: int = 32,
    intra_batch_mode: bool = False,
    max_split_per_batch: int = -1,
) -> tuple[tuple[Any, torch.dtype], ...]:
    assert num_head_qo % 8 == 0
    check(
        not is_sparse and fast_mode and not intra_batch_mode, "the fake covers dense fast-mode metadata only"
    )
    _state.record(
        "get_mla_metadata_info_v1",
        batch=batch_size,
        qlen=max_seqlen_qo,
        heads=num_head_qo,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
    )
    size = _decode_sizes(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype)
    specs = (
        (2, torch.uint64),
        (size["splits"] + 1, torch.int32),
        ((size["works"], WORK_FIELDS), torch.int32),
        (size["tiles"] + 1, torch.int32),
        ((size["tiles"], 2), torch.int32),
        (size["partials"], torch.int32),
    )
    _state.INFOS.append(
        {
            "batch": batch_size,
            "qlen": max_seqlen_qo,
            "heads": num_head_qo,
            "dtypes": (q_dtype, kv_dtype),
            "shapes": tuple(_spec_shape(shape) for shape, _ in specs),
        }
    )
    return specs


def _spec_shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape) if isinstance(shape, tuple) else (int(shape),)


def _check_info_sizes(
    buffers: tuple[torch.Tensor, ...], *, batch: int, qlen: int, heads: int, dtypes: tuple[torch.dtype, ...]
) -> tuple[tuple[int, ...], ...]:
    """The buffers (aiter's info order) have exactly the shapes ``get_mla_metadata_info_v1``
    gave for this kernel qlen, heads and dtypes (at a batch size >= the call's): the planner
    and the kernel read the plan's layout (tiles per request, partial rows) from them."""
    shapes = tuple(tuple(int(d) for d in b.shape) for b in buffers)
    sized = [
        info["shapes"]
        for info in _state.INFOS
        if (info["qlen"], info["heads"], info["dtypes"]) == (qlen, heads, dtypes) and info["batch"] >= batch
    ]
    check(
        shapes in sized,
        f"metadata buffers {shapes} were not sized by get_mla_metadata_info_v1 for this call's kernel "
        f"qlen {qlen}, {heads} heads and dtypes {dtypes} (it gives {sized or 'no answer for them'}); "
        "sized for another qlen they do not match the plan's layout and the kernel writes past them",
    )
    return shapes


def _planner_heads(heads: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, qlen: int) -> None:
    """``v1_2_device.cuh``'s head check: native counts, multiples of 16 (folded), 24 only where
    the build has the native-H24 planner."""
    arch, q_fp8, kv_fp8 = _state.arch(), _is_fp8(q_dtype), _is_fp8(kv_dtype)
    if heads == 24:
        check(
            bool(_state.CONFIG.get("native_h24_planner")),
            "get_mla_metadata_v1: only supports #heads in "
            "[16, 64, 128], or (#head, uni_seqlen_qo) = (16*N, 1) (no native 24-head planner here)",
        )
        check(
            arch == "gfx950" and not q_fp8 and not kv_fp8, "get_mla_metadata_v1: 24 heads need bf16 on gfx950"
        )
        return
    ok = heads % 16 == 0 or (arch == "gfx950" and heads == 8 and qlen == 4 and q_fp8 and kv_fp8)
    check(
        ok,
        f"get_mla_metadata_v1: only supports #heads in [16, 64, 128], or (#head, uni_seqlen_qo) = (16*N, 1); "
        f"got {heads}",
    )


def get_mla_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_heads_per_head_k: int,
    num_heads_k: int,
    is_causal: bool,
    work_metadata_ptrs: torch.Tensor,
    work_info_set: torch.Tensor,
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    page_size: int = 1,
    kv_granularity: int = 16,
    max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1,
    fast_mode: bool = True,
    topk: int = -1,
    max_split_per_batch: int = -1,
    intra_batch_mode: bool = False,
    is_cp_round_robin: bool = False,
    mla_version: int = 0,
    dtype_q_nope: torch.dtype | None = None,
    dtype_q_rope: torch.dtype | None = None,
    dtype_kv_nope: torch.dtype | None = None,
    dtype_kv_rope: torch.dtype | None = None,
    dtype_q: torch.dtype | None = None,
    dtype_kv: torch.dtype | None = None,
) -> None:
    """The decode work planner (on the device in aiter; here a host loop writing the buffers)."""
    for name, tensor in (("seqlens_qo_indptr", seqlens_qo_indptr), ("seqlens_kv_indptr", seqlens_kv_indptr)):
        _is_index(tensor, name)
    _is_index(kv_last_page_lens, "kv_last_page_lens")
    check(
        work_info_set.dim() == 2 and work_info_set.shape[1] == WORK_FIELDS and work_indptr.dim() == 1,
        "get_mla_metadata_v1: work_info_set must be [N, 8] and work_indptr 1-D (positional order: "
        "work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map, "
        "reduce_partial_map)",
    )
    check(
        work_metadata_ptrs.dtype == torch.uint64 and work_metadata_ptrs.numel() == 2,
        "work_metadata_ptrs: (2,) u64",
    )
    check(
        dtype_q is not None and dtype_kv is not None,
        "fake aiter: pass dtype_q/dtype_kv (aiter silently assumes bf16 otherwise; vLLM PR #46997)",
    )
    assert dtype_q is not None
    assert dtype_kv is not None
    check(
        num_heads_k == 1 and is_causal and page_size == 1,
        "the fake covers MLA decode metadata (1 kv head, causal)",
    )
    check(
        kv_granularity > 0 and kv_granularity & (kv_granularity - 1) == 0,
        "kv_granularity must be a power of 2",
    )
    heads = num_heads_per_head_k
    qo = [int(x) for x in seqlens_qo_indptr.tolist()]
    kv = [int(x) for x in seqlens_kv_indptr.tolist()]
    batch = len(kv) - 1
    check(
        len(qo) == batch + 1 and kv_last_page_lens.numel() == batch, "indptr / kv_last_page_lens sizes differ"
    )
    check(bool((kv_last_page_lens == 1).all()), "kv_last_page_lens must be 1 with page_size 1")
    steps = [qo[b + 1] - qo[b] for b in range(batch)]
    check(
        max_seqlen_qo >= max(steps, default=0),
        f"max_seqlen_qo {max_seqlen_qo} < a request's {max(steps)} rows",
    )
    _planner_heads(heads, dtype_q, dtype_kv, max_seqlen_qo)
    # With uni_seqlen_qo >= 1 the planner takes every request's row count from the constant.
    rows = [
        (b * uni_seqlen_qo, (b + 1) * uni_seqlen_qo) if uni_seqlen_qo >= 1 else (qo[b], qo[b + 1])
        for b in range(batch)
    ]
    size = _decode_sizes(batch, max_seqlen_qo, heads, dtype_q, dtype_kv)
    check(
        work_indptr.numel() >= size["splits"] + 1
        and work_info_set.shape[0] >= size["works"]
        and reduce_indptr.numel() >= size["tiles"] + 1
        and reduce_final_map.shape[0] >= size["tiles"]
        and reduce_partial_map.numel() >= size["partials"],
        f"get_mla_metadata_v1: buffers smaller than get_mla_metadata_info_v1 gives for this call {size}",
    )
    shapes = _check_info_sizes(
        (work_metadata_ptrs, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map),
        batch=batch,
        qlen=max_seqlen_qo,
        heads=heads,
        dtypes=(dtype_q, dtype_kv),
    )
    lengths = [kv[b + 1] - kv[b] for b in range(batch)]
    units = size["splits"]
    chunk = max(kv_granularity, -(-max(sum(lengths), 1) // units))
    chunk = -(-chunk // kv_granularity) * kv_granularity
    works: list[list[int]] = []
    finals: list[tuple[int, int]] = []
    partial_groups: list[list[int]] = []
    partials = 0
    for b in range(batch):
        if lengths[b] == 0:
            continue  # no work: the request's rows are not written
        pieces = -(-lengths[b] // chunk)
        qs, qe = rows[b]
        if pieces == 1:
            works.append([b, -1, qs, qe, kv[b], kv[b + 1], 0, 0])
            continue
        group = []
        for piece in range(pieces):
            ks, ke = kv[b] + piece * chunk, min(kv[b] + (piece + 1) * chunk, kv[b + 1])
            loc = partials * max_seqlen_qo
            partials += 1
            works.append([b, loc, qs, qe, ks, ke, kv[b + 1] - ke, 0])
            group.append(loc)
        finals.append((qs, qe))
        partial_groups.append(group)
    check(
        len(works) <= work_info_set.shape[0]
        and len(finals) <= reduce_final_map.shape[0]
        and partials <= reduce_partial_map.numel(),
        "fake planner overflowed the buffers",
    )
    per_unit = -(-len(works) // units) if works else 0
    indptr = [min(u * per_unit, len(works)) for u in range(work_indptr.numel())]
    work_indptr.copy_(torch.tensor(indptr, dtype=torch.int32))
    work_info_set.fill_(UNUSED)
    if works:
        work_info_set[: len(works)] = torch.tensor(works, dtype=torch.int32)
    reduce_counts = [0]
    for group in partial_groups:
        reduce_counts.append(reduce_counts[-1] + len(group))
    reduce_counts += [reduce_counts[-1]] * (reduce_indptr.numel() - len(reduce_counts))
    reduce_indptr.copy_(torch.tensor(reduce_counts, dtype=torch.int32))
    reduce_final_map.fill_(UNUSED)
    reduce_partial_map.fill_(UNUSED)
    if finals:
        reduce_final_map[: len(finals)] = torch.tensor(finals, dtype=torch.int32)
        flat = [loc for group in partial_groups for loc in group]
        reduce_partial_map[: len(flat)] = torch.tensor(flat, dtype=torch.int32)
    work_metadata_ptrs.copy_(
        torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()], dtype=torch.uint64)
    )
    _state.PLANS[work_metadata_ptrs.data_ptr()] = {
        "heads": heads,
        "dtype_q": dtype_q,
        "dtype_kv": dtype_kv,
        "max_seqlen_qo": max_seqlen_qo,
        "batch": batch,
        "shapes": shapes,
    }
    _state.record(
        "get_mla_metadata_v1",
        heads=heads,
        batch=batch,
        max_seqlen_qo=max_seqlen_qo,
        uni_seqlen_qo=uni_seqlen_qo,
        kv_granularity=kv_granularity,
        fast_mode=fast_mode,
        dtype_q=dtype_q,
        dtype_kv=dtype_kv,
    )


def _reduce(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None,
) -> None:
    check(
        partial_output.dtype == torch.float32 and partial_lse.dtype == torch.float32, "partials must be fp32"
    )
    heads, value_dim = final_output.shape[-2], final_output.shape[-1]
    check_reduce(heads, value_dim)
    parts_o = partial_output.reshape(-1, heads, value_dim)
    parts_lse = partial_lse.reshape(-1, heads)
    check(parts_o.shape[0] == parts_lse.shape[0], "partial_output / partial_lse rows differ")
    indptr = [int(x) for x in reduce_indptr.tolist()]
    for tile in range(len(indptr) - 1):
        begin, end = indptr[tile], indptr[tile + 1]
        if begin == end:
            continue
        assert reduce_final_map is not None
        qs, qe = (int(x) for x in reduce_final_map[tile].tolist())
        check(
            0 < qe - qs <= max_seqlen_q, f"reduce tile {tile} has {qe - qs} rows, max_seqlen_q {max_seqlen_q}"
        )
        locs = [int(x) for x in reduce_partial_map[begin:end].tolist()]
        check(
            all(loc >= 0 and loc + qe - qs <= parts_o.shape[0] for loc in locs), "partial rows out of range"
        )
        o, lse = merge(
            torch.stack([parts_o[loc : loc + qe - qs] for loc in locs]),
            torch.stack([parts_lse[loc : loc + qe - qs] for loc in locs]),
        )
        final_output[qs:qe] = o.to(final_output.dtype)
        if final_lse is not None:
            final_lse[qs:qe] = lse


def mla_reduce_v1(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    num_kv_splits: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    check(isinstance(num_kv_splits, int) and num_kv_splits >= 0, "num_kv_splits must be an int (0: auto)")
    check(
        isinstance(final_output, torch.Tensor), "final_output must be a tensor (check the positional order)"
    )
    _state.record(
        "mla_reduce_v1",
        max_seqlen_q=max_seqlen_q,
        num_kv_splits=num_kv_splits,
        final_lse=final_lse is not None,
    )
    _reduce(
        partial_output,
        partial_lse,
        reduce_indptr,
        reduce_final_map,
        reduce_partial_map,
        max_seqlen_q,
        final_output,
        final_lse,
    )


def mla_reduce_v1_legacy(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    """``mla_reduce_v1`` before ROCm/aiter#3391 (no ``num_kv_splits``)."""
    check(
        isinstance(final_output, torch.Tensor), "final_output must be a tensor (check the positional order)"
    )
    _state.record(
        "mla_reduce_v1", max_seqlen_q=max_seqlen_q, num_kv_splits=None, final_lse=final_lse is not None
    )
    _reduce(
        partial_output,
        partial_lse,
        reduce_indptr,
        reduce_final_map,
        reduce_partial_map,
        max_seqlen_q,
        final_output,
        final_lse,
    )


# -- fp8 persistent prefill ------------------------------------------------------------------


def get_ps_metadata_info_v1(
    batch_size: int, num_head_k: int, max_qlen: int, qlen_granularity: int = 256
) -> tuple[tuple[Any, torch.dtype], ...]:
    cu = _state.cu_num()
    clusters = math.gcd(num_head_k, cu)
    per_cluster = cu // clusters
    q_splits = math.ceil(max_qlen / qlen_granularity)
    _state.record(
        "get_ps_metadata_info_v1",
        batch=batch_size,
        heads=num_head_k,
        max_qlen=max_qlen,
        qlen_granularity=qlen_granularity,
    )
    return (
        (2, torch.uint64),
        (cu + 1, torch.int32),
        (((batch_size + per_cluster - 1) * q_splits * num_head_k, WORK_FIELDS), torch.int32),
        (batch_size * q_splits + 1, torch.int32),
        ((batch_size * q_splits, 2), torch.int32),
        (min(batch_size + per_cluster - 1, (per_cluster - 1) * 2) * q_splits, torch.int32),
    )


def _query_tiles(
    qo: list[int], ctx: list[int], qlen_gran: int, kv_gran: int, causal: bool
) -> list[list[int]]:
    """``[batch, q_start, q_end, units, effective kv]`` per q tile, ping-pong ordered per request."""
    tiles = []
    for b in range(len(qo) - 1):
        qlen, kvlen = qo[b + 1] - qo[b], ctx[b]
        ranges = [(s, min(s + qlen_gran, qlen)) for s in range(0, qlen, qlen_gran)]
        for i in range(len(ranges)):
            start, end = ranges[i // 2 if i % 2 == 0 else len(ranges) - 1 - i // 2]
            effective = min(kvlen - qlen + end, kvlen) if causal else kvlen
            units = -(-max(effective, 0) // kv_gran)
            tiles.append([b, start + qo[b], end + qo[b], units, effective])
    return tiles


def get_ps_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    pages_kv_indptr: torch.Tensor,
    context_lens: torch.Tensor,
    gqa_ratio: int,
    num_heads_k: int,
    work_metadata_ptrs: torch.Tensor,
    work_indptr: torch.Tensor,
    work_info: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    qhead_granularity: int = 1,
    qlen_granularity: int = 256,
    kvlen_granularity: int = 16,
    block_size: int = 16,
    is_causal: bool = True,
) -> None:
    """The host planner (``get_ps_metadata_v1_2_host``): KV units spread evenly over the CUs of
    each head cluster; a q tile split across CUs gets partial rows and a reduce entry."""
    for name, tensor in (
        ("seqlens_qo_indptr", seqlens_qo_indptr),
        ("pages_kv_indptr", pages_kv_indptr),
        ("context_lens", context_lens),
    ):
        _is_index(tensor, name)
        check(tensor.device.type == "cpu", f"get_ps_metadata_v1 is a host planner: {name} must be on the CPU")
    check(
        kvlen_granularity > 0 and kvlen_granularity & (kvlen_granularity - 1) == 0,
        "kvlen_granularity must be a power of 2",
    )
    check(kvlen_granularity % block_size == 0, "kvlen_granularity must be a multiple of block_size")
    check(
        work_indptr.dim() == 1 and work_info.dim() == 2 and work_info.shape[1] == WORK_FIELDS,
        "positional order: work_metadata_ptrs, work_indptr, work_info, reduce_*",
    )
    qo = [int(x) for x in seqlens_qo_indptr.tolist()]
    kv = [int(x) for x in pages_kv_indptr.tolist()]
    ctx = [int(x) for x in context_lens.tolist()]
    cu = _state.cu_num()
    clusters = math.gcd(num_heads_k, cu)
    per_cluster, heads_per_cluster = cu // clusters, num_heads_k // clusters
    blocks_per_unit = kvlen_granularity // block_size
    tiles = _query_tiles(qo, ctx, qlen_granularity, kvlen_granularity, is_causal)
    average, remainder = divmod(sum(t[3] for t in tiles), per_cluster)
    works: list[list[int]] = []
    indptr = [0] * work_indptr.numel()
    for cluster in range(clusters):
        tile_idx = block = partial = 0
        for tg in range(per_cluster):
            for offset in range(heads_per_cluster):
                head = cluster * heads_per_cluster + offset
                heads = ((head + 1) * qhead_granularity << 16) | (head * qhead_granularity)
                saved = (tile_idx, block, partial)
                capacity = (average + (tg < remainder)) * blocks_per_unit
                while tile_idx < len(tiles) and capacity > 0:
                    b, qs, qe, units, effective = tiles[tile_idx]
                    kv_start = block + kv[b]
                    if effective - block * block_size <= capacity * block_size:
                        consumed = units * blocks_per_unit - block
                        loc = -1 if block == 0 else qlen_granularity * partial
                        partial += block != 0
                        tile_idx, block = tile_idx + 1, 0
                    else:
                        consumed = capacity
                        loc = qlen_granularity * partial
                        partial += 1
                        block += consumed
                    works.append([b, loc, qs, qe, kv_start, min(kv_start + consumed, kv[b + 1]), 0, heads])
                    capacity -= consumed
                if offset != heads_per_cluster - 1:
                    tile_idx, block, partial = saved
            indptr[cluster * per_cluster + tg + 1] = len(works)
    groups: dict[tuple[int, int], set[int]] = {}
    for work in works:
        if work[1] != -1:
            groups.setdefault((work[2], work[3]), set()).add(work[1])
    flat = [loc for key in sorted(groups) for loc in sorted(groups[key])]
    check(
        len(works) <= work_info.shape[0]
        and len(groups) <= reduce_final_map.shape[0]
        and len(flat) <= reduce_partial_map.numel(),
        "get_ps_metadata_v1: the plan overflows the info buffers",
    )
    work_indptr.copy_(torch.tensor(indptr, dtype=torch.int32))
    work_info.fill_(UNUSED)
    if works:
        work_info[: len(works)] = torch.tensor(works, dtype=torch.int32)
    counts = [0]
    for key in sorted(groups):
        counts.append(counts[-1] + len(groups[key]))
    reduce_indptr.copy_(
        torch.tensor(counts + [counts[-1]] * (reduce_indptr.numel() - len(counts)), dtype=torch.int32)
    )
    reduce_final_map.fill_(UNUSED)
    reduce_partial_map.fill_(UNUSED)
    if groups:
        reduce_final_map[: len(groups)] = torch.tensor(sorted(groups), dtype=torch.int32)
        reduce_partial_map[: len(flat)] = torch.tensor(flat, dtype=torch.int32)
    work_metadata_ptrs.copy_(torch.tensor([work_indptr.data_ptr(), work_info.data_ptr()], dtype=torch.uint64))
    _state.record(
        "get_ps_metadata_v1",
        gqa_ratio=gqa_ratio,
        heads=num_heads_k,
        qhead_granularity=qhead_granularity,
        qlen_granularity=qlen_granularity,
        kvlen_granularity=kvlen_granularity,
        block_size=block_size,
        is_causal=is_causal,
        partial_tiles=counts[-1],
    )


def _scale(value: Any, name: str) -> float:
    check(
        isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() == 1,
        f"{name} must be a 1-element fp32 tensor",
    )
    return float(value.reshape(()))


def mla_prefill_ps_asm_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    softmax_scale: float,
    is_causal: bool,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check(_state.arch() != "gfx942", "fp8 mla persistent prefill is not supported on gfx942")
    for name, tensor in (("Q", Q), ("K", K), ("V", V)):
        require_fp8(tensor, name)
        check(tensor.dim() == 3, f"{name} must be 3-D")
    check(
        Q.shape[-1] == 192 and K.shape[-1] == 192 and V.shape[-1] == 128,
        "mla_pfl_qh192_vh128: qk head dim 192 and v head dim 128 only",
    )
    check(Q.shape[1] == K.shape[1] == V.shape[1], "the fp8 prefill kernel runs Gqa=1 (Hq == Hk)")
    check(
        output.dtype == torch.bfloat16 and tuple(output.shape) == (Q.shape[0], Q.shape[1], 128),
        "output must be bf16 [T, H, 128]",
    )
    check(isinstance(softmax_scale, float), "softmax_scale must be a float")
    for name, tensor in (
        ("qo_indptr", qo_indptr),
        ("kv_indptr", kv_indptr),
        ("kv_page_indices", kv_page_indices),
    ):
        _is_index(tensor, name)
    assert work_indptr is not None
    assert work_info_set is not None
    check(splitData.dtype == torch.float32 and splitLse.dtype == torch.float32, "partials must be fp32")
    qs_, ks_, vs_ = _scale(q_scale, "q_scale"), _scale(k_scale, "k_scale"), _scale(v_scale, "v_scale")
    _state.record(
        "mla_prefill_ps_asm_fwd",
        max_seqlen_q=max_seqlen_q,
        softmax_scale=softmax_scale,
        causal=is_causal,
        tokens=Q.shape[0],
        heads=Q.shape[1],
    )
    qf, kf, vf = Q.float() * qs_, K.float() * ks_, V.float() * vs_
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    check(
        max_seqlen_q >= max((qo[b + 1] - qo[b] for b in range(len(qo) - 1)), default=0),
        "max_seqlen_q too small",
    )
    pages = kv_page_indices.long()
    for w in range(int(work_indptr[-1])):
        b, loc, qs, qe, ks, ke, _offset, heads = (int(x) for x in work_info_set[w].tolist())
        h0, h1 = heads & 0xFFFF, heads >> 16
        rows = torch.arange(qs - qo[b], qe - qo[b])
        keys = pages[ks:ke]
        positions = keys - kv[b]
        sq, sk = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        visible = (
            causal_visible(rows, positions, sk - sq)
            if is_causal
            else torch.ones(len(rows), len(keys), dtype=torch.bool)
        )
        o, lse = attend(qf[qs:qe, h0:h1], kf[keys, h0:h1], vf[keys, h0:h1], visible, softmax_scale)
        if loc == -1:
            o, lse = undefined_where_empty(o, lse)
            output[qs:qe, h0:h1] = o.to(output.dtype)
        else:
            check(
                loc + qe - qs <= splitData.shape[0],
                f"partial rows {loc}.. beyond splitData's {splitData.shape[0]}",
            )
            splitData[loc : loc + qe - qs, h0:h1] = o
            splitLse[loc : loc + qe - qs, h0:h1] = lse
