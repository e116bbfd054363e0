"""How the provider calls aiter: exact arguments, one geometry from sizing to run, re-planning."""

from __future__ import annotations

import importlib
import math

import attrs
import pytest
import torch
from aiter_cases import decode_backend, decode_case, fake_provider, fp8_for, run_decode

from mla import PaddedAsmPersistent, PlanMismatchError
from mla.providers.aiter.schedule import AiterDecodeSchedule
from mla.providers.calls import (
    DecodeScheduleBuffersCall,
    PagedDecodeCall,
    PlanDecodeScheduleCall,
    SmallHeadDecodeCall,
    VarlenPrefillCall,
)
from mla.providers.torch_ref import TorchProvider
from mla.testing import compare_to_reference, make_decode_inputs
from mla.tools.reference import reference_prefill


def test_persistent_fp8_decode_uses_one_geometry_from_sizing_to_run(fake_aiter) -> None:
    fake = fake_aiter("gfx950")
    case = decode_case(8, (3, 3), (30, 9), kv_dtype=torch.float8_e4m3fn, max_decode_qlen=4)
    run = run_decode(fake_provider(), "gfx950", case)
    assert run.strategy == PaddedAsmPersistent.NAME
    assert run.comparison.ok, run.comparison
    infos = fake.calls("get_mla_metadata_info_v1")
    # Sized for every kernel qlen a step can plan (aiter's tile count is not monotonic in qlen).
    assert sorted(call["qlen"] for call in infos) == [1, 2, 3, 4]
    geometry = {(c["heads"], c["q_dtype"], c["kv_dtype"]) for c in infos}
    assert geometry == {(16, torch.float8_e4m3fn, torch.float8_e4m3fn)}
    (plan,) = fake.calls("get_mla_metadata_v1")
    assert (plan["heads"], plan["dtype_q"], plan["dtype_kv"]) == next(iter(geometry))
    assert (plan["max_seqlen_qo"], plan["uni_seqlen_qo"], plan["kv_granularity"]) == (4, 4, 16)
    (decode,) = fake.calls("mla_decode_fwd")
    assert decode["persistent"]
    assert decode["max_seqlen_q"] == 4
    assert decode["heads"] == 16
    assert decode["sm_scale"] == pytest.approx(case.scale)
    assert decode["return_lse"]  # gfx950 has an fp8 gqa16 qlen-4 lse_ps kernel


def test_mixed_qlens_plan_without_a_uniform_row_count(fake_aiter) -> None:
    fake = fake_aiter("gfx950")
    # Uniform requests plus a graph-padding request of qlen 0: not an exact arange of rows.
    for qlens, seqs, uniform in (
        ((1, 3, 2), (30, 9, 4), -1),
        ((4, 0, 4), (30, 0, 9), -1),
        ((4, 4), (30, 9), 4),
    ):
        run = run_decode(fake_provider(), "gfx950", decode_case(16, qlens, seqs, max_decode_qlen=4))
        assert run.comparison.ok, run.comparison
        assert fake.calls("get_mla_metadata_v1")[-1]["uni_seqlen_qo"] == uniform


def test_gfx942_persistent_decode_never_asks_for_a_missing_lse_kernel(fake_aiter) -> None:
    fake = fake_aiter("gfx942")
    run = run_decode(fake_provider(), "gfx942", decode_case(16, (1, 1, 1), (30, 9, 1)))
    assert run.comparison.ok, run.comparison
    assert [(c["persistent"], c["return_lse"]) for c in fake.calls("mla_decode_fwd")] == [(True, False)]


def test_one_backend_re_plans_its_persistent_buffers_every_step(fake_aiter) -> None:
    fake_aiter("gfx942")
    provider = fake_provider()
    first = decode_case(16, (1, 1, 1), (30, 9, 20), seed=1)
    inputs = make_decode_inputs(first)
    backend = decode_backend(provider, "gfx942", first, num_blocks=inputs.kv_cache.shape[0] + 8)
    schedules = set()
    for case in (first, decode_case(16, (1, 1), (4, 29), seed=2), first):
        step_inputs = make_decode_inputs(case)
        cache = torch.zeros(backend.cache.num_blocks or 0, case.block_size, 576, dtype=torch.bfloat16)
        cache[: step_inputs.kv_cache.shape[0]] = step_inputs.kv_cache
        metadata = backend.builder.build(step_inputs.step())
        assert metadata.decode is not None
        schedules.add(id(metadata.decode.schedule))  # type: ignore[attr-defined]
        out, lse = step_inputs.poisoned_outputs()
        backend.impl.forward_decode(metadata, step_inputs.q, cache, out=out, lse=lse)
        comparison = compare_to_reference(out, lse, *step_inputs.reference())
        assert comparison.ok, comparison
    assert len(schedules) == 1  # the same buffers, planned in place


