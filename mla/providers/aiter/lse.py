"""Where the aiter provider's LSE comes from, and the rows aiter's kernels leave undefined.

The provider contract asks every attention kernel for ``lse [T, H]`` (natural log) and for
``o = 0, lse = -inf`` on rows with no visible key. aiter does not always give either:

* ``mla_decode_fwd(return_lse=True)`` is free in non-persistent mode (the stage-2 reduce
  computes it), but in persistent mode it selects the ``*_lse_ps`` asm kernel variant, which
  aiter ships only for some (arch, dtype, gqa, qlen) combinations (``mla_asm.csv``: gfx942 has
  one, for fp8 gqa64 qlen 1; gfx950 has them except for fp8 gqa16 qlen 2). Asking for it
  elsewhere aborts with "cannot get heuristic kernel". :func:`kernel_returns_decode_lse` is
  that rule; where it says no (and for aiter builds without ``return_lse``), the LSE is computed
  by a reference pass on the device (:func:`reference_decode_lse`,
  :func:`reference_small_head_lse`: exact, graph-safe, one more read of the KV rows). A decode
  called with ``lse=None`` needs no LSE: it neither asks aiter for one nor runs that pass.
* The fp8 persistent prefill writes unsplit tiles straight to the output and keeps no LSE for
  them, so its LSE always comes from :func:`prefill_lse` (scores only, no softmax-V product).
* Rows with no visible key (graph-padding requests, fully masked causal rows) get +inf from
  aiter's reducer, NaN, or are not written at all; :func:`clear_empty_rows` writes the contract's
  zeros and ``-inf`` there, from the indptrs alone (device ops, no sync).
"""

from __future__ import annotations

import attrs
import torch

from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.torch_ref import TorchProvider

_REFERENCE = TorchProvider()
"""The torch reference kernels the LSE passes run on (stateless)."""

FOLDED_FP8_HEADS = frozenset({32, 64, 128})
"""fp8 head counts ``mla_decode_fwd`` runs natively on gfx950; other multiples of 16 fold to 16."""


def kernel_returns_decode_lse(arch: str, *, persistent: bool, fp8: bool, heads: int, qlen: int) -> bool:
    """Whether ``mla_decode_fwd(return_lse=True)`` keeps a kernel that exists.

    ``heads``/``qlen`` are the kernel heads and kernel qlen of the call. Non-persistent calls
    never change kernels for the LSE. Persistent calls need an ``lse_ps`` kernel for the
    (gqa, qSeqLen) that ``asm_mla.cu`` remaps the call to (``hsa/<arch>/mla/mla_asm.csv``):
    gfx950 bf16 always remaps to gqa32/qlen4 or gqa64/qlen1 (both have one); gfx950 fp8 has one
    everywhere except gqa16 at qSeqLen 2 (16 heads, or 48/80/96/112 folded to 16, at qlen 2);
    gfx942 only for fp8 with 64 native heads at qlen 1.
    """
    if not persistent:
        return True
    if arch == "gfx950":
        if not fp8:
            return True
        effective = heads if heads in FOLDED_FP8_HEADS else 16
        return not (effective == 16 and qlen == 2)
    if arch == "gfx942":
        return fp8 and heads == 64 and qlen == 1
    return False


