"""Fake ``aiter/mla.py``: ``mla_decode_fwd`` with aiter's checks, dispatch and math.

The signature is chosen by ``fake_config.json`` (``decode_signature``): the current one, one
without ``return_lse``, or the pre-Dec-2025 one (no ``page_size``/``nhead_kv``/``return_lse``).
Persistent calls read the work items that ``get_mla_metadata_v1`` wrote into the buffers, so a
stale or mismatched plan gives wrong rows, as on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from aiter import _asm_table, _state
from aiter._math import attend, causal_visible, check, merge, require_fp8, undefined_where_empty
from aiter.ops.attention import WORK_FIELDS

PERSISTENT_BUFFERS = (
    "work_meta_data",
    "work_indptr",
    "work_info_set",
    "reduce_indptr",
    "reduce_final_map",
    "reduce_partial_map",
)


def _type(tensor: torch.Tensor, name: str) -> str:
    if tensor.dtype == torch.bfloat16:
        return "bf16"
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        require_fp8(tensor, name)
        return "fp8"
    raise RuntimeError(f"mla_decode_stage1_asm_fwd: unsupport {name} dtype: {tensor.dtype}")


def _scale(value: Any, name: str) -> float:
    check(
        isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() == 1,
        f"{name} must be a 1-element fp32 tensor",
    )
    return float(value.reshape(()))


def _attend_rows(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_indices: torch.Tensor,
    request: tuple[int, int, int, int],
    key_range: tuple[int, int],
    scale: float,
    value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``q0..q1`` of a request (keys ``k0..k1`` of kv_indices) against keys ``ks..ke``."""
    q0, q1, k0, k1 = request
    ks, ke = key_range
    rows = torch.arange(q1 - q0)
    positions = torch.arange(ks - k0, ke - k0)
    visible = causal_visible(rows, positions, (k1 - k0) - (q1 - q0))
    keys = kv[kv_indices[ks:ke].long()]
    return attend(q[q0:q1], keys[:, None, :], keys[:, None, :value_dim], visible, scale)


