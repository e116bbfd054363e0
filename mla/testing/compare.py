"""Comparison with the float64 reference: per-dtype tolerances, the error record, NaN poisoning.

Tolerances are relative Frobenius errors per output dtype (:data:`TOLERANCES`); outputs are
poisoned with NaN before a run so an unwritten row shows up as NaN.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping

import attrs
import torch
import torch.utils.deterministic as det

from mla.core.config import dtype_name

TOLERANCES: Mapping[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
"""Largest relative Frobenius error of the output (and relative LSE error) per output dtype."""


def tolerance_for(dtype: torch.dtype) -> float:
    """The tolerance for outputs of ``dtype`` (bf16, fp16 or fp32)."""
    if dtype not in TOLERANCES:
        known = ", ".join(dtype_name(d) for d in TOLERANCES)
        raise ValueError(f"no tolerance for output dtype {dtype_name(dtype)}; known: {known}")
    return TOLERANCES[dtype]


@attrs.frozen
class Comparison:
    """How far a strategy's ``(out, lse)`` is from the float64 reference."""

    dtype: torch.dtype
    """The output dtype (decides the tolerance)."""
    tolerance: float
    out_error: float
    """``||out - ref|| / ||ref||`` (Frobenius, float64); NaN when ``out`` has NaNs."""
    lse_error: float
    """Largest ``|lse - ref| / (1 + |ref|)`` over entries finite in both (0 without an LSE)."""
    unwritten_rows: int
    """Token rows whose output or LSE still holds the NaN poison."""
    lse_inf_mismatches: int
    """LSE entries that are ``-inf`` in exactly one of the result and the reference."""
    with_lse: bool = True
    """Whether an LSE was produced and compared (``False``: the run passed ``lse=None``)."""

    @property
    def ok(self) -> bool:
        return (
            self.unwritten_rows == 0
            and self.lse_inf_mismatches == 0
            and self.out_error <= self.tolerance
            and self.lse_error <= self.tolerance
        )

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        if not self.with_lse:
            return (
                f"{verdict} (lse=None): out rel. error {self.out_error:.3g} (tolerance "
                f"{self.tolerance:g} for {dtype_name(self.dtype)}), {self.unwritten_rows} unwritten rows"
            )
        return (
            f"{verdict}: out rel. error {self.out_error:.3g}, lse rel. error {self.lse_error:.3g} "
            f"(tolerance {self.tolerance:g} for {dtype_name(self.dtype)}), "
            f"{self.unwritten_rows} unwritten rows, {self.lse_inf_mismatches} -inf LSE mismatches"
        )


def compare_to_reference(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    *,
    tolerance: float | None = None,
) -> Comparison:
    """Compare ``out [T, H, D]`` / ``lse [T, H]`` with the reference (any device, any float dtype).

    Rows of ``ref_lse`` that are ``-inf`` (no visible key, graph padding) must be ``-inf`` in
    ``lse`` too, and their output rows zero (they count in the Frobenius error). ``lse=None``
    compares the output only (a run that asked for no LSE). ``tolerance`` defaults to
    :func:`tolerance_for` the output dtype.
    """
    if out.shape != ref_out.shape or (lse is not None and lse.shape != ref_lse.shape):
        lse_shape = None if lse is None else tuple(lse.shape)
        raise ValueError(
            f"shapes differ: out {tuple(out.shape)} vs {tuple(ref_out.shape)}, "
            f"lse {lse_shape} vs {tuple(ref_lse.shape)}"
        )
    tol = tolerance_for(out.dtype) if tolerance is None else tolerance
    o, r = out.detach().cpu().to(torch.float64), ref_out.detach().cpu().to(torch.float64)
    nan_rows = torch.isnan(o).flatten(1).any(1)
    denom = float(torch.linalg.vector_norm(r))
    out_error = float(torch.linalg.vector_norm(o - r)) / (denom if denom > 0 else 1.0)
    lse_error, inf_mismatches = 0.0, 0
    if lse is not None:
        lse_d = lse.detach().cpu().to(torch.float64)
        ref_lse_d = ref_lse.detach().cpu().to(torch.float64)
        nan_rows |= torch.isnan(lse_d).flatten(1).any(1)
        inf_mismatch = torch.isneginf(lse_d) != torch.isneginf(ref_lse_d)
        inf_mismatches = int((inf_mismatch & ~torch.isnan(lse_d)).sum())
        finite = torch.isfinite(lse_d) & torch.isfinite(ref_lse_d)
        lse_rel = (lse_d - ref_lse_d).abs() / (1.0 + ref_lse_d.abs())
        lse_error = float(lse_rel[finite].max()) if bool(finite.any()) else 0.0
        if bool(torch.isnan(lse_d).any()):
            lse_error = math.nan
    return Comparison(
        dtype=out.dtype,
        tolerance=tol,
        out_error=out_error,
        lse_error=lse_error,
        unwritten_rows=int(nan_rows.sum()),
        lse_inf_mismatches=inf_mismatches,
        with_lse=lse is not None,
    )


def assert_matches_reference(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    *,
    context: str = "",
) -> Comparison:
    """:func:`compare_to_reference`, raising ``AssertionError`` (with the numbers) on a mismatch."""
    comparison = compare_to_reference(out, lse, ref_out, ref_lse)
    if not comparison.ok:
        prefix = f"{context}: " if context else ""
        raise AssertionError(f"{prefix}{comparison}")
    return comparison


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Within the block, ``torch.empty`` fills float tensors with NaN (integers with their max).

    Poisons outputs that a function allocates itself (``mla_decode``/``mla_prefill``), so rows it
    forgets to write show up as NaN. Uses PyTorch's deterministic mode in warn-only form and
    restores the previous state on exit.
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = bool(getattr(det, "fill_uninitialized_memory", False))
    torch.use_deterministic_algorithms(True, warn_only=True)
    setattr(det, "fill_uninitialized_memory", True)  # noqa: B010 (untyped module attribute)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        setattr(det, "fill_uninitialized_memory", fill)  # noqa: B010
