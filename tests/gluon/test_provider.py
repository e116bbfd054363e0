"""The ``gluon`` provider on a CPU: availability reasons, the ``auto`` order, its capability record,
and the routing of cases its kernels do not take to the Triton kernels (run in the interpreter)."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from mla.core.capabilities import Contract
from mla.core.errors import InvalidInputError
from mla.core.platform import simulated_platform
from mla.providers import auto_order, get_provider
from mla.providers.calls import PagedDecodeCall, SparseAttentionCall, WriteKVCall
from mla.providers.gluon import GluonProvider
from mla.providers.gluon.provider import DELEGATED, hopper_support
from mla.providers.gluon.sparse import sparse_on_gluon
from mla.providers.torch_ref import TorchProvider
from mla.providers.triton import TritonProvider
from mla.providers.triton.decode_launch import DecodeInputs
from mla.testing import assert_matches_reference


def test_availability_reasons() -> None:
    assert hopper_support((9, 0), None)
    no_device = hopper_support(None, None)
    assert not no_device
    assert "no-device" in str(no_device)
    ampere = hopper_support((8, 0), None)
    assert not ampere
    assert "8.0" in str(ampere)
    assert "sm_90" in str(ampere)
    blackwell = hopper_support((10, 0), None)
    assert not blackwell
    missing = hopper_support((9, 0), "No module named 'triton.experimental'")
    assert not missing
    assert "Triton >= 3.6" in str(missing)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_unavailable_without_a_gpu() -> None:
    support = get_provider("gluon").availability()
    assert not support
    assert "no-device" in str(support)


@pytest.mark.parametrize(
    ("arch", "order"),
    [
        ("sm90", ("gluon", "triton")),
        ("sm80", ("triton",)),
        ("sm100", ("triton",)),
        ("gfx950", ("aiter", "triton")),
        ("cpu", ()),
    ],
)
def test_auto_order(arch: str, order: tuple[str, ...]) -> None:
    on_gpu = attrs.evolve(simulated_platform(arch), device_type="cuda" if arch != "cpu" else "cpu")
    assert auto_order(on_gpu) == order
    # Without a device (a simulated arch) nothing but the torch reference is tried.
    assert auto_order(simulated_platform(arch)) == ()


def test_capabilities_compose_the_triton_record() -> None:
    plat = simulated_platform("sm90")
    caps = GluonProvider().capabilities(plat)
    triton_caps = TritonProvider().capabilities(plat)
    assert caps.provider == "gluon"
    assert caps.archs == frozenset({"sm90"})
    assert caps.contracts == triton_caps.contracts
    assert caps.kv_dtypes == triton_caps.kv_dtypes
    assert not caps.persistent_decode_preferred
    assert set(DELEGATED) | {
        Contract.VARLEN_PREFILL,
        Contract.FP8_PREFILL,
        Contract.PAGED_DECODE,
        Contract.DECODE_SCHEDULE,
        Contract.SMALL_HEAD_DECODE,
        Contract.SPARSE_ATTENTION,
        Contract.INDEXER,
    } == set(caps.contracts)
    probes = GluonProvider().describe_probes()
    assert probes["delegated_to_triton"] == sorted(c.value for c in DELEGATED)
    on_triton = GluonProvider(fp8_prefill="triton").describe_probes()["delegated_to_triton"]
    assert on_triton == sorted(c.value for c in (*DELEGATED, Contract.FP8_PREFILL))


def test_other_dims_and_dtypes_run_on_the_triton_kernel() -> None:
    """fp32 queries with 32+16 dims are not a Gluon case: the provider runs the Triton kernel
    (here in the interpreter) and matches the reference."""
    gen = torch.Generator().manual_seed(3)
    rank, rope, heads = 32, 16, 2
    cache = torch.randn(40, rank + rope, generator=gen)
    q = torch.randn(3, heads, rank + rope, generator=gen)
    kv_indptr = torch.tensor([0, 17, 17, 40], dtype=torch.int32)
    kv_indices = torch.randperm(40, generator=gen).to(torch.int32)
    qo_indptr = torch.tensor([0, 1, 2, 3], dtype=torch.int32)

    def call(out: torch.Tensor, lse: torch.Tensor) -> PagedDecodeCall:
        return PagedDecodeCall(
            q=q, kv_cache=cache, kv_indptr=kv_indptr, kv_indices=kv_indices, qo_indptr=qo_indptr, out=out,
            lse=lse, max_qlen=1, max_seqlen_k=23, page_size=1, softmax_scale=0.3, kv_scale=None,
        )  # fmt: skip

    out = torch.full((3, heads, rank), math.nan)
    lse = torch.full((3, heads), math.nan)
    GluonProvider().paged_mqa_decode(call(out, lse))
    ref_out = torch.empty(3, heads, rank)
    ref_lse = torch.empty(3, heads)
    TorchProvider().paged_mqa_decode(call(ref_out, ref_lse))
    assert_matches_reference(out, lse, ref_out, ref_lse, context="gluon -> triton fallback")


def test_delegated_write_kv_matches_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 8, 48)
    want = cache.clone()
    kv_c = torch.randn(6, 32, generator=gen)
    k_pe = torch.randn(6, 16, generator=gen)
    slots = torch.tensor([3, 9, -1, 30, 0, 17])
    GluonProvider().write_kv(
        WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_scale=None)
    )
    TorchProvider().write_kv(
        WriteKVCall(kv_c=kv_c, k_pe=k_pe, kv_cache=want, slot_mapping=slots, kv_scale=None)
    )
    assert torch.equal(cache, want)


@pytest.mark.parametrize(
    ("provider", "phase", "kv_dtype", "rank", "wanted"),
    [
        (GluonProvider(), "decode", torch.bfloat16, 512, ["Gluon kernels"]),
        (GluonProvider(), "decode", torch.float8_e4m3fn, 512, ["Gluon kernels", "fp8"]),
        (GluonProvider(), "decode", torch.bfloat16, 256, ["256+64"]),
        (
            GluonProvider(),
            "prefill",
            torch.bfloat16,
            512,
            ["Gluon prefill kernel", "192/128", "Gluon fp8 prefill kernel", "e4m3"],
        ),
        (
            GluonProvider(prefill="triton", fp8_prefill="triton"),
            "prefill",
            torch.bfloat16,
            512,
            ["Triton provider's varlen kernel (prefill='triton')", "fp8_prefill='triton'"],
        ),
    ],
    ids=["bf16", "fp8", "rank256", "prefill-default", "prefill-triton"],
)
def test_kernel_note_names_the_kernel_and_the_reason(
    provider: GluonProvider, phase: str, kv_dtype: torch.dtype, rank: int, wanted: list[str]
) -> None:
    note = provider.kernel_note(
        phase=phase, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, kv_lora_rank=rank, rope_dim=64
    )
    assert note is not None
    for text in wanted:
        assert text in note


def test_the_triton_provider_has_no_kernel_note() -> None:
    assert (
        TritonProvider().kernel_note(
            phase="decode", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_lora_rank=512, rope_dim=64
        )
        is None
    )


def test_gluon_prefill_is_the_default() -> None:
    assert repr(GluonProvider()) == "GluonProvider()"
    assert repr(GluonProvider(prefill="gluon", fp8_prefill="gluon")) == "GluonProvider()"
    assert repr(GluonProvider(prefill="triton")) == "GluonProvider(prefill='triton')"
    with pytest.raises(InvalidInputError, match="prefill") as info:
        GluonProvider(prefill="fa3")
    assert info.value.argument == "prefill"


def test_explain_shows_the_kernel_note(capsys: pytest.CaptureFixture[str]) -> None:
    from mla.tools.cli import main

    main(["explain", "--provider", "gluon", "--arch", "sm90", "--heads", "16", "--kv-dtype", "fp8"])
    text = capsys.readouterr().out
    assert "provider gluon: decode runs on the Gluon kernels: fp8 cache (torch.float8_e4m3fn)" in text


def _unit_qlen_inputs(q: torch.Tensor, cache: torch.Tensor, rank: int) -> DecodeInputs:
    """Two qlen-1 requests of ``q`` (latent width ``rank``) over ``cache``; the launcher must
    refuse them before reading anything."""
    indptr, indices = torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    out = torch.zeros(2, q.shape[1], rank, dtype=q.dtype)
    return DecodeInputs(
        q[..., :rank], q[..., rank:], cache, indptr, indices, None, 2, 1, 8, 0.1, None, out, None, None
    )


@pytest.mark.parametrize(
    ("rank", "rope", "q_dtype", "kv_dtype"),
    [(256, 64, torch.bfloat16, torch.bfloat16), (512, 32, torch.bfloat16, torch.bfloat16),
     (512, 64, torch.float32, torch.float32), (512, 64, torch.bfloat16, torch.float16)],
)  # fmt: skip
def test_launcher_rejects_cases_the_kernels_do_not_take(
    rank: int, rope: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    from mla.core.errors import InvalidInputError
    from mla.providers.gluon.decode import launch_gluon_decode
    from mla.providers.gluon.planner import GluonLaunchConfig

    q, cache = torch.zeros(2, 16, rank + rope, dtype=q_dtype), torch.zeros(8, rank + rope, dtype=kv_dtype)
    inputs = _unit_qlen_inputs(q, cache, rank)
    with pytest.raises(InvalidInputError, match="Triton provider"):
        launch_gluon_decode(inputs, GluonLaunchConfig())


@pytest.mark.parametrize(
    "cache",
    [
        torch.zeros(8, 600, dtype=torch.bfloat16)[:, :576],  # rows 1,200 bytes apart: not 16 elements
        torch.zeros(576, 8, dtype=torch.bfloat16).t(),  # strided last dim
        torch.zeros(8 * 576 + 4, dtype=torch.bfloat16)[4:].view(8, 576),  # base 8 bytes off
    ],
    ids=["row-stride", "strided-last-dim", "misaligned-base"],
)
def test_launcher_rejects_caches_whose_rows_are_not_16_byte_aligned(cache: torch.Tensor) -> None:
    from mla.core.errors import InvalidInputError
    from mla.providers.gluon.decode import launch_gluon_decode
    from mla.providers.gluon.planner import GluonLaunchConfig

    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match=r"kv_cache.*16-byte"):
        launch_gluon_decode(_unit_qlen_inputs(q, cache, 512), GluonLaunchConfig())


@pytest.mark.parametrize(
    ("rank", "q_dtype", "kv", "kv_scale", "on_gluon", "why"),
    [
        (512, torch.bfloat16, (576, torch.bfloat16), False, True, "16-bit cache"),
        (512, torch.bfloat16, (576, torch.float8_e4m3fn), True, True, "fp8 cache"),
        (512, torch.bfloat16, (576, torch.float8_e4m3fn), False, False, "without kv_scale"),
        (512, torch.bfloat16, (656, torch.uint8), False, True, "fp8 cache"),
        (512, torch.float16, (656, torch.uint8), False, False, "need a bf16 query"),
        (512, torch.bfloat16, (600, torch.uint8), False, False, "bytes, not 656"),
        (128, torch.bfloat16, (192, torch.bfloat16), False, False, "latent/rope dims"),
        (512, torch.float32, (576, torch.float32), False, False, "query dtype"),
    ],
    ids=["bf16", "fp8", "fp8-no-scale", "ds_mla", "ds_mla-fp16-q", "ds_mla-bad-width", "rank128", "fp32"],
)
def test_sparse_attention_runs_on_the_gluon_kernels_where_they_apply(
    rank: int, q_dtype: torch.dtype, kv: tuple[int, torch.dtype], kv_scale: bool, on_gluon: bool, why: str
) -> None:
    width, kv_dtype = kv
    call = SparseAttentionCall(
        q=torch.zeros(2, 16, rank + 64, dtype=q_dtype), kv_cache=torch.zeros(8, width, dtype=kv_dtype),
        slots=torch.zeros(2, 4, dtype=torch.int32), out=torch.zeros(2, 16, rank, dtype=q_dtype), lse=None,
        kv_lora_rank=rank, rope_dim=64, softmax_scale=0.1, kv_scale=torch.ones(1) if kv_scale else None,
    )  # fmt: skip
    decision, reason = sparse_on_gluon(call)
    assert decision is on_gluon
    assert why in reason


def test_sparse_row_offsets_are_made_once_per_shape() -> None:
    from mla.providers.gluon.sparse import ROW_INDPTR_CACHE, row_indptr

    first = row_indptr(3, 2048, torch.device("cpu"))
    assert first.tolist() == [0, 2048, 4096, 6144]
    assert first.dtype == torch.int32
    assert row_indptr(3, 2048, torch.device("cpu")) is first
    assert row_indptr(3, 1024, torch.device("cpu")) is not first
    for rows in range(ROW_INDPTR_CACHE + 1):  # the cache stays bounded: the oldest goes first
        row_indptr(100 + rows, 8, torch.device("cpu"))
    assert row_indptr(3, 2048, torch.device("cpu")) is not first


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(3, dtype=torch.int64), r"expected int32 \[3\] with stride 1"),
        (torch.zeros(2, dtype=torch.int32), r"expected int32 \[3\] with stride 1"),
        (torch.zeros(6, dtype=torch.int32)[::2], r"expected int32 \[3\] with stride 1"),
        (torch.zeros(3, dtype=torch.int32, device="meta"), "expected device cpu"),
    ],
    ids=["int64", "too-few-rows", "strided", "other-device"],
)
def test_sparse_inputs_reject_bad_lengths(bad: torch.Tensor, message: str) -> None:
    from mla.providers.gluon.sparse import sparse_inputs

    call = SparseAttentionCall(
        q=torch.zeros(3, 16, 576, dtype=torch.bfloat16), kv_cache=torch.zeros(64, 576, dtype=torch.bfloat16),
        slots=torch.zeros(3, 128, dtype=torch.int32), out=torch.zeros(3, 16, 512, dtype=torch.bfloat16),
        lse=None, kv_lora_rank=512, rope_dim=64, softmax_scale=0.1, kv_scale=None, lengths=bad,
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match=f"^lengths: {message}"):
        sparse_inputs(call)


def test_sparse_inputs_carry_the_lengths() -> None:
    from mla.providers.gluon.sparse import sparse_inputs

    lengths = torch.tensor([5, 0, 128], dtype=torch.int32)
    call = SparseAttentionCall(
        q=torch.zeros(3, 16, 576, dtype=torch.bfloat16), kv_cache=torch.zeros(64, 576, dtype=torch.bfloat16),
        slots=torch.zeros(3, 128, dtype=torch.int32), out=torch.zeros(3, 16, 512, dtype=torch.bfloat16),
        lse=None, kv_lora_rank=512, rope_dim=64, softmax_scale=0.1, kv_scale=None, lengths=lengths,
    )  # fmt: skip
    inputs = sparse_inputs(call)
    assert inputs.lengths is lengths
    assert inputs.kv_indptr.tolist() == [0, 128, 256, 384]
    assert sparse_inputs(attrs.evolve(call, lengths=None)).lengths is None
