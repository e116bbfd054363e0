"""Decode context parallelism: the layout, the LSE combine, and 2- and 4-rank runs.

The multi-rank checks (``dcp_harness``) spawn gloo processes on the CPU and, on a machine with
two GPUs, NCCL processes; every rank compares its decode (and a mixed step through
``MLAAttention``) with the single-process backend on the unsharded cache.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import attrs
import dcp_harness
import pytest
import torch
import torch.distributed as dist

import mla
from mla.core.errors import InvalidInputError
from mla.distributed import DCPLayout, DecodeContextParallel, lse_weights
from mla.layers import MLAAttention
from mla.tools.reference import merge_reference


@pytest.mark.parametrize(("world", "interleave"), [(1, 1), (2, 1), (3, 2), (4, 16), (2, 5)])
def test_layout_matches_round_robin_by_interleave(world: int, interleave: int) -> None:
    """Walk positions one by one: rank (p // I) % W, each rank filling its cache in order."""
    positions = torch.arange(300)
    filled = [0] * world
    for rank in range(world):
        layout = DCPLayout(world, rank, interleave)
        owners = layout.owner(positions)
        local = layout.local_position(positions)
        for p in range(300):
            if int(owners[p]) == rank:
                assert int(local[p]) == filled[rank]
                filled[rank] += 1
            assert int(layout.local_length(torch.tensor(p + 1))) == filled[rank]
    assert sum(filled) == 300
    assert DCPLayout(world, 0, interleave).max_local_length(300) == max(filled)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"world_size": 0, "rank": 0}, "world_size"),
        ({"world_size": 2, "rank": 2}, "rank"),
        ({"world_size": 2, "rank": -1}, "rank"),
        ({"world_size": 2, "rank": 0, "interleave": 0}, "interleave"),
    ],
)
def test_layout_rejects_bad_values(kwargs: dict[str, int], argument: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        DCPLayout(**kwargs)
    assert info.value.argument == argument


def test_lse_weights_merge_like_the_reference() -> None:
    """Combining weighted partials equals attention over the union; all -inf rows give 0."""
    gen = torch.Generator().manual_seed(0)
    lses = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64).float()
    lses[1, 0] = float("-inf")  # one rank holds no key of row 0
    lses[:, 4] = float("-inf")  # no rank holds a key of row 4
    outs = torch.randn(3, 5, 2, 8, generator=gen)
    outs[:, 4] = 0
    outs[1, 0] = 0
    merged = torch.zeros(5, 2, 8)
    for r in range(3):
        weight, lse = lse_weights(lses[r], lses)
        merged += outs[r] * weight[..., None]
    ref_o, ref_lse = merge_reference(outs[0], lses[0], outs[1], lses[1])
    ref_o, ref_lse = merge_reference(ref_o, ref_lse, outs[2], lses[2])
    assert float((merged.double() - ref_o).abs().max()) < 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert float((lse.double() - ref_lse)[finite].abs().max()) < 1e-5
    assert bool((merged[4] == 0).all())
    assert float(lse[4, 0]) == -math.inf


def test_needs_an_initialized_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(InvalidInputError) as info:
        DecodeContextParallel(
            mla.MLADims(num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, softmax_scale=144**-0.5),
            mla.KVCacheSpec(4),
            mla.EngineLimits(4, 64, 32),
        )
    assert info.value.argument == "group"


def _fraction(cases: list[dcp_harness.Case]) -> list[dcp_harness.Case]:
    """Half of the 2^4 (kv dtype, block size, interleave, qlen) grid in which every pair of
    those factors still takes all four value combinations."""
    levels = {"bf16": 0, "fp8": 1, 1: 0, 16: 1, 3: 1}

    def parity(case: dcp_harness.Case) -> int:
        return (
            levels[case.kv_dtype]
            + levels[case.block_size]
            + (case.interleave == 16)
            + levels.get(case.qlen, 0)
        ) % 2

    picked = [c for c in cases if parity(c) == 0]
    values = [(c.kv_dtype, c.block_size, c.interleave, c.qlen) for c in picked]
    for a, b in itertools.combinations(range(4), 2):
        assert len({(v[a], v[b]) for v in values}) == 4
    return picked


