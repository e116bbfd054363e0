"""Row and head remapping transforms shared by the builder (index maps) and run (tensor moves).

Each transform is defined once here; strategies call the planning half in ``build_metadata``
and the tensor half in ``run``, so the two can never disagree.

* Head padding: a kernel that needs ``Hk`` heads runs ``H`` query heads padded by
  repeat-interleave (``Hk % H == 0``) and unpadded by a strided slice, or padded by
  tile-and-slice and unpadded by a leading slice. Exact: each head attends independently over
  the shared latent KV.
* Qlen padding: a request of ``q`` tokens runs as ``Lk`` kernel rows with ``Lk - q`` zero rows
  *prepended*; right-aligned causal windows stay correct because row ``i`` moves to kernel row
  ``Lk - q + i`` and sees keys ``<= s - Lk + (Lk - q + i)``.
* Verify rows: token ``i`` of a request with ``q`` tokens and ``s`` keys becomes an independent
  qlen-1 row over the first ``clamp(s - q + 1 + i, 0)`` keys.
"""

from __future__ import annotations

import enum

import attrs
import torch

from mla.providers.calls import FillPagesCall


class HeadPadMode(enum.Enum):
    NONE = "none"
    REPEAT = "repeat-interleave"
    TILE = "tile-and-slice"


