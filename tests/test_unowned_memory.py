"""No value from memory a request does not own reaches an output.

Every location a step's rows must not read is NaN-poisoned: the null block (block 0, in no
block table row's used columns but padding the unused ones, as vLLM pads them), blocks no
request owns, the tail of a request's last block, the query rows of graph-padding requests and
padding rows, the stale entries of the persistent index buffers and every float workspace
buffer. Then every output row must be finite and equal to the reference, except the rows that
really see a NaN: one request's own key is NaN on purpose, so the rows whose causal window holds
it must show it, and the rows of the same request before it (and every other request) must not.

On the CPU this runs the torch provider, aiter's capability record on the torch kernels (head
padding, qlen padding, Gluon-style verify rows) and the Triton kernels in the interpreter; the
``gpu`` test runs the torch, Triton and (when present) Gluon providers on the device.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

import mla
from mla.providers.base import KernelProvider
from mla.testing import compare_to_reference, emulated_provider
from mla.tools.reference import reference_decode, reference_prefill

NAN = math.nan


@attrs.frozen(eq=False)
class DecodeScenario:
    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_scale: float | None
    block_table: torch.Tensor
    qlens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_tokens: int
    sees_nan: torch.Tensor
    """bool ``[T]``: rows whose causal window holds the planted NaN key."""
    owned: torch.Tensor
    """bool ``[T]``: rows a request with keys owns (the others must come back as zeros)."""

    def step(self, device: torch.device) -> mla.StepInputs:
        qsl = torch.zeros(len(self.qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(self.qlens), 0)
        lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        return mla.StepInputs(
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.to(device),
            seq_lens=lens.to(device),
            seq_lens_cpu=lens,
            block_table=self.block_table,
            num_decodes=len(self.qlens),
            num_decode_tokens=self.num_tokens,
        )


def decode_scenario(
    *,
    heads: int,
    qlens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    extra_rows: int,
    poisoned_request: int,
    rank: int,
    poisoned_key: str = "last",
    rope: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    block_size: int = 4,
    num_blocks: int = 40,
    seed: int = 0,
) -> DecodeScenario:
    """A decode step whose unowned memory is NaN; request ``poisoned_request`` has a NaN at its
    ``"last"`` key (seen only by its last query row: its earlier rows must stay finite) or its
    ``"first"`` key (seen by all its rows)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(seq_lens) // block_size) + 2
    table = torch.zeros(len(qlens), width, dtype=torch.int64)  # unused columns: the null block
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    values = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    owned_slots = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, seq in enumerate(seq_lens):
        for column in range(-(-seq // block_size)):
            table[b, column] = free.pop()
        for position in range(seq):
            owned_slots[table[b, position // block_size], position % block_size] = True
    values[~owned_slots] = NAN
    key = seq_lens[poisoned_request] - 1 if poisoned_key == "last" else 0
    values[table[poisoned_request, key // block_size], key % block_size] = NAN
    kv_scale = None
    if kv_dtype.itemsize == 1:
        kv_scale = 0.05
        values = values / kv_scale
    cache = values.to(kv_dtype)
    num_owned = sum(qlens)
    num_tokens = num_owned + extra_rows
    q = torch.randn(num_tokens, heads, rank + rope, generator=gen)
    q[num_owned:] = NAN
    starts = [sum(qlens[:b]) for b in range(len(qlens))]
    owned = torch.zeros(num_tokens, dtype=torch.bool)
    sees_nan = torch.zeros(num_tokens, dtype=torch.bool)
    for b, (start, qlen, seq) in enumerate(zip(starts, qlens, seq_lens, strict=True)):
        if seq == 0:
            q[start : start + qlen] = NAN  # a graph-padding request's rows are garbage too
            continue
        owned[start : start + qlen] = True
        if b == poisoned_request:
            sees_nan[start + qlen - 1 if poisoned_key == "last" else start : start + qlen] = True
    return DecodeScenario(
        q.to(dtype).to(device),
        cache.to(device),
        kv_scale,
        table.to(torch.int32).to(device),
        qlens,
        seq_lens,
        num_tokens,
        sees_nan,
        owned,
    )


def poison_workspaces(backend: mla.MLABackend) -> None:
    """Fill every float buffer the backend's strategies own with NaN and the page-index buffers
    with 0 (the null block), as stale memory from earlier steps could hold."""
    seen: set[int] = set()

    def visit(obj: object, name: str = "") -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen or "scale" in name:
                return
            seen.add(id(obj))
            if obj.is_floating_point() and obj.element_size() > 1:
                obj.fill_(NAN)
            elif name in ("kv_indices", "row_page_table"):
                obj.zero_()
        elif attrs.has(type(obj)):
            for field in attrs.fields(type(obj)):
                visit(getattr(obj, field.name), field.name)

    for strategy in [*backend.decode_strategies.values(), *backend.prefill_strategies.values()]:
        for name, value in vars(strategy).items():
            if name != "setup":
                visit(value, name)


def run_decode(
    scenario: DecodeScenario,
    provider: KernelProvider | str,
    platform: mla.Platform | str,
    *,
    heads: int,
    rank: int,
    rope: int,
    force: str | None = None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = mla.MLABackend(
        mla.MLADims(heads, rank, rope, softmax_scale=(rank + rope) ** -0.5),
        mla.KVCacheSpec(
            scenario.kv_cache.shape[1], scenario.kv_cache.dtype, num_blocks=scenario.kv_cache.shape[0]
        ),
        mla.EngineLimits(
            max_num_seqs=scenario.num_tokens,
            max_model_len=scenario.block_table.shape[1] * scenario.kv_cache.shape[1],
            max_num_batched_tokens=64,
            max_decode_qlen=max(scenario.qlens),
        ),
        model_dtype=scenario.q.dtype,
        provider=provider,
        platform=platform,
        device=device,
        decode_strategy=force,
        preallocate=force is None,  # a forced strategy need not run every qlen the limits allow
    )
    poison_workspaces(backend)
    metadata = backend.builder.build(scenario.step(device))
    out = torch.full((scenario.num_tokens, heads, rank), NAN, dtype=scenario.q.dtype, device=device)
    lse = torch.full((scenario.num_tokens, heads), NAN, device=device)
    backend.impl.forward_decode(
        metadata, scenario.q, scenario.kv_cache, out=out, lse=lse, kv_scale=scenario.kv_scale
    )
    return out, lse


def check_decode(scenario: DecodeScenario, out: torch.Tensor, lse: torch.Tensor, *, rank: int) -> None:
    clean = torch.nan_to_num(scenario.kv_cache.float(), nan=0.0).to(scenario.kv_cache.dtype)
    qsl = torch.zeros(len(scenario.qlens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(scenario.qlens), 0)
    ref_out, ref_lse = reference_decode(
        scenario.q,
        clean,
        scenario.block_table,
        torch.tensor(scenario.seq_lens),
        qsl,
        softmax_scale=scenario.q.shape[-1] ** -0.5,
        kv_lora_rank=rank,
        kv_scale=scenario.kv_scale,
    )
    keep = ~scenario.sees_nan
    out_c, lse_c = out.cpu(), lse.cpu()
    assert torch.isfinite(out_c[keep].float()).all(), "a row that sees no unowned memory is not finite"
    assert not torch.isnan(lse_c[keep]).any()
    assert (out_c[~scenario.owned].float() == 0).all(), "padding rows must be zeros"
    comparison = compare_to_reference(out_c[keep], lse_c[keep], ref_out[keep], ref_lse[keep])
    assert comparison.ok, comparison
    assert torch.isnan(out_c[scenario.sees_nan].float()).any(dim=-1).all(), "a NaN a row does see must show"


# (heads, qlens, seq_lens, extra rows, poisoned request): mixed verify with a graph-padding
# request, and a uniform verify batch (aiter pads it to kernel qlen 4).
DECODE_SHAPES = {
    "mixed": (8, (1, 3, 2, 2), (9, 14, 6, 0), 2, 1),
    "uniform": (12, (3, 3, 3), (11, 7, 0), 1, 0),
    "single": (16, (1, 1, 1, 1), (5, 13, 0, 8), 2, 3),
}


SHARED_TILE_REASON = (
    "the Triton and Gluon paged kernels run a request's verify rows on one shared KV tile, so a "
    "NaN in the request's own later key reaches its earlier rows as 0 * NaN (owned memory: only "
    "memory no request owns is guaranteed not to reach an output)"
)


def shares_request_tile(provider: str, force: str | None, qlens: tuple[int, ...]) -> bool:
    """A provider kernel that attends all verify rows of a request over one KV tile."""
    paged = force in (None, "PaddedAsmPersistent", "AsmNonPersistent")
    return provider in ("triton", "gluon") and paged and max(qlens) > 1


def _cpu_decode_cases() -> list[Any]:
    """(provider, arch, forced strategy, shape, q dtype, kv dtype) on the CPU."""
    interpret = pytest.mark.interpret
    cases = [
        pytest.param("torch", "cpu", None, shape, torch.float32, torch.float32, id=f"torch-{shape}")
        for shape in DECODE_SHAPES
    ]
    for arch, fp8 in (("gfx942", torch.float8_e4m3fnuz), ("gfx950", torch.float8_e4m3fn)):
        for shape in DECODE_SHAPES:
            for kv in (torch.bfloat16, fp8):
                name = f"aiter-{arch}-{shape}-{str(kv).removeprefix('torch.')}"
                cases.append(pytest.param("aiter", arch, None, shape, torch.bfloat16, kv, id=name))
    for force in ("GluonVerifyFlatten", "PaddedAsmPersistent", "AsmNonPersistent"):
        for shape in ("mixed", "uniform"):
            f32 = torch.float32
            cases.append(
                pytest.param(
                    "triton", "sm90", force, shape, f32, f32, id=f"triton-{force}-{shape}", marks=interpret
                )
            )
    f16 = torch.float16
    cases.append(
        pytest.param(
            "triton",
            "sm90",
            "GluonDecode",
            "single",
            f16,
            f16,
            id="triton-GluonDecode-single",
            marks=interpret,
        )
    )
    return cases


CPU_DECODE = _cpu_decode_cases()


def _provider(name: str, arch: str) -> KernelProvider | str:
    return emulated_provider("aiter", arch) if name == "aiter" else name


@pytest.mark.parametrize("key", ["last", "first"])
@pytest.mark.parametrize(("provider", "arch", "force", "shape", "dtype", "kv_dtype"), CPU_DECODE)
def test_decode_reads_no_unowned_memory(
    provider: str,
    arch: str,
    force: str | None,
    shape: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    key: str,
) -> None:
    heads, qlens, seq_lens, extra, poisoned = DECODE_SHAPES[shape]
    if key == "last" and shares_request_tile(provider, force, qlens):
        pytest.skip(SHARED_TILE_REASON)
    rank, rope = 64, 16
    device = torch.device("cpu")
    scenario = decode_scenario(
        heads=heads, qlens=qlens, seq_lens=seq_lens, extra_rows=extra, poisoned_request=poisoned,
        rank=rank, rope=rope, dtype=dtype, kv_dtype=kv_dtype, device=device, poisoned_key=key,
    )  # fmt: skip
    out, lse = run_decode(
        scenario,
        _provider(provider, arch),
        arch,
        heads=heads,
        rank=rank,
        rope=rope,
        force=force,
        device=device,
    )
    check_decode(scenario, out, lse, rank=rank)


def test_the_issue_example_null_block() -> None:
    kv = torch.randn(16, 16, 576, dtype=torch.bfloat16)
    kv[0, 0] = NAN
    bt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    out, _ = mla.mla_decode(
        torch.randn(2, 16, 576, dtype=torch.bfloat16),
        kv,
        bt,
        torch.tensor([40, 7], dtype=torch.int32),
        softmax_scale=192**-0.5,
        provider="torch",
    )
    assert not out.isnan().any()


# -- prefill ---------------------------------------------------------------------------------------


def prefill_inputs(
    heads: int, q_lens: tuple[int, ...], poisoned: tuple[int, int], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v of a varlen batch with request ``poisoned[0]``'s key ``poisoned[1]`` (relative) NaN."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(q_lens)
    q = torch.randn(tokens, heads, 48, generator=gen)
    k = torch.randn(tokens, heads, 48, generator=gen)
    v = torch.randn(tokens, heads, 32, generator=gen)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    row = int(cu[poisoned[0]]) + poisoned[1]
    k[row], v[row] = NAN, NAN
    return q.to(dtype), k.to(dtype), v.to(dtype), cu


PREFILL_CASES = [
    pytest.param("torch", "cpu", None, torch.float32, id="torch-flash"),
    pytest.param("aiter", "gfx950", "fp8-persistent-prefill", torch.bfloat16, id="aiter-fp8-prefill"),
    pytest.param(
        "triton", "sm90", "flash-varlen", torch.float16, id="triton-flash", marks=pytest.mark.interpret
    ),
    pytest.param(
        "triton",
        "sm90",
        "fp8-persistent-prefill",
        torch.float16,
        id="triton-fp8-prefill",
        marks=pytest.mark.interpret,
    ),
]


@pytest.mark.parametrize(("provider", "arch", "force", "dtype"), PREFILL_CASES)
def test_prefill_nan_in_one_request_stays_in_its_later_rows(
    provider: str, arch: str, force: str | None, dtype: torch.dtype
) -> None:
    """A NaN key of request 1 (its 5th of 40 tokens) shows in its rows from the 5th on and
    nowhere else: not in requests 0 and 2, not in its 4 earlier rows."""
    q_lens = (33, 40, 7)
    q, k, v, cu = prefill_inputs(16, q_lens, (1, 4), dtype)
    out, lse = mla.mla_prefill(
        q, k, v, cu, cu, 40, 40, softmax_scale=48**-0.5,
        provider=_provider(provider, arch), platform=arch, strategy=force,
    )  # fmt: skip
    sees = torch.zeros(q.shape[0], dtype=torch.bool)
    sees[33 + 4 : 33 + 40] = True
    clean = [torch.nan_to_num(x.float(), nan=0.0).to(dtype) for x in (q, k, v)]
    ref_out, ref_lse = reference_prefill(*clean, cu, cu, softmax_scale=48**-0.5)
    if force == "fp8-persistent-prefill":
        ref_out, ref_lse = _fp8_reference(clean, cu)
    keep = ~sees
    assert torch.isfinite(out[keep].float()).all()
    comparison = compare_to_reference(out[keep], lse[keep], ref_out[keep], ref_lse[keep])
    assert comparison.ok, comparison
    if provider == "triton" and force == "fp8-persistent-prefill" and not torch.cuda.is_available():
        return  # Triton 3.6's interpreter converts the fp8 NaN (0x7f) to 480, not NaN
    assert torch.isnan(out[sees].float()).any(dim=-1).all()


def _fp8_reference(clean: list[torch.Tensor], cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on the inputs the fp8 prefill computes with (per-tensor fp8 rounding)."""
    rounded = [
        mla.providers.quant.dequantize(*mla.providers.quant.quantize_per_tensor(x, torch.float8_e4m3fn))
        for x in clean
    ]
    return reference_prefill(*rounded, cu, cu, softmax_scale=48**-0.5)


def test_prefill_context_chunks_read_no_unowned_cache_rows() -> None:
    """Chunked-context prefill through the backend: the null block, unowned blocks and block
    tails are NaN, the chunk workspace and every float buffer too; outputs are finite."""
    from mla.testing import PrefillCase, make_prefill_inputs

    case = PrefillCase(
        heads=4, q_lens=(3, 5), context_lens=(18, 9), qk_nope_dim=32, rope_dim=16, v_dim=24, kv_lora_rank=64
    )
    inputs = make_prefill_inputs(case)
    cache = inputs.context.kv_cache.clone()
    table = inputs.context.block_table
    owned = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for b, context in enumerate(case.context_lens):
        for position in range(context):
            owned[table[b, position // case.block_size], position % case.block_size] = True
    cache[~owned] = NAN
    seq_lens = [c + n for c, n in zip(case.context_lens, case.q_lens, strict=True)]
    backend = mla.MLABackend(
        case.dims,
        mla.KVCacheSpec(case.block_size, cache.dtype, num_blocks=cache.shape[0]),
        mla.EngineLimits(2, max(seq_lens), sum(case.q_lens)),
        model_dtype=case.dtype,
        provider="torch",
        platform="cpu",
    )
    poison_workspaces(backend)
    metadata = backend.builder.build(inputs.step())
    out, lse = inputs.poisoned_outputs()
    backend.impl.forward_prefill(
        metadata, inputs.q, inputs.k, inputs.v, out=out, lse=lse, kv_cache=cache,
        expand_context=inputs.context.expand,
    )  # fmt: skip
    assert torch.isfinite(out.float()).all()
    comparison = compare_to_reference(out, lse, *inputs.reference())
    assert comparison.ok, comparison


# -- on the device ---------------------------------------------------------------------------------


def _device_providers() -> list[str]:
    names = []
    for name in mla.provider_names():
        if name == "aiter" and torch.version.hip is None:
            continue
        try:
            provider = mla.get_provider(name)
        except mla.ProviderUnavailableError:
            continue
        if provider.availability():
            names.append(name)
    return names


GPU_STRATEGIES = ("GluonDecode", "GluonVerifyFlatten", "PaddedAsmPersistent", "AsmNonPersistent")


@pytest.mark.gpu
def test_gpu_every_provider_reads_no_unowned_memory() -> None:
    ran, failed = run_every_provider(torch.device("cuda"), _device_providers())
    print("ran:", ran)
    assert not failed, "\n".join(failed)
    assert any(r.startswith("triton/") for r in ran), ran


def run_every_provider(device: torch.device, names: list[str]) -> tuple[list[str], list[str]]:
    """torch, Triton and (when listed and available) Gluon on the device, real MLA dims, every
    decode strategy each runs, bf16 and fp8 caches; then both prefill strategies. Returns the
    cases that ran and, for those that failed a check, ``"case: message"`` (every case runs, so
    one failure does not hide the others).

    The planted NaN sits at a request's last key (a verify row before it must stay finite) and
    at its first key; the last-key variant is skipped where :func:`shares_request_tile`."""
    platform = mla.detect_platform(device)
    ran: list[str] = []
    failed: list[str] = []
    for name in names:
        provider = mla.get_provider(name)
        cases = [
            (shape, force, kv, key)
            for shape in DECODE_SHAPES
            for force in GPU_STRATEGIES
            for kv in (torch.bfloat16, torch.float8_e4m3fn)
            for key in ("last", "first")
        ]
        for shape, force, kv, key in cases:
            heads, qlens, seq_lens, extra, poisoned = DECODE_SHAPES[shape]
            if force == "GluonDecode" and max(qlens) > 1:
                continue
            if key == "last" and shares_request_tile(name, force, qlens):
                continue
            scenario = decode_scenario(
                heads=heads, qlens=qlens, seq_lens=tuple(s * 37 for s in seq_lens), extra_rows=extra,
                poisoned_request=poisoned, rank=512, rope=64, dtype=torch.bfloat16, kv_dtype=kv,
                device=device, block_size=64, num_blocks=64, poisoned_key=key,
            )  # fmt: skip
            try:
                out, lse = run_decode(
                    scenario, provider, platform, heads=heads, rank=512, rope=64, force=force, device=device
                )
            except mla.UnsupportedError:
                continue
            case = f"{name}/{force}/{shape}/{kv}/{key}"
            try:
                check_decode(scenario, out, lse, rank=512)
            except AssertionError as error:
                failed.append(f"{case}: {str(error).splitlines()[0]}")
            ran.append(case)
        for force in ("flash-varlen", "fp8-persistent-prefill"):
            q, k, v, cu = prefill_inputs(16, (300, 700, 90), (1, 200), torch.bfloat16)
            q, k, v, cu = q.to(device), k.to(device), v.to(device), cu.to(device)
            try:
                out, _ = mla.mla_prefill(
                    q, k, v, cu, cu, 700, 700, softmax_scale=48**-0.5, provider=provider, strategy=force
                )
            except mla.UnsupportedError:
                continue
            sees = torch.zeros(q.shape[0], dtype=torch.bool, device=device)
            sees[300 + 200 : 300 + 700] = True
            if not torch.isfinite(out[~sees].float()).all():
                failed.append(f"{name}/{force}: a row that sees no NaN is not finite")
            if not torch.isnan(out[sees].float()).any(dim=-1).all():
                failed.append(f"{name}/{force}: a NaN a row does see must show")
            ran.append(f"{name}/{force}")
    return ran, failed
