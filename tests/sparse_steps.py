"""What the sparse engine tests on the CPU (``test_sparse_engine``) and on a GPU
(``test_sparse_gpu``) share: a mixed step's sparse attention through the impl (decode rows, then
prefill rows), its float64 reference per phase, the comparison, and the indexer's selection check
against the float64 scores."""

from __future__ import annotations

import torch

import mla
from mla.testing.sparse import selection_tolerance
from mla.tools.demo_sparse import selection_gap
from mla.tools.reference import reference_index_scores, reference_sparse


def phase_requests(
    step: mla.StepInputs, num_decodes: int, prefill: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query_start_loc, seq_lens, block_table)`` of one phase's requests of ``step`` (its
    first ``num_decodes`` requests decode)."""
    qsl, seq, table = step.query_start_loc, step.seq_lens, step.block_table
    if prefill:
        return qsl[num_decodes:] - qsl[num_decodes], seq[num_decodes:], table[num_decodes:]
    return qsl[: num_decodes + 1], seq[:num_decodes], table[:num_decodes]


def attend(
    backend: mla.MLABackend,
    metadata: mla.MLAMetadata,
    num_decode_tokens: int,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    kv_scale: float | torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's sparse attention through the impl, decode rows (the first
    ``num_decode_tokens``) then prefill rows, into the (NaN-poisoned) ``out`` and ``lse``."""
    nd = num_decode_tokens
    if metadata.num_decodes:
        backend.impl.forward_sparse_decode(
            metadata, q[:nd], kv_cache, selection[:nd], out=out[:nd], lse=lse[:nd], kv_scale=kv_scale
        )
    if metadata.num_prefills:
        backend.impl.forward_sparse_prefill(
            metadata, q[nd:], kv_cache, selection[nd:], out=out[nd:], lse=lse[nd:], kv_scale=kv_scale
        )
    return out, lse


def reference(
    step: mla.StepInputs,
    num_decodes: int,
    num_decode_tokens: int,
    rows: int,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    selection: torch.Tensor,
    kv_scale: float | None,
    *,
    softmax_scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_sparse` per phase, rows concatenated (``rows`` in all)."""
    parts = []
    for prefill, part in ((False, slice(0, num_decode_tokens)), (True, slice(num_decode_tokens, rows))):
        qsl, seq, table = phase_requests(step, num_decodes, prefill)
        parts.append(
            reference_sparse(
                q[part],
                kv_cache,
                table,
                seq,
                qsl,
                selection[part],
                softmax_scale=softmax_scale,
                kv_lora_rank=kv_lora_rank,
                kv_scale=kv_scale,
            )
        )
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def assert_close(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], tol: float, context: str
) -> None:
    """Relative Frobenius error of the output and absolute LSE error at most ``tol``; rows without
    a position are exactly 0 with ``lse = -inf``; nothing left NaN."""
    out, lse = (x.detach().cpu() for x in got)
    ref_out, ref_lse = want
    o = out.double()
    assert not torch.isnan(o).any(), f"{context}: output rows left unwritten (NaN)"
    assert not torch.isnan(lse).any(), f"{context}: lse rows left unwritten (NaN)"
    error = float(torch.linalg.vector_norm(o - ref_out)) / max(
        float(torch.linalg.vector_norm(ref_out)), 1e-30
    )
    assert error <= tol, f"{context}: out rel. error {error:.3g} > {tol}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{context}: -inf LSE rows differ"
    assert bool((o[empty] == 0).all()), f"{context}: a head with no position is not 0"
    finite = ~empty
    if bool(finite.any()):
        lse_error = float((lse.double()[finite] - ref_lse[finite]).abs().max())
        assert lse_error <= tol, f"{context}: lse abs. error {lse_error:.3g} > {tol}"


def check_selection(
    step: mla.StepInputs,
    owned: int,
    selected: torch.Tensor,
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    spec: mla.IndexerSpec,
    topk: int,
    context: str,
) -> None:
    """Tie-robust top-k against the float64 scores; rows past the first ``owned`` (graph
    padding) hold only ``-1``."""
    scores = reference_index_scores(
        index_q,
        weights,
        index_cache,
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        key_dtype=spec.key_dtype,
        softmax_scale=spec.scale,
    )
    chosen = selected.cpu()
    gap = selection_gap(scores, chosen, topk)
    assert gap <= selection_tolerance(index_q.dtype), f"{context}: selection gap {gap}"
    assert bool((chosen[owned:] == -1).all()), f"{context}: padding rows select positions"
