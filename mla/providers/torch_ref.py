"""The torch reference provider: every kernel contract in plain PyTorch.

Rules, for every contract: exact (float32 accumulation); no host read of device data and no
shape that depends on tensor values (shapes come from the static bounds a call carries:
``max_seqlen_k``, token counts, a schedule's size), so a decode step captured in a CUDA graph
replays right; no boolean-mask indexing. The work follows the call, not the engine's limits:
the decode is one pass over the query tokens and the ``max_seqlen_k`` keys they may see, and a
planned split-KV schedule is emulated by its coverage of the keys, not item by item
(:mod:`mla.providers.torch_attention`). One exception reads values: the varlen prefill of host
tensors reads the indptrs on the host (no device is involved) and works request by request over
the actual lengths. Its capability record can be replaced (``TorchProvider(capabilities=...)``)
to emulate another provider's limits on a CPU.

Fixed shapes mean masked positions still gather a row (the clamped index's: the null block,
another request's or a stale one). Those rows are zeroed (``torch.where``) before any product, so
no value from memory a row may not see reaches it, not even as ``0 * NaN``; where one product
serves rows with different windows (the fp8 prefill tiles), a row that sees a non-finite value
gets NaN explicitly, as the reference math gives it.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from mla.core.capabilities import REFERENCE_CAPABILITIES, ProviderCapabilities
from mla.core.config import is_ds_mla
from mla.core.errors import PlanMismatchError
from mla.core.platform import Platform
from mla.core.support import Support
from mla.providers import torch_attention, torch_sparse
from mla.providers.base import KernelProvider
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    ExpandPagesCall,
    Fp8PrefillCall,
    Fp8PrefillPlanCall,
    IndexTopkCall,
    MergeStatesCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    SparseAttentionCall,
    VarlenPrefillCall,
    WriteIndexKeysCall,
    WriteKVCall,
    appended_passes,
)
from mla.providers.formats import pack_ds_mla, scatter_rows
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.torch_attention import CHUNK_ELEMENTS, dequant, row_chunks, softmax_stats, token_requests
from mla.providers.transforms import flat_token_ids

FP8_PREFILL_TILE_Q = 256
"""Query rows per fp8 prefill tile (aiter's ``_FP8_PREFILL_TILE_Q``)."""
FP8_PREFILL_KV_SPLIT = 1024
"""KV tokens per fp8 prefill work item; longer ranges become several partials."""


def _visible_values_product(probs: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``probs [H, Q, K] @ values [K, H, V]`` -> ``[Q, H, V]`` where one value tile serves rows
    with different windows: non-finite values are zeroed so a row that does not see them stays
    finite (no ``0 * NaN``), and a row that does see one (``visible [Q, K]``) gets NaN."""
    finite = torch.isfinite(values)
    out = torch.einsum("hqk,khv->qhv", probs, torch.where(finite, values, 0.0))
    bad_keys = (~finite).any(dim=-1).to(torch.float32)  # [K, H]
    sees_bad = torch.einsum("qk,kh->qh", visible.to(torch.float32), bad_keys) > 0
    return torch.where(sees_bad[..., None], torch.full_like(out, float("nan")), out)


def _merge_into(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    target: torch.Tensor,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-merge partial rows ``[P, H, D]``/``[P, H]`` into ``num_rows`` rows by ``target``
    (``target == num_rows`` discards). Returns float32 o ``[num_rows, H, D]``, lse."""
    heads, dim = o_parts.shape[1], o_parts.shape[2]
    dev = o_parts.device
    row_max = torch.full((num_rows + 1, heads), float("-inf"), device=dev)
    idx = target[:, None].expand(-1, heads)
    row_max = row_max.scatter_reduce(0, idx, lse_parts, reduce="amax", include_self=True)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    # A part without keys (lse -inf) weighs 0 and adds nothing, whatever its rows hold; a NaN
    # part (it saw a NaN) makes its row NaN.
    weight = torch.exp(lse_parts - safe_max[target])
    weight = torch.where(lse_parts == float("-inf"), torch.zeros_like(weight), weight)
    wsum = torch.zeros(num_rows + 1, heads, device=dev).index_add_(0, target, weight)
    # scatter_add_, not index_add_: the CPU index_add_ of wide rows is ~1000x slower.
    weighted = torch.where(weight[..., None] == 0, 0.0, o_parts * weight[..., None])
    acc = torch.zeros(num_rows + 1, heads, dim, device=dev).scatter_add_(
        0, target[:, None, None].expand_as(weighted), weighted
    )
    o = acc / wsum.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    lse = torch.where(wsum == 0, torch.full_like(wsum, float("-inf")), torch.log(wsum) + safe_max)
    return o[:num_rows], lse[:num_rows]


@attrs.frozen(eq=False)
class Fp8PrefillTiles:
    """Host-planned work items of the torch fp8 prefill: one per (q tile, kv split)."""

    items: tuple[tuple[int, int, int, int, int], ...]
    """``(q_start, q_end, kv_start, kv_end, causal_offset)``: rows ``q_start..q_end`` attend keys
    ``kv_start..kv_end``; row ``t`` may see key ``k`` when ``k - kv_base <= t - q_base +
    causal_offset`` (``causal_offset`` folds the request bases and ``Sk - Sq``)."""
    num_tokens: int


class TorchProvider(KernelProvider):
    """Reference kernels in PyTorch. ``capabilities`` imposes another provider's limits."""

    name: ClassVar[str] = "torch"

    def __init__(self, capabilities: ProviderCapabilities | None = None) -> None:
        self._imposed = capabilities

    def __repr__(self) -> str:
        imposed = f", emulating={self._imposed.provider!r}" if self._imposed else ""
        return f"TorchProvider({imposed.lstrip(', ')})"

    def availability(self) -> Support:
        return Support.yes()

    def capabilities(self, platform: Platform) -> ProviderCapabilities:
        return self._imposed if self._imposed is not None else REFERENCE_CAPABILITIES

    # -- decode -----------------------------------------------------------------------------

    def paged_mqa_decode(self, call: PagedDecodeCall) -> None:
        torch_attention.paged_decode(call)

    def decode_schedule_buffers(self, call: DecodeScheduleBuffersCall) -> SplitKVSchedule:
        return SplitKVSchedule.allocate(
            max_batch=call.max_batch,
            max_kernel_qlen=call.max_kernel_qlen,
            kernel_heads=call.kernel_heads,
            kv_lora_rank=call.kv_lora_rank,
            num_units=call.platform.num_compute_units,
            device=call.device,
            min_chunk=16,
        )

    def plan_decode_schedule(self, call: PlanDecodeScheduleCall) -> None:
        if not isinstance(call.schedule, SplitKVSchedule):
            raise PlanMismatchError(
                f"the torch provider takes a SplitKVSchedule, got {type(call.schedule).__name__}"
            )
        call.schedule.plan(call.kv_indptr, call.batch_size)

    def small_head_decode(self, call: SmallHeadDecodeCall) -> None:
        torch_attention.small_head_decode(call)

    # -- prefill ----------------------------------------------------------------------------

    def varlen_attention(self, call: VarlenPrefillCall) -> None:
        if call.appended is not None:
            for one_pass in appended_passes(call):
                self.varlen_attention(one_pass)
            return
        if call.k_pe is not None:
            # Every head's keys as one tensor: [k | k_pe] (the reference's own copy).
            heads = call.k.shape[1]
            whole = torch.cat([call.k, call.k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
            call = attrs.evolve(call, k=whole, k_pe=None)
        if call.prior_out is not None and call.prior_lse is not None:
            # This call's state in float32, then the merge-states rule into out/lse (which may be
            # the prior tensors themselves: the prior is read by the merge before it writes).
            part = torch.empty(call.out.shape, dtype=torch.float32, device=call.out.device)
            part_lse = torch.empty_like(call.lse)
            self.varlen_attention(attrs.evolve(call, out=part, lse=part_lse, prior_out=None, prior_lse=None))
            merge = MergeStatesCall(
                o_a=call.prior_out,
                lse_a=call.prior_lse,
                o_b=part,
                lse_b=part_lse,
                out=call.out,
                lse_out=call.lse,
            )
            self.merge_states(merge)
            return
        if call.q.device.type == "cpu" and call.cu_seqlens_q.device.type == "cpu":
            # On the host the lengths cost nothing to read: per-request work that follows
            # the actual lengths, not the bound (max_seqlen_k) the fixed-shape form pays for.
            call.out.copy_(_mha_varlen_host(call, call.lse))
            return
        o, row_lse = _mha_varlen(
            call.q.to(torch.float32),
            call.k.to(torch.float32),
            call.v.to(torch.float32),
            call.cu_seqlens_q,
            call.cu_seqlens_k,
            max_seqlen_k=call.max_seqlen_k,
            scale=call.softmax_scale,
            causal=call.causal,
        )
        call.out.copy_(o)
        call.lse.copy_(row_lse)

    def plan_fp8_prefill(self, call: Fp8PrefillPlanCall) -> Fp8PrefillTiles:
        causal = call.causal
        cu_q = [int(x) for x in call.cu_seqlens_q_cpu.tolist()]
        cu_k = [int(x) for x in call.cu_seqlens_k_cpu.tolist()]
        items: list[tuple[int, int, int, int, int]] = []
        for b in range(len(cu_q) - 1):
            sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            # key k (absolute) is visible to row t (absolute) when k - cu_k[b] <= t - cu_q[b] + sk - sq
            offset = cu_k[b] - cu_q[b] + sk - sq
            for q0 in range(cu_q[b], cu_q[b + 1], FP8_PREFILL_TILE_Q):
                q1 = min(q0 + FP8_PREFILL_TILE_Q, cu_q[b + 1])
                kv_end = min(cu_k[b + 1], q1 - 1 + offset + 1) if causal else cu_k[b + 1]
                for k0 in range(cu_k[b], max(kv_end, cu_k[b]), FP8_PREFILL_KV_SPLIT):
                    k1 = min(k0 + FP8_PREFILL_KV_SPLIT, kv_end)
                    items.append((q0, q1, k0, k1, offset if causal else 1 << 30))
        return Fp8PrefillTiles(items=tuple(items), num_tokens=cu_q[-1])

    def fp8_prefill(self, call: Fp8PrefillCall) -> None:
        schedule, q, out, lse = call.schedule, call.q, call.out, call.lse
        if not isinstance(schedule, Fp8PrefillTiles):
            raise PlanMismatchError(
                f"the torch provider takes Fp8PrefillTiles, got {type(schedule).__name__}"
            )
        qf = dequant(q, call.q_scale)
        kf, vf = dequant(call.k, call.k_scale), dequant(call.v, call.v_scale)
        num_tokens = q.shape[0]
        parts_o: list[torch.Tensor] = []
        parts_lse: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        for q0, q1, k0, k1, offset in schedule.items:
            scores = torch.einsum("qhd,khd->hqk", qf[q0:q1], kf[k0:k1]) * call.softmax_scale
            rows = torch.arange(q0, q1, device=q.device)[:, None]
            keys = torch.arange(k0, k1, device=q.device)[None, :]
            valid = (keys <= rows + offset)[None]
            probs, part_lse = softmax_stats(scores, ~valid)
            parts_o.append(_visible_values_product(probs, vf[k0:k1], valid[0]))
            parts_lse.append(part_lse.transpose(0, 1))
            targets.append(torch.arange(q0, q1, device=q.device))
        if not parts_o:
            out.zero_()
            lse.fill_(float("-inf"))
            return
        o, row_lse = _merge_into(torch.cat(parts_o), torch.cat(parts_lse), torch.cat(targets), num_tokens)
        out.copy_(o)
        lse.copy_(row_lse)

    # -- utilities --------------------------------------------------------------------------

    def merge_states(self, call: MergeStatesCall) -> None:
        lse_a, lse_b = call.lse_a, call.lse_b
        merged_lse = torch.logaddexp(lse_a, lse_b)
        safe = torch.where(torch.isfinite(merged_lse), merged_lse, torch.zeros_like(merged_lse))
        none = torch.zeros_like(safe)
        w_a = torch.where(lse_a == float("-inf"), none, torch.exp(lse_a - safe))
        w_b = torch.where(lse_b == float("-inf"), none, torch.exp(lse_b - safe))
        # A state without keys (weight 0) contributes nothing, whatever its rows hold.
        part_a = torch.where(w_a[..., None] == 0, 0.0, call.o_a.to(torch.float32) * w_a[..., None])
        part_b = torch.where(w_b[..., None] == 0, 0.0, call.o_b.to(torch.float32) * w_b[..., None])
        merged = part_a + part_b
        call.out.copy_(merged)
        if call.lse_out is not None:
            call.lse_out.copy_(merged_lse)

    def expand_page_indices(self, call: ExpandPagesCall) -> None:
        num_tokens, block_size, out = call.num_tokens, call.block_size, call.out
        if num_tokens == 0:
            return
        req, _ = token_requests(call.kv_indptr, num_tokens)
        offset = torch.arange(num_tokens, device=out.device) - call.kv_indptr[req]
        block = call.block_table[req, offset // block_size].to(torch.int64)
        out[:num_tokens].copy_(flat_token_ids(block, offset, block_size, None))

    def write_kv(self, call: WriteKVCall) -> None:
        kv_cache = call.kv_cache
        if call.slot_mapping.numel() == 0:
            return
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        if is_ds_mla(kv_cache.dtype):
            scatter_rows(flat, call.slot_mapping, pack_ds_mla(call.kv_c, call.k_pe))
            return
        rows = torch.cat([call.kv_c, call.k_pe], dim=-1).to(torch.float32)
        if call.kv_scale is not None:
            finfo = torch.finfo(kv_cache.dtype)
            rows = torch.clamp(rows / call.kv_scale, finfo.min, finfo.max)
        rows = rows.to(kv_cache.dtype)
        if rows.element_size() == 1:
            # fp8 has no where/index_copy_ kernels on every device: move the bytes instead.
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        slots = call.slot_mapping.to(torch.int64)
        valid = (slots >= 0) & (slots < flat.shape[0])
        # Skipped rows re-write the first valid row's value at its slot: identical writes,
        # so the scatter stays deterministic without boolean-mask indexing.
        first = torch.argmax(valid.to(torch.int8))
        src = torch.where(valid, torch.arange(slots.numel(), device=slots.device), first)
        index = torch.clamp(slots[src], min=0)
        values = torch.where(valid[src][:, None], rows[src], flat[index])
        flat.index_copy_(0, index, values)

    # -- sparse (DeepSeek Sparse Attention) ------------------------------------------------

    def sparse_attention(self, call: SparseAttentionCall) -> None:
        torch_sparse.sparse_attention(call)

    def write_index_keys(self, call: WriteIndexKeysCall) -> None:
        torch_sparse.write_index_keys(call)

    def index_topk(self, call: IndexTopkCall) -> None:
        torch_sparse.index_topk(call)


def _mha_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen MHA in float32 with fixed shapes (bottom-right causal)."""
    num_tokens, heads, dim = q.shape
    out = torch.zeros(num_tokens, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_seqlen_k == 0 or k.shape[0] == 0:
        return out, lse
    req, owned = token_requests(cu_q, num_tokens)
    row = torch.arange(num_tokens, device=q.device) - cu_q[req]
    sq = cu_q[req + 1] - cu_q[req]
    sk = cu_k[req + 1] - cu_k[req]
    limit = torch.clamp(row + sk - sq + 1, min=0) if causal else sk
    limit = torch.where(owned, torch.minimum(limit, sk), torch.zeros_like(limit))
    offsets = torch.arange(max_seqlen_k, device=q.device)
    step = row_chunks(num_tokens, max_seqlen_k * heads * dim).step
    for lo in range(0, num_tokens, step):
        hi = min(lo + step, num_tokens)
        valid = offsets[None, :] < limit[lo:hi, None]
        pos = torch.clamp(cu_k[req[lo:hi]][:, None] + offsets[None, :], 0, k.shape[0] - 1)
        keys = torch.where(valid[..., None, None], k[pos], 0.0)
        values = torch.where(valid[..., None, None], v[pos], 0.0)
        scores = torch.einsum("nhd,nkhd->nhk", q[lo:hi], keys) * scale
        probs, row_lse = softmax_stats(scores, ~valid[:, None, :])
        out[lo:hi] = torch.einsum("nhk,nkhv->nhv", probs, values)
        lse[lo:hi] = row_lse
    return out, lse


def _mha_varlen_host(call: VarlenPrefillCall, lse: torch.Tensor) -> torch.Tensor:
    """:func:`_mha_varlen` for host tensors, request by request (the indptrs read on the host):
    batched matmuls over each request's own keys, query rows in chunks of bounded size, and
    under causal masking only the keys a chunk's last row sees. Same float32 math and rules
    (bottom-right causal; rows without keys give 0 and ``-inf``; a non-finite value reaches
    only the rows that see it). Writes ``lse``; returns the float32 output."""
    q, k, v = call.q.to(torch.float32), call.k.to(torch.float32), call.v.to(torch.float32)
    num_tokens, heads, _ = q.shape
    out = torch.zeros(num_tokens, heads, v.shape[-1], dtype=torch.float32)
    lse.fill_(float("-inf"))
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    scale, causal = call.softmax_scale, call.causal
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq <= 0 or sk <= 0:
            continue
        keys = k[k0:k1].transpose(0, 1)  # [H, sk, D]
        values = v[k0:k1]  # [sk, H, V]
        finite = torch.isfinite(values)
        clean = torch.where(finite, values, 0.0).transpose(0, 1)  # [H, sk, V]
        bad_keys = (~finite).any(dim=-1).any(dim=-1)  # [sk]
        step = max(1, CHUNK_ELEMENTS // (sk * heads))
        for r0 in range(0, sq, step):
            r1 = min(r0 + step, sq)
            # Row r sees keys <= r + sk - sq (bottom-right); the chunk needs keys up to its last.
            seen = min(sk, r1 + sk - sq) if causal else sk
            if seen <= 0:
                continue
            rows = torch.arange(r0, r1)[:, None]
            visible = (
                torch.arange(seen)[None, :] <= rows + (sk - sq)
                if causal
                else torch.ones(r1 - r0, seen, dtype=torch.bool)
            )
            scores = torch.bmm(q[q0 + r0 : q0 + r1].transpose(0, 1), keys[:, :seen].transpose(1, 2)) * scale
            probs, row_lse = softmax_stats(scores, ~visible[None])
            part = torch.bmm(probs, clean[:, :seen]).transpose(0, 1)  # [r, H, V]
            sees_bad = (visible & bad_keys[None, :seen]).any(dim=-1)
            if bool(sees_bad.any()):
                part = torch.where(sees_bad[:, None, None], torch.full_like(part, float("nan")), part)
            out[q0 + r0 : q0 + r1] = part
            lse[q0 + r0 : q0 + r1] = row_lse.transpose(0, 1)
    return out