def _decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    *,
    page_size: int,
    nhead_kv: int,
    sm_scale: float | None,
    logit_cap: float,
    q_scale: torch.Tensor | None,
    kv_scale: torch.Tensor | None,
    return_lse: bool,
    buffers: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    arch = _state.arch()
    check(sm_scale is not None, "fake aiter: pass sm_scale explicitly (aiter's default is 1/sqrt(576))")
    assert sm_scale is not None
    assert logit_cap <= 0, f"logit_cap={logit_cap} is not support yet"
    check(
        q.dim() == 3 and kv_buffer.dim() == 4,
        "q must be [T, H, D] and kv_buffer [pages, page_size, nhead_kv, D]",
    )
    check(q.is_contiguous(), "mla_decode_stage1_asm_fwd:only support Q.is_contiguous() for now")
    check(
        nhead_kv == 1 and kv_buffer.shape[2] == 1,
        "mla_decode_stage1_asm_fwd:only support num_kv_heads==1 for now",
    )
    check(page_size == kv_buffer.shape[1] == 1, "the fake covers page_size 1 (flat token indices)")
    check(q.shape[2] == kv_buffer.shape[3] == 576, "aiter's MLA decode kernels take 576-wide rows (512 + 64)")
    check(
        o.dim() == 3 and o.shape[:2] == q.shape[:2] and o.shape[2] == 512 and o.dtype == torch.bfloat16,
        f"o must be bf16 [{q.shape[0]}, {q.shape[1]}, 512], got {o.dtype} {tuple(o.shape)}",
    )
    for name, tensor in (
        ("qo_indptr", qo_indptr),
        ("kv_indptr", kv_indptr),
        ("kv_indices", kv_indices),
        ("kv_last_page_lens", kv_last_page_lens),
    ):
        check(tensor.dtype == torch.int32 and tensor.dim() == 1, f"{name} must be 1-D int32")
    batch = qo_indptr.numel() - 1
    check(kv_indptr.numel() == batch + 1 and kv_last_page_lens.numel() == batch, "indptr sizes differ")
    check(bool((kv_last_page_lens == 1).all()), "kv_last_page_lens must be 1 with page_size 1")
    q_type, kv_type = _type(q, "Q"), _type(kv_buffer, "KV")
    if q_type == "fp8":
        check(
            q_scale is not None and kv_scale is not None,
            "mla_decode_stage1_asm_fwd: fp8 Q requires q_scale and kv_scale",
        )
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    check(
        max_seqlen_q >= max((qo[b + 1] - qo[b] for b in range(batch)), default=0),
        f"max_seqlen_q {max_seqlen_q} < a request's rows",
    )
    check(all(0 <= qo[b] <= qo[b + 1] <= q.shape[0] for b in range(batch)), "qo_indptr beyond q")
    used = kv_indices[: kv[-1]].long()
    check(bool(((used >= 0) & (used < kv_buffer.shape[0])).all()), "kv_indices out of the cache")
    given = [name for name in PERSISTENT_BUFFERS if buffers[name] is not None]
    check(len(given) in (0, len(PERSISTENT_BUFFERS)), f"persistent buffers: all six or none, got {given}")
    nhead = q.shape[1]
    persistent = bool(given) and _asm_table.keeps_persistent(
        arch, batch, nhead, max_seqlen_q, q_type == "fp8", kv_type == "fp8"
    )
    _state.record(
        "mla_decode_fwd",
        persistent=persistent,
        heads=nhead,
        max_seqlen_q=max_seqlen_q,
        q_dtype=q.dtype,
        kv_dtype=kv_buffer.dtype,
        sm_scale=sm_scale,
        return_lse=return_lse,
        batch=batch,
    )
    if persistent:
        run_heads, folded = _asm_table.persistent_heads(
            arch, nhead, max_seqlen_q, q_type == "fp8", kv_type == "fp8"
        )
    else:
        run_heads, folded = nhead, False
        if q_type == "fp8":
            _asm_table.block_n_fp8(nhead, max_seqlen_q)
    check(
        q_type == kv_type or persistent, "no non-persistent bf16-q/fp8-kv kernel"
    )  # a16w8 is persistent-only
    _asm_table.asm_kernel(arch, q_type, kv_type, run_heads, persistent, max_seqlen_q, return_lse)
    qf = q.float() * (_scale(q_scale, "q_scale") if q_type == "fp8" else 1.0)
    kvf = kv_buffer.reshape(kv_buffer.shape[0], -1).float()
    if kv_type == "fp8":
        check(kv_scale is not None, "fp8 KV needs kv_scale")
        kvf = kvf * _scale(kv_scale, "kv_scale")
    final_lse = torch.full((q.shape[0], nhead), float("nan")) if return_lse else None
    target = torch.full_like(o, float("nan")) if folded and max_seqlen_q > 1 else o
    if persistent:
        logits = _persistent(
            qf, kvf, target, final_lse, qo, kv, kv_indices, max_seqlen_q, sm_scale, run_heads, buffers
        )
    else:
        logits = torch.empty(0)
        for b in range(batch):
            if qo[b + 1] == qo[b]:
                continue
            out, lse = _attend_rows(
                qf, kvf, kv_indices, (qo[b], qo[b + 1], kv[b], kv[b + 1]), (kv[b], kv[b + 1]), sm_scale, 512
            )
            out, lse = undefined_where_empty(out, lse)
            target[qo[b] : qo[b + 1]] = out.to(target.dtype)
            if final_lse is not None:
                final_lse[qo[b] : qo[b + 1]] = lse
    if target is not o:
        o.set_(target)  # aiter rebinds the caller's tensor after a folded multi-token run
    return logits, final_lse


def _persistent(
    qf: torch.Tensor,
    kvf: torch.Tensor,
    o: torch.Tensor,
    final_lse: torch.Tensor | None,
    qo: list[int],
    kv: list[int],
    kv_indices: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    run_heads: int,
    buffers: dict[str, Any],
) -> torch.Tensor:
    meta, work_indptr, work_info = buffers["work_meta_data"], buffers["work_indptr"], buffers["work_info_set"]
    plan = _state.PLANS.get(meta.data_ptr())
    check(plan is not None, "work_meta_data was never planned by get_mla_metadata_v1")
    assert plan is not None
    check(
        meta.tolist() == [work_indptr.data_ptr(), work_info.data_ptr()],
        "work_meta_data points at other work_indptr/work_info_set buffers",
    )
    heads = qf.shape[1]
    facts = {"heads": heads, "max_seqlen_qo": max_seqlen_q, "batch": len(qo) - 1}
    for key, value in facts.items():
        check(plan[key] == value, f"metadata planned with {key}={plan[key]}, the decode runs {value}")
    given = tuple(tuple(int(d) for d in buffers[name].shape) for name in PERSISTENT_BUFFERS)
    planned = plan["shapes"]
    # The kernel sizes its partials from reduce_partial_map and walks the planned layout.
    check(
        given == planned,
        f"the decode got metadata buffers {given}, the plan was made in {planned}",
    )
    check(work_info.shape[1] == WORK_FIELDS, "work_info_set must be [N, 8]")
    partial_map = buffers["reduce_partial_map"]
    _asm_table.check_reduce(run_heads, 512)
    rows = partial_map.numel() * max_seqlen_q
    logits = torch.full((rows, 1, heads, 512), float("nan"))
    attn_lse = torch.full((rows, 1, heads, 1), float("nan"))
    for w in range(int(work_indptr[-1])):
        b, loc, qs, qe, ks, ke, _offset, _pad = (int(x) for x in work_info[w].tolist())
        out, lse = _attend_rows(qf, kvf, kv_indices, (qs, qe, kv[b], kv[b + 1]), (ks, ke), scale, 512)
        if loc == -1:
            out, lse = undefined_where_empty(out, lse)
            o[qs:qe] = out.to(o.dtype)
            if final_lse is not None:
                final_lse[qs:qe] = lse
        else:
            check(loc + qe - qs <= rows, "partial rows beyond the buffer sized from reduce_partial_map")
            logits[loc : loc + qe - qs, 0] = out
            attn_lse[loc : loc + qe - qs, 0, :, 0] = lse
    indptr = [int(x) for x in buffers["reduce_indptr"].tolist()]
    for tile in range(len(indptr) - 1):
        if indptr[tile] == indptr[tile + 1]:
            continue
        qs, qe = (int(x) for x in buffers["reduce_final_map"][tile].tolist())
        locs = [int(x) for x in partial_map[indptr[tile] : indptr[tile + 1]].tolist()]
        out, lse = merge(
            torch.stack([logits[loc : loc + qe - qs, 0] for loc in locs]),
            torch.stack([attn_lse[loc : loc + qe - qs, 0, :, 0] for loc in locs]),
        )
        o[qs:qe] = out.to(o.dtype)
        if final_lse is not None:
            final_lse[qs:qe] = lse
    return logits