def test_a_run_with_a_stale_plan_is_refused(fake_aiter) -> None:
    fake_aiter("gfx950")
    provider = fake_provider()
    schedule = provider.decode_schedule_buffers(
        DecodeScheduleBuffersCall(
            max_batch=4,
            max_kernel_qlen=1,
            kernel_heads=16,
            kv_lora_rank=512,
            q_dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16,
            platform=None,  # type: ignore[arg-type]
            device=torch.device("cpu"),
        )
    )
    assert isinstance(schedule, AiterDecodeSchedule)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
    plan = PlanDecodeScheduleCall(
        schedule=schedule,
        qo_indptr=indptr,
        kv_indptr=kv_indptr,
        batch_size=2,
        kernel_qlen=1,
        uniform_qlen=True,
    )
    provider.plan_decode_schedule(plan)
    call = PagedDecodeCall(
        q=torch.randn(3, 16, 576).to(torch.bfloat16),
        kv_cache=torch.randn(9, 576).to(torch.bfloat16),
        kv_indptr=torch.tensor([0, 3, 6, 9], dtype=torch.int32),
        kv_indices=torch.arange(9, dtype=torch.int32),
        qo_indptr=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        out=torch.empty(3, 16, 512, dtype=torch.bfloat16),
        lse=torch.empty(3, 16),
        max_qlen=1,
        max_seqlen_k=9,
        page_size=1,
        softmax_scale=0.1,
        kv_scale=None,
        schedule=schedule,
    )
    with pytest.raises(PlanMismatchError, match="planned for 2 requests"):
        provider.paged_mqa_decode(call)
    with pytest.raises(PlanMismatchError, match="sized for"):
        provider.plan_decode_schedule(attrs.evolve(plan, kernel_qlen=4))
    with pytest.raises(PlanMismatchError, match="its own decode schedule"):
        provider.paged_mqa_decode(attrs.evolve(call, schedule=object()))