@pytest.mark.heavy
def test_dcp_matches_single_process_on_gloo(tmp_path: Path) -> None:
    """Four gloo processes: first as two 2-rank DCP groups (subgroups of the world, between
    them every case), then as one 4-rank group (half the grid, every pair of values). Every rank
    checks DCP decode (qlen 1 and verify 3, graph padding, requests shorter than the group) and a
    mixed step through MLAAttention against the single-process results."""
    cases = dcp_harness.cases()
    assert {c.split_heads for c in cases} == {True, False}
    dcp_harness.spawn(4, "gloo", dcp_harness.Geometry(), [(2, cases), (4, _fraction(cases))], str(tmp_path))


@pytest.mark.gpu
def test_dcp_matches_single_process_on_two_gpus_nccl(tmp_path: Path) -> None:
    """The same check over NCCL on two GPUs with the GPU provider and DeepSeek's latent dims."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cases = [attrs.evolve(c, model_dtype=torch.bfloat16) for c in dcp_harness.cases()]
    geometry = dcp_harness.Geometry(heads=16, kv_lora_rank=512, rope=64, nope=128, v=128, provider="auto")
    dcp_harness.spawn(2, "nccl", geometry, [(2, cases)], str(tmp_path))


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group in this process (the rejection rules need no peers)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


DIMS = mla.MLADims(
    num_heads=2,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    softmax_scale=32**-0.5,
)


def small_dcp() -> DecodeContextParallel:
    return DecodeContextParallel(
        DIMS,
        mla.KVCacheSpec(4, num_blocks=8),
        mla.EngineLimits(max_num_seqs=2, max_model_len=16, max_num_batched_tokens=12, max_decode_qlen=2),
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
    )


def step(
    qlens: list[int], seqs: list[int], *, decodes: int, table_cols: int = 4, rows: int | None = None
) -> mla.StepInputs:
    qsl = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    seq = torch.tensor(seqs, dtype=torch.int32)
    table = torch.arange(len(seqs) * table_cols, dtype=torch.int32).view(len(seqs), table_cols) % 8
    num_decode_tokens = rows if rows is not None else int(qsl[decodes])
    return mla.StepInputs(qsl, qsl, seq, table, decodes, num_decode_tokens, seq)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("inputs", "argument"),
    [
        (step([2], [1], decodes=1), "seq_lens"),
        (step([1], [17], decodes=1), "seq_lens"),
        (step([1], [9], decodes=1, table_cols=2), "block_table"),
        (step([1, 3], [5, 3], decodes=3, rows=4), "num_decodes"),
        (step([1, 3], [5, 3], decodes=1, rows=2), "num_decode_tokens"),
        (step([2, 2], [5, 3], decodes=2, rows=5), "num_decode_tokens"),
        (step([1, 12], [5, 12], decodes=1), "query_start_loc"),
        (step([1, 1, 1], [5, 5, 5], decodes=3), "query_start_loc"),
        (step([3], [5], decodes=1), "query_start_loc"),
        (step([3], [0], decodes=0), "seq_lens"),
        (step([1], [5], decodes=-1), "num_decodes"),
    ],
    ids=[
        "seq-below-qlen",
        "beyond-max-model-len",
        "short-table",
        "num-decodes",
        "padding-with-prefill",
        "too-many-decode-rows",
        "too-many-rows",
        "too-many-requests",
        "decode-qlen-beyond-the-limit",
        "empty-prefill",
        "negative-num-decodes",
    ],
)
def test_build_rejects_bad_steps(inputs: mla.StepInputs, argument: str) -> None:
    """DCP checks the global step with the engine's one step checker: the builder's rules, the
    same errors (and the block table against the largest share one rank holds)."""
    with pytest.raises(InvalidInputError) as info:
        small_dcp().build(inputs)
    assert info.value.argument == argument
    dcp = small_dcp()
    backend = mla.MLABackend(
        DIMS, mla.KVCacheSpec(4, num_blocks=8), dcp.limits, model_dtype=torch.float32, provider="torch"
    )
    with pytest.raises(InvalidInputError) as same:
        backend.builder.build(inputs)
    assert same.value.argument == argument


@pytest.mark.usefixtures("one_rank")
def test_build_checks_the_global_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The global step goes through the step checker once; the local steps derived from it are
    planned by the two backends without a second check."""
    from mla.engine.backend.step_check import StepChecker

    checked: list[int] = []
    real = StepChecker.check_values

    def counted(self: StepChecker, inputs: mla.StepInputs) -> object:
        checked.append(inputs.num_decodes)
        return real(self, inputs)

    monkeypatch.setattr(StepChecker, "check_values", counted)
    meta = small_dcp().build(step([1, 3], [9, 6], decodes=1))
    assert meta.decode is not None
    assert meta.prefill is not None
    assert checked == [1]