def _check_plan_dtypes(q: torch.Tensor, kv_buffer: torch.Tensor, meta: torch.Tensor | None) -> None:
    if meta is None:
        return
    plan = _state.PLANS.get(meta.data_ptr())
    if plan is not None:
        check(
            plan["dtype_q"] == q.dtype and plan["dtype_kv"] == kv_buffer.dtype,
            f"metadata planned for q/kv {plan['dtype_q']}/{plan['dtype_kv']}, the decode runs "
            f"{q.dtype}/{kv_buffer.dtype} (vLLM PR #46997)",
        )


def _current(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    page_size: int = 1,
    nhead_kv: int = 1,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    num_kv_splits_indptr: torch.Tensor | None = None,
    work_meta_data: torch.Tensor | None = None,
    work_indptr: torch.Tensor | None = None,
    work_info_set: torch.Tensor | None = None,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    intra_batch_mode: bool = False,
    return_logits: bool = False,
    return_lse: bool = False,
    g_kv_indptr: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check(
        num_kv_splits is None and num_kv_splits_indptr is None and causal and g_kv_indptr is None,
        "the fake covers the default (auto-split, causal, no context parallel) decode",
    )
    _check_plan_dtypes(q, kv_buffer, work_meta_data)
    return _decode(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        page_size=page_size,
        nhead_kv=nhead_kv,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
        q_scale=q_scale,
        kv_scale=kv_scale,
        return_lse=return_lse,
        buffers={
            "work_meta_data": work_meta_data,
            "work_indptr": work_indptr,
            "work_info_set": work_info_set,
            "reduce_indptr": reduce_indptr,
            "reduce_final_map": reduce_final_map,
            "reduce_partial_map": reduce_partial_map,
        },
    )


def _no_return_lse(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    page_size: int = 1,
    nhead_kv: int = 1,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    work_meta_data: torch.Tensor | None = None,
    work_indptr: torch.Tensor | None = None,
    work_info_set: torch.Tensor | None = None,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_plan_dtypes(q, kv_buffer, work_meta_data)
    logits, _ = _decode(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        page_size=page_size,
        nhead_kv=nhead_kv,
        sm_scale=sm_scale,
        logit_cap=logit_cap,
        q_scale=q_scale,
        kv_scale=kv_scale,
        return_lse=False,
        buffers={
            "work_meta_data": work_meta_data,
            "work_indptr": work_indptr,
            "work_info_set": work_info_set,
            "reduce_indptr": reduce_indptr,
            "reduce_final_map": reduce_final_map,
            "reduce_partial_map": reduce_partial_map,
        },
    )
    # Builds without return_lse hand back a final_lse only the persistent path fills.
    return logits, torch.full(o.shape[:2], float("nan"))


def _legacy(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    num_kv_splits_indptr: torch.Tensor | None = None,
    work_meta_data: torch.Tensor | None = None,
    work_indptr: torch.Tensor | None = None,
    work_info_set: torch.Tensor | None = None,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    intra_batch_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _no_return_lse(
        q,
        kv_buffer,
        o,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_lens,
        max_seqlen_q,
        1,
        1,
        sm_scale,
        logit_cap,
        work_meta_data,
        work_indptr,
        work_info_set,
        reduce_indptr,
        reduce_final_map,
        reduce_partial_map,
        q_scale,
        kv_scale,
    )


mla_decode_fwd = {"current": _current, "no_return_lse": _no_return_lse, "legacy": _legacy}[
    _state.CONFIG.get("decode_signature", "current")
]
