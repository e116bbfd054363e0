"""Byte layouts of the sparse caches: ``fp8_ds_mla`` latent rows and fp8 index keys.

``fp8_ds_mla`` (DeepSeek-V3.2's latent cache, 656 bytes per token at 512/64): per token, the
``L`` latent values as e4m3 in ``L / 128`` tiles, one float32 scale per tile, then the ``R`` rope
values in bf16. Each tile's scale is ``amax / 448`` rounded up to a power of two (UE8M0), so
``value = e4m3 * scale`` and no tile saturates.

fp8 index keys (132 bytes per token at head dim 128): a cache block holds its ``block_size``
tokens' ``D`` e4m3 values, then their ``block_size`` float32 scales (DeepGEMM's paged layout);
the scale is per token, rounded up to a power of two the same way.

Every function is plain torch (any device, no host sync); providers' kernels read and write the
same bytes.
"""

from __future__ import annotations

import torch

from mla.core.config import DS_MLA_TILE, ds_mla_row_bytes

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_MIN_AMAX = 1e-4
"""Floor of a tile's ``amax`` before its scale is taken (an all-zero tile gets a tiny scale)."""


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** ceil(log2(amax / 448))``: the UE8M0 scale of values with that ``amax``
    (exact: the ratio's binary exponent, one less when the ratio is a power of two)."""
    ratio = torch.clamp(amax.to(torch.float32), min=_MIN_AMAX) / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)
    return torch.ldexp(torch.ones_like(ratio), exponent - (mantissa == 0.5).to(exponent.dtype))


def pack_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``fp8_ds_mla`` rows ``uint8 [N, L + 4 L/128 + 2 R]`` of latent ``kv_c [N, L]`` and rope
    ``k_pe [N, R]`` (any float dtype; ``L`` a multiple of 128)."""
    rows, rank = kv_c.shape
    rope = k_pe.shape[-1]
    tiles = rank // DS_MLA_TILE
    latent = kv_c.to(torch.float32).view(rows, tiles, DS_MLA_TILE)
    scale = power_of_two_scale(latent.abs().amax(dim=-1))
    values = torch.clamp(latent / scale[..., None], -E4M3_MAX, E4M3_MAX).to(E4M3)
    out = torch.empty(rows, ds_mla_row_bytes(rank, rope), dtype=torch.uint8, device=kv_c.device)
    out[:, :rank] = values.view(rows, rank).view(torch.uint8)
    out[:, rank : rank + 4 * tiles] = scale.contiguous().view(torch.uint8).view(rows, 4 * tiles)
    out[:, rank + 4 * tiles :] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).view(rows, 2 * rope)
    return out


def unpack_ds_mla(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> torch.Tensor:
    """float32 ``[N, L+R]`` latent rows of ``fp8_ds_mla`` byte rows ``[N, W]``."""
    return torch.cat(ds_mla_parts(rows, kv_lora_rank, rope_dim), dim=-1)


def ds_mla_parts(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(latent [..., L], rope [..., R])`` of ``fp8_ds_mla`` byte rows ``[..., W]`` of
    any leading shape (e.g. the rows a batch gathered, ``cache[slots]``), without joining them."""
    lead = rows.shape[:-1]
    tiles = kv_lora_rank // DS_MLA_TILE
    values = rows[..., :kv_lora_rank].view(E4M3).to(torch.float32)
    scale = rows[..., kv_lora_rank : kv_lora_rank + 4 * tiles].contiguous().view(torch.float32)
    rope = rows[..., kv_lora_rank + 4 * tiles :].contiguous().view(torch.bfloat16).to(torch.float32)
    latent = values.reshape(*lead, tiles, DS_MLA_TILE) * scale.reshape(*lead, tiles, 1)
    return latent.reshape(*lead, kv_lora_rank), rope.reshape(*lead, rope_dim)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 keys: ``(e4m3 [N, D], float32 scale [N])`` with power-of-two scales."""
    scale = power_of_two_scale(keys.to(torch.float32).abs().amax(dim=-1))
    values = torch.clamp(keys.to(torch.float32) / scale[:, None], -E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, scale


def quantize_index_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's fp8 index queries: ``q [T, Hi, D]`` (float) quantized per (row, head) with
    a power-of-two scale (as :func:`quantize_index_keys` does per token) and ``weights [T, Hi]``
    multiplied by that scale, so that the indexer's scores over ``(e4m3 [T, Hi, D], float32
    [T, Hi])`` are those of the dequantized queries (the scale is positive: it moves out of the
    ReLU)."""
    rows, heads, dim = q.shape
    values, scale = quantize_index_keys(q.reshape(rows * heads, dim))
    return values.view(rows, heads, dim), weights.to(torch.float32) * scale.view(rows, heads)