def test_the_fake_refuses_what_aiter_refuses(fake_aiter) -> None:
    """The fake is strict: each of these would crash or silently break real aiter."""
    fake_aiter("gfx942")
    aiter = importlib.import_module("aiter")
    with pytest.raises(AssertionError):
        aiter.get_mla_metadata_info_v1(4, 1, 12, torch.bfloat16, torch.bfloat16, False)  # heads % 8
    specs = aiter.get_mla_metadata_info_v1(4, 1, 16, torch.bfloat16, torch.bfloat16, False)
    bufs = [
        torch.empty(shape if isinstance(shape, tuple) else (shape,), dtype=dtype) for shape, dtype in specs
    ]
    meta, work_indptr, work_info, reduce_indptr, final_map, partial_map = bufs
    indptr, ones = torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    kv_indptr = torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="positional order"):
        aiter.get_mla_metadata_v1(
            indptr,
            kv_indptr,
            ones,
            16,
            1,
            True,
            meta,
            work_indptr,
            work_info,
            reduce_indptr,
            final_map,
            partial_map,
            dtype_q=torch.bfloat16,
            dtype_kv=torch.bfloat16,
        )
    with pytest.raises(RuntimeError, match="dtype_q/dtype_kv"):
        aiter.get_mla_metadata_v1(
            indptr,
            kv_indptr,
            ones,
            16,
            1,
            True,
            meta,
            work_info,
            work_indptr,
            reduce_indptr,
            final_map,
            partial_map,
        )
    with pytest.raises(RuntimeError, match="only supports #heads"):
        aiter.get_mla_metadata_v1(
            indptr,
            kv_indptr,
            ones,
            12,
            1,
            True,
            meta,
            work_info,
            work_indptr,
            reduce_indptr,
            final_map,
            partial_map,
            max_seqlen_qo=1,
            dtype_q=torch.bfloat16,
            dtype_kv=torch.bfloat16,
        )
    q = torch.randn(1, 16, 576).to(torch.bfloat16)
    kv = torch.randn(7, 1, 1, 576).to(torch.bfloat16)
    o = torch.empty(1, 16, 512, dtype=torch.bfloat16)
    indices = torch.arange(7, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sm_scale"):
        aiter.mla.mla_decode_fwd(q, kv, o, indptr, kv_indptr, indices, ones, 1)
    strided = torch.randn(1, 16, 1152).to(torch.bfloat16)[..., :576]
    with pytest.raises(RuntimeError, match=r"Q\.is_contiguous"):
        aiter.mla.mla_decode_fwd(strided, kv, o, indptr, kv_indptr, indices, ones, 1, sm_scale=0.1)
    with pytest.raises(RuntimeError, match="all six or none"):
        aiter.mla.mla_decode_fwd(
            q, kv, o, indptr, kv_indptr, indices, ones, 1, sm_scale=0.1, work_meta_data=meta
        )
    q8 = q.to(fp8_for("gfx942"))
    with pytest.raises(RuntimeError, match="fp8 Q requires q_scale and kv_scale"):
        aiter.mla.mla_decode_fwd(
            q8, kv.to(fp8_for("gfx942")), o, indptr, kv_indptr, indices, ones, 1, sm_scale=0.1
        )
    with pytest.raises(RuntimeError, match="reads fp8 as"):
        aiter.mla.mla_decode_fwd(
            q.to(torch.float8_e4m3fn), kv, o, indptr, kv_indptr, indices, ones, 1, sm_scale=0.1
        )
    gluon = importlib.import_module("aiter.ops.triton.gluon.mla_gluon")
    with pytest.raises(AssertionError, match="requires gfx950"):
        gluon.mla_gluon(
            q[..., :512], q[..., 512:], kv.view(7, 576), o, indices, kv_indptr, 0.1, use_2d_view=False
        )
    out, lse = aiter.flash_attn_varlen_func(
        torch.randn(2, 1, 192).to(torch.bfloat16),
        torch.randn(1, 1, 192).to(torch.bfloat16),
        torch.randn(1, 1, 128).to(torch.bfloat16),
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        2,
        1,
        softmax_scale=0.1,
        causal=True,
        return_lse=True,
    )
    assert lse.shape == (1, 2)  # [H, T]
    assert math.isinf(float(lse[0, 0]))  # a fully masked row: +inf, like FA2
    assert float(lse[0, 0]) > 0
    assert float(out[0].abs().sum()) == 0.0


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_folded_heads_at_qlen_above_1_survive_aiter_rebinding_the_output(fake_aiter, kv: str) -> None:
    """On gfx942, 32 heads fold onto the 16-head kernel; at qlen > 1 aiter rebinds the output
    tensor it was handed (``o.set_``), so the provider must copy the result back."""
    fake = fake_aiter("gfx942")
    kv_dtype = fp8_for("gfx942") if kv == "fp8" else torch.bfloat16
    run = run_decode(fake_provider(), "gfx942", decode_case(32, (4, 4), (30, 9), kv_dtype=kv_dtype))
    assert run.strategy == PaddedAsmPersistent.NAME
    assert run.comparison.ok, run.comparison
    (call,) = fake.calls("mla_decode_fwd")
    assert (call["persistent"], call["heads"], call["max_seqlen_q"]) == (True, 32, 4)


def test_varlen_rows_without_keys_get_zeros_and_minus_inf(fake_aiter) -> None:
    fake_aiter("gfx950")
    q, k, v = (torch.randn(n, 2, d).to(torch.bfloat16) for n, d in ((3, 192), (1, 192), (1, 128)))
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    out = torch.full((3, 2, 128), math.nan, dtype=torch.bfloat16)
    lse = torch.full((3, 2), math.nan)
    fake_provider().varlen_attention(
        VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse, max_seqlen_q=3,
            max_seqlen_k=1, softmax_scale=0.1, causal=True,
        )
    )  # fmt: skip
    ref_out, ref_lse = reference_prefill(q, k, v, cu_q, cu_k, softmax_scale=0.1, causal=True)
    assert torch.isneginf(lse[:2]).all()
    assert compare_to_reference(out, lse, ref_out, ref_lse).ok