@attrs.frozen
class HeadPadding:
    """How ``num_heads`` query heads map onto ``kernel_heads`` kernel heads."""

    num_heads: int
    kernel_heads: int

    def __attrs_post_init__(self) -> None:
        if self.kernel_heads < self.num_heads:
            raise ValueError(f"kernel_heads {self.kernel_heads} < num_heads {self.num_heads}")

    @property
    def mode(self) -> HeadPadMode:
        if self.kernel_heads == self.num_heads:
            return HeadPadMode.NONE
        if self.kernel_heads % self.num_heads == 0:
            return HeadPadMode.REPEAT
        return HeadPadMode.TILE

    def pad(self, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write q ``[T, H, D]`` padded to ``[T, Hk, D]`` into ``out`` and return it."""
        mode = self.mode
        if mode is HeadPadMode.NONE:
            out.copy_(q)
        elif mode is HeadPadMode.REPEAT:
            factor = self.kernel_heads // self.num_heads
            out.view(q.shape[0], self.num_heads, factor, q.shape[2]).copy_(
                q[:, :, None, :].expand(-1, -1, factor, -1)
            )
        else:
            for start in range(0, self.kernel_heads, self.num_heads):
                width = min(self.num_heads, self.kernel_heads - start)
                out[:, start : start + width].copy_(q[:, :width])
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """View of kernel-head tensor ``[T, Hk, ...]`` back to ``[T, H, ...]`` (same slicing
        as the padding, so the real heads' rows are read)."""
        mode = self.mode
        if mode is HeadPadMode.REPEAT:
            return x[:, :: self.kernel_heads // self.num_heads]
        if mode is HeadPadMode.TILE:
            return x[:, : self.num_heads]
        return x


@attrs.frozen(eq=False)
class KernelRowMaps:
    """Host-built maps between caller token rows and kernel rows (qlen padding)."""

    qo_indptr: torch.Tensor
    """int32 ``[B+1]``: kernel rows of each request."""
    source_token: torch.Tensor
    """int64 ``[Tk]``: the caller row each kernel row reads, ``-1`` for a prepended zero row."""
    kernel_row: torch.Tensor
    """int64 ``[T]``: the kernel row holding each caller row, ``Tk`` (a sink row) when no
    request owns the caller row."""
    num_kernel_rows: int


def qlen_padding_maps(query_start_loc_cpu: torch.Tensor, num_tokens: int, kernel_qlen: int) -> KernelRowMaps:
    """Maps for running every request at ``kernel_qlen`` rows (zero rows prepended).

    ``query_start_loc_cpu`` is the host ``[B+1]`` indptr; every request's qlen must be
    ``<= kernel_qlen``.
    """
    qsl = query_start_loc_cpu.to(torch.int64)
    num_requests = qsl.numel() - 1
    qlen = qsl[1:] - qsl[:-1]
    if num_requests and int(qlen.max()) > kernel_qlen:
        raise ValueError(f"a request has qlen {int(qlen.max())} > kernel qlen {kernel_qlen}")
    num_kernel = num_requests * kernel_qlen
    kernel_rows = torch.arange(num_kernel)
    req = kernel_rows // kernel_qlen
    slot = kernel_rows % kernel_qlen
    lead = kernel_qlen - qlen[req]
    source = torch.where(slot >= lead, qsl[req] + slot - lead, torch.full_like(slot, -1))
    token_row = torch.full((num_tokens,), num_kernel, dtype=torch.int64)
    owned_kernel = source >= 0
    token_row[source[owned_kernel]] = kernel_rows[owned_kernel]
    qo = torch.arange(0, (num_requests + 1) * kernel_qlen, kernel_qlen, dtype=torch.int32)
    return KernelRowMaps(qo.reshape(-1)[: num_requests + 1], source, token_row, num_kernel)


def verify_row_lengths(
    query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per caller row: owning request (``-1`` if none) and its causal window length.

    Row ``i`` of request ``b`` (``q_b`` tokens, ``s_b`` keys) sees ``clamp(s_b - q_b + 1 + i, 0)``
    keys (vLLM PR #50476: the whole range would let a verify token see later drafts).
    """
    qsl = query_start_loc_cpu.to(torch.int64)
    lens = seq_lens_cpu.to(torch.int64)
    num_requests = lens.numel()
    rows = torch.arange(num_tokens)
    req = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)
    owned = req < num_requests
    req_c = torch.clamp(req, max=max(num_requests - 1, 0))
    if num_requests == 0:
        return torch.full((num_tokens,), -1, dtype=torch.int64), torch.zeros(num_tokens, dtype=torch.int64)
    pos = rows - qsl[req_c]
    qlen = qsl[req_c + 1] - qsl[req_c]
    window = torch.clamp(lens[req_c] - qlen + 1 + pos, min=0)
    window = torch.where(owned, torch.minimum(window, lens[req_c]), torch.zeros_like(window))
    return torch.where(owned, req_c, torch.full_like(req_c, -1)), window


def gather_row_page_table(
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    row_request: torch.Tensor,
    row_indptr: torch.Tensor,
    *,
    total: int,
    out: torch.Tensor,
) -> None:
    """Device-side: ``out[row_indptr[t] + j] = kv_indices[kv_indptr[req(t)] + j]``.

    ``row_request`` ``[rows]`` (device, ``-1`` rows must have zero length), ``row_indptr``
    ``[rows+1]`` (device), ``total = row_indptr[-1]`` as a host int.
    """
    if total == 0:
        return
    pos = torch.arange(total, device=out.device)
    row = torch.searchsorted(row_indptr[1:].contiguous(), pos.to(row_indptr.dtype), right=True)
    offset = pos - row_indptr[row]
    req = torch.clamp(row_request[row], min=0)
    out[:total].copy_(kv_indices[kv_indptr[req] + offset])


OUTSIDE_CACHE = -1
"""The flat token id written for a block id outside the cache (negative, past
``KVCacheSpec.num_blocks`` when known, or past what an int32 id can hold): every kernel that
reads the cache by token id masks it (and any id past the cache tensor it is handed), so it
reads no memory and counts no key; it is never clamped into another block."""

_MAX_TOKEN_ID = (1 << 31) - 1


def flat_token_ids(
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    num_blocks: int | None,
    outside: int = OUTSIDE_CACHE,
) -> torch.Tensor:
    """``blocks * block_size + offsets % block_size`` (int64) where the block id is inside the
    cache (``0 <= block < num_blocks`` when known, and the id fits int32), ``outside``
    (:data:`OUTSIDE_CACHE` by default) elsewhere."""
    blocks = blocks.to(torch.int64)
    ids = blocks * block_size + offsets % block_size
    if num_blocks is not None and num_blocks * block_size - 1 <= _MAX_TOKEN_ID:
        inside = (blocks >= 0) & (blocks < num_blocks)  # every id inside fits int32
    else:
        inside = (blocks >= 0) & (ids <= _MAX_TOKEN_ID)
        if num_blocks is not None:
            inside &= blocks < num_blocks
    return torch.where(inside, ids, outside)


def fill_page_indices(call: FillPagesCall) -> None:
    """The torch form of :class:`~mla.providers.calls.FillPagesCall` (any device, no host sync).

    Work is ``B x max_len`` lanes; the lanes past each request's length (and, with
    ``call.compact``, the tokens outside the cache) scatter into the last entry of
    ``kv_indices`` (scratch). Without ``kv_indices`` the work is ``B x pages``.
    """
    bs, table, max_len = call.block_size, call.block_table, call.max_len
    indptr = call.kv_indptr
    lens = call.seq_lens.clamp(0, max_len)
    indptr[:1].zero_()
    indptr[1:].copy_(torch.cumsum(lens, 0))
    if call.query_start_loc is not None and call.qo_indptr is not None:
        call.qo_indptr.copy_(call.query_start_loc)
    if call.length_count is not None:
        call.length_count.add_(bad_lengths(call.seq_lens, call.query_start_loc, max_len))
    if max_len == 0 or lens.numel() == 0:
        return
    if call.kv_indices is None:
        if call.invalid_count is not None:
            call.invalid_count.add_(outside_page_tokens(table, lens, bs, max_len, call.num_blocks))
        return
    position = torch.arange(max_len, device=table.device)
    tokens = flat_token_ids(table.index_select(1, position // bs), position, bs, call.num_blocks)
    # Lanes past a request's length write the scratch entry.
    scratch = call.kv_indices.numel() - 1
    live = position < lens[:, None]
    if call.invalid_count is not None:
        call.invalid_count.add_((live & (tokens < 0)).sum().to(torch.int32).reshape(1))
    if call.compact:
        # Tokens outside the cache are left out of their request's range: each request's kept
        # tokens take consecutive entries, and kv_indptr counts only them.
        live = live & (tokens >= 0)
        kept = torch.cumsum(live.to(lens.dtype), 1)
        indptr[1:].copy_(torch.cumsum(kept[:, -1], 0))
        dest = torch.where(live, indptr[:-1, None] + kept - 1, scratch)
    else:
        dest = torch.where(live, indptr[:-1, None] + position, scratch)
    call.kv_indices.scatter_(0, dest.view(-1), tokens.view(-1).to(torch.int32))


def bad_lengths(seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, max_len: int) -> torch.Tensor:
    """int32 ``[1]``: the requests whose length a fill bounded by ``max_len`` cannot take as it
    is (``FillPagesCall.length_count``): negative, past ``max_len``, or ``0 < seq_len < qlen``
    (qlens from ``query_start_loc``, 1 without it). No host sync."""
    bad = (seq_lens < 0) | (seq_lens > max_len)
    if query_start_loc is not None:
        qlens = query_start_loc[1:] - query_start_loc[:-1]
        bad |= (seq_lens > 0) & (seq_lens < qlens)
    return bad.sum().to(torch.int32).reshape(1)


def outside_page_tokens(
    block_table: torch.Tensor, lens: torch.Tensor, block_size: int, max_len: int, num_blocks: int | None
) -> torch.Tensor:
    """int32 ``[1]``: the tokens ``t < lens[b]`` (``lens`` already clamped to ``max_len``) whose
    block ``block_table[b, t // block_size]`` is outside the cache (negative, or past
    ``num_blocks`` when known), counted per page (``B x pages`` work, no host sync)."""
    pages = -(-max_len // block_size)
    blocks = block_table[:, :pages].to(torch.int64)
    starts = torch.arange(pages, device=block_table.device) * block_size
    in_page = (lens[:, None].to(torch.int64) - starts).clamp_(0, block_size)
    outside = blocks < 0
    if num_blocks is not None:
        outside |= blocks >= num_blocks
    return (in_page * outside).sum().to(torch.int32).reshape(1)