@pytest.mark.usefixtures("one_rank")
def test_one_rank_equals_the_backend_and_rejects_bad_calls() -> None:
    """With one rank DCP is the plain backend; wrong tensors and phases raise typed errors."""
    dcp = small_dcp()
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 4, DIMS.latent_dim, generator=gen).to(torch.bfloat16)
    inputs = step([1, 2], [9, 6], decodes=2)
    meta = dcp.build(inputs)
    # The one rank owns every new token: request 0's position 8 (block 2 of its row [0..3]) and
    # request 1's positions 4 and 5 (block 5 of its row [4..7]).
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 5 * 4 + 0, 5 * 4 + 1]
    q = torch.randn(3, 2, DIMS.latent_dim, generator=gen)
    out = torch.full((3, 2, 32), math.nan)
    lse = torch.full((3, 2), math.nan)
    dcp.forward_decode(meta, q, cache, out=out, lse=lse)
    backend = mla.MLABackend(
        DIMS,
        mla.KVCacheSpec(4, num_blocks=8),
        dcp.limits,
        model_dtype=torch.float32,
        provider="torch",
        platform="cpu",
    )
    ref = torch.empty_like(out)
    ref_lse = torch.empty_like(lse)
    backend.impl.forward_decode(backend.builder.build(inputs), q, cache, out=ref, lse=ref_lse)
    assert float((out - ref).abs().max()) < 1e-5
    assert float((lse - ref_lse).abs().max()) < 1e-5
    with pytest.raises(InvalidInputError) as info:
        dcp.forward_decode(meta, q[:, :1], cache, out=out)
    assert info.value.argument == "q"
    with pytest.raises(InvalidInputError) as info:
        dcp.forward_decode(meta, q, cache, out=out[:2])
    assert info.value.argument == "out"
    with pytest.raises(InvalidInputError) as info:
        dcp.write_kv(meta, torch.zeros(2, 32), torch.zeros(2, 16), cache)
    assert info.value.argument == "kv_c"
    with pytest.raises(InvalidInputError) as info:
        dcp.forward_prefill(meta, q, q, q, out=out)
    assert info.value.argument == "metadata"
    prefill_meta = dcp.build(step([3], [3], decodes=0))
    with pytest.raises(InvalidInputError) as info:
        dcp.forward_decode(prefill_meta, q, cache, out=out)
    assert info.value.argument == "metadata"


@pytest.mark.usefixtures("one_rank")
def test_layer_takes_slots_from_the_dcp_metadata() -> None:
    dcp = small_dcp()
    weight = torch.randn(2 * 32, 32)
    layer = MLAAttention(dcp, weight)
    meta = dcp.build(step([1], [5], decodes=1))
    args = (
        torch.zeros(1, 2, 16),
        torch.zeros(1, 2, 16),
        torch.zeros(1, 32),
        torch.zeros(1, 16),
        torch.zeros(8, 4, 48),
    )
    with pytest.raises(InvalidInputError) as info:
        layer(meta, *args, slot_mapping=torch.zeros(1, dtype=torch.int64))
    assert info.value.argument == "slot_mapping"
    backend_layer = MLAAttention(dcp.prefill_backend, weight)
    with pytest.raises(InvalidInputError) as info:
        backend_layer(meta, *args)
    assert info.value.argument == "metadata"
    plain = dcp.prefill_backend.builder.build(step([1], [5], decodes=1))
    with pytest.raises(InvalidInputError) as info:
        layer(plain, *args, slot_mapping=torch.zeros(1, dtype=torch.int64))
    assert info.value.argument == "metadata"