def test_small_head_folds_a_device_kv_scale_into_query_and_output(fake_aiter) -> None:
    """``mla_gluon`` takes ``kv_scale`` as a Python float (a tensor would be read as a pointer):
    the provider passes 1.0 and applies the device scale itself, with no host sync."""
    fake = fake_aiter("gfx950")
    gen = torch.Generator().manual_seed(4)
    rows, heads, lengths = 3, 8, [7, 0, 12]
    cache = torch.randn(24, 576, generator=gen).to(torch.bfloat16)
    q = torch.randn(rows, heads, 576, generator=gen).to(torch.bfloat16)
    seq_info = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    page_table = torch.randperm(24, generator=gen)[: sum(lengths)].to(torch.int32)
    results = []
    for provider in (fake_provider(), TorchProvider()):
        out = torch.full((rows, heads, 512), math.nan, dtype=torch.bfloat16)
        lse = torch.full((rows, heads), math.nan)
        provider.small_head_decode(
            SmallHeadDecodeCall(
                q_nope=q[..., :512],
                q_pe=q[..., 512:],
                kv_cache=cache,
                page_table=page_table,
                seq_info=seq_info,
                out=out,
                lse=lse,
                max_seqlen_k=12,
                page_size=1,
                softmax_scale=0.05,
                kv_scale=torch.tensor([0.5]),
            )
        )
        results.append((out, lse))
    (call,) = fake.calls("mla_gluon")
    assert call["kv_scale"] == 1.0
    (out, lse), (want_out, want_lse) = results
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-3)


# (heads, qlens, seq_lens, kv dtype): steps whose kernel qlen has another metadata size than the
# largest over the qlens the backend was sized for (the strict fake demands the exact sizes).
METADATA_SIZE_CASES = [
    pytest.param(
        32, (3, 0, 0, 0, 0), (30, 9, 4, 0, 0), torch.float8_e4m3fn, id="h32-qlen3-mixed-graph-pad-fp8"
    ),
    pytest.param(24, (4, 4, 4, 4), (30, 9, 8, 7), torch.bfloat16, id="h24-qlen4-bf16"),
    pytest.param(16, (8, 8, 8, 8, 0, 0), (30, 9, 8, 17, 0, 0), torch.bfloat16, id="h16-qlen8-graph-pad-bf16"),
]


@pytest.mark.parametrize(("heads", "qlens", "seq_lens", "kv_dtype"), METADATA_SIZE_CASES)
def test_metadata_buffers_are_sized_for_the_kernel_qlen_of_the_call(
    fake_aiter, heads: int, qlens: tuple[int, ...], seq_lens: tuple[int, ...], kv_dtype: torch.dtype
) -> None:
    fake = fake_aiter("gfx950")
    run = run_decode(fake_provider(), "gfx950", decode_case(heads, qlens, seq_lens, kv_dtype=kv_dtype))
    assert run.strategy == PaddedAsmPersistent.NAME
    assert run.comparison.ok, run.comparison
    (plan,) = fake.calls("get_mla_metadata_v1")
    sizes = {info["qlen"]: info for info in fake.calls("get_mla_metadata_info_v1")}
    # The fake checked the buffers against the info answer for the call's kernel qlen; that
    # answer differs from another qlen's here, which is what made the largest buffers wrong.
    assert plan["max_seqlen_qo"] in sizes
    (decode,) = fake.calls("mla_decode_fwd")
    assert decode["persistent"]
    assert decode["max_seqlen_q"] == plan["max_seqlen_qo"]


def test_the_fake_refuses_metadata_buffers_sized_for_another_qlen(fake_aiter) -> None:
    fake_aiter("gfx950")
    attention = importlib.import_module("aiter.ops.attention")
    info = {
        qlen: attention.get_mla_metadata_info_v1(2, qlen, 32, torch.bfloat16, torch.bfloat16, False)
        for qlen in (3, 4)
    }
    assert info[3] != info[4]
    buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in info[3]]
    qo = torch.tensor([0, 4, 8], dtype=torch.int32)
    kv = torch.tensor([0, 30, 39], dtype=torch.int32)
    with pytest.raises(
        RuntimeError, match="not sized by get_mla_metadata_info_v1 for this call's kernel qlen 4"
    ):
        attention.get_mla_metadata_v1(
            qo,
            kv,
            torch.ones(2, dtype=torch.int32),
            32,
            1,
            True,
            buffers[0],
            buffers[2],
            buffers[1],
            buffers[3],
            buffers[4],
            buffers[5],
            max_seqlen_qo=4,
            dtype_q=torch.bfloat16,
            dtype_kv=torch.bfloat16,
        )