def index_cache_blocks(index_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an fp8 index-key cache ``uint8 [blocks, bs, D + 4]``: its values
    ``e4m3 [blocks, bs, D]`` and scales ``float32 [blocks, bs]`` (no copy)."""
    blocks, block_size = index_cache.shape[:2]
    flat = index_cache.view(blocks, block_size * (head_dim + 4))
    values = flat[:, : block_size * head_dim].view(E4M3).view(blocks, block_size, head_dim)
    scales = flat[:, block_size * head_dim :].view(torch.float32).view(blocks, block_size)
    return values, scales


def read_index_keys(
    index_cache: torch.Tensor, key_dtype: torch.dtype, slots: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """float32 ``[*slots.shape, D]`` keys at flat ``slots`` (every slot must be inside the cache)."""
    slots = slots.to(torch.int64)
    if key_dtype != E4M3:
        return index_cache.reshape(-1, head_dim)[slots].to(torch.float32)
    block_size = index_cache.shape[1]
    values, scales = index_cache_blocks(index_cache, head_dim)
    block, offset = slots // block_size, slots % block_size
    return values[block, offset].to(torch.float32) * scales[block, offset][..., None]


def scatter_plan(slots: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src, keep, index)`` of a fixed-shape scatter of ``slots`` into ``capacity`` rows.

    Row ``i`` writes source row ``src[i]`` at ``index[i]`` when ``keep[i]``, else re-writes what
    ``index[i]`` holds: a slot outside ``[0, capacity)`` re-writes the first written row (or,
    when none is written, row 0 re-writes itself), so duplicates are identical writes and the
    scatter stays deterministic without a host sync.
    """
    slots = slots.to(torch.int64)
    valid = (slots >= 0) & (slots < capacity)
    first = torch.argmax(valid.to(torch.int8))
    src = torch.where(valid, torch.arange(slots.numel(), device=slots.device), first)
    keep = valid[src]
    return src, keep, torch.where(keep, slots[src], 0)


def scatter_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[slots[i]] = rows[i]`` for the slots inside ``flat [M, W]``; the others are skipped."""
    if slots.numel() == 0:
        return
    src, keep, index = scatter_plan(slots, flat.shape[0])
    flat.index_copy_(0, index, torch.where(keep[:, None], rows[src], flat[index]))


def write_index_keys(
    keys: torch.Tensor, index_cache: torch.Tensor, key_dtype: torch.dtype, slot_mapping: torch.Tensor
) -> None:
    """Write ``keys [N, D]`` at flat ``slot_mapping [N]`` (negative or past the cache: skipped)."""
    head_dim = keys.shape[-1]
    if slot_mapping.numel() == 0:
        return
    if key_dtype != E4M3:
        scatter_rows(index_cache.view(-1, head_dim), slot_mapping, keys.to(index_cache.dtype))
        return
    values, scale = quantize_index_keys(keys)
    cache_values, cache_scales = index_cache_blocks(index_cache, head_dim)
    block_size = index_cache.shape[1]
    src, keep, index = scatter_plan(slot_mapping, index_cache.shape[0] * block_size)
    block, offset = index // block_size, index % block_size
    byte_values = cache_values.view(torch.uint8)
    new_values = values.view(torch.uint8)[src]
    byte_values[block, offset] = torch.where(keep[:, None], new_values, byte_values[block, offset])
    cache_scales[block, offset] = torch.where(keep, scale[src], cache_scales[block, offset])