def _rows_of(indptr: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows ``0..num_rows-1``: the owning request (clamped) and whether one owns the row."""
    num_requests = indptr.numel() - 1
    rows = torch.arange(num_rows, device=indptr.device)
    req = torch.searchsorted(indptr[1:].contiguous(), rows.to(indptr.dtype), right=True)
    owned = req < num_requests
    return torch.clamp(req, max=max(num_requests - 1, 0)).to(torch.int64), owned


def empty_decode_rows(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bool ``[num_rows]``: decode rows that see no key (right-aligned causal) or no request."""
    req, owned = _rows_of(qo_indptr, num_rows)
    row = torch.arange(num_rows, device=qo_indptr.device) - qo_indptr[req]
    qlen = qo_indptr[req + 1] - qo_indptr[req]
    kv_len = kv_indptr[req + 1] - kv_indptr[req]
    visible = torch.minimum(kv_len - qlen + row + 1, kv_len)
    return ~owned | (visible <= 0)


def empty_indptr_rows(row_indptr: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bool ``[num_rows]``: rows whose ``row_indptr`` range is empty (small-head decode rows)."""
    return (row_indptr[1 : num_rows + 1] - row_indptr[:num_rows]) <= 0


def empty_varlen_rows(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_rows: int, *, causal: bool
) -> torch.Tensor:
    """bool ``[num_rows]``: varlen rows that see no key (bottom-right causal) or no request."""
    req, owned = _rows_of(cu_seqlens_q, num_rows)
    row = torch.arange(num_rows, device=cu_seqlens_q.device) - cu_seqlens_q[req]
    sq = cu_seqlens_q[req + 1] - cu_seqlens_q[req]
    sk = cu_seqlens_k[req + 1] - cu_seqlens_k[req]
    visible = torch.minimum(sk - sq + row + 1, sk) if causal else sk
    return ~owned | (visible <= 0)


def clear_empty_rows(out: torch.Tensor, lse: torch.Tensor | None, empty: torch.Tensor) -> None:
    """``out[r] = 0`` and ``lse[r] = -inf`` (when an lse is given) where ``empty[r]`` (masked
    writes, no sync)."""
    out.masked_fill_(empty[:, None, None], 0.0)
    if lse is not None:
        lse.masked_fill_(empty[:, None], float("-inf"))


def reference_decode_lse(call: PagedDecodeCall, q: torch.Tensor, out: torch.Tensor) -> None:
    """The paged decode's LSE ``out [T, H]`` (float32) by a reference pass over ``call``'s KV
    rows, with query ``q [T, H, L+R]`` in a float dtype (an fp8-rounded query comes
    dequantized); the attention output it also computes is discarded."""
    rows, heads = q.shape[0], q.shape[1]
    scratch = torch.empty(rows, heads, call.out.shape[-1], dtype=torch.float32, device=q.device)
    _REFERENCE.paged_mqa_decode(attrs.evolve(call, q=q, out=scratch, lse=out, schedule=None))


def reference_small_head_lse(call: SmallHeadDecodeCall, out: torch.Tensor) -> None:
    """The small-head decode's LSE ``out [T, H]`` (float32) by a reference pass over ``call``'s
    KV rows."""
    scratch = torch.empty(call.q_nope.shape, dtype=torch.float32, device=call.q_nope.device)
    _REFERENCE.small_head_decode(attrs.evolve(call, out=scratch, lse=out))


_LSE_CHUNK_ELEMENTS = 1 << 24
"""Score elements per chunk of :func:`prefill_lse` (bounds its scratch memory)."""


def prefill_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    *,
    scale: float,
    causal: bool,
    out: torch.Tensor,
) -> None:
    """``out[t, h] = logsumexp_j (q_t · k_j) * scale`` over each row's visible keys.

    q ``[T, H, D]``, k ``[Tk, H, D]`` (any float dtype; fp8 inputs come dequantized), host
    ``cu_seqlens`` (the prefill plan has them). Rows with no visible key get ``-inf``.
    """
    out.fill_(float("-inf"))
    heads = q.shape[1]
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0 or sk == 0:
            continue
        keys = k[k0:k1].to(torch.float32)
        step = max(1, _LSE_CHUNK_ELEMENTS // (heads * sk))
        for r0 in range(0, sq, step):
            r1 = min(r0 + step, sq)
            scores = torch.einsum("qhd,khd->hqk", q[q0 + r0 : q0 + r1].to(torch.float32), keys) * scale
            if causal:
                rows = torch.arange(r0, r1, device=q.device)[:, None]
                cols = torch.arange(sk, device=q.device)[None, :]
                scores = scores.masked_fill((cols > rows + (sk - sq))[None], float("-inf"))
            out[q0 + r0 : q0 + r1] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
