"""The value records reject bad fields with InvalidInputError naming the field and what it must be."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch

import mla
from mla.core.context import DecodeContext
from mla.testing import simulated_decode_context

REJECTIONS: list[tuple[str, Callable[[], object], str]] = [
    ("num_heads", lambda: mla.MLADims(0), "must be > 0, got 0"),
    ("kv_lora_rank", lambda: mla.MLADims(8, kv_lora_rank=-1), "must be > 0, got -1"),
    ("qk_rope_head_dim", lambda: mla.MLADims(8, qk_rope_head_dim=0), "> 0"),
    ("qk_nope_head_dim", lambda: mla.MLADims(8, qk_nope_head_dim=0), "> 0"),
    ("v_head_dim", lambda: mla.MLADims(8, v_head_dim=0), "> 0"),
    ("block_size", lambda: mla.KVCacheSpec(0), "must be > 0, got 0"),
    ("kv_cache_dtype", lambda: mla.KVCacheSpec(16, "int8"), "unknown dtype 'int8'"),
    ("max_num_seqs", lambda: mla.EngineLimits(0, 64, 64), "> 0"),
    ("max_model_len", lambda: mla.EngineLimits(4, None, 64), "must be > 0, got None"),  # type: ignore[arg-type]
    ("max_num_batched_tokens", lambda: mla.EngineLimits(4, 64, -3), "> 0"),
    ("max_decode_qlen", lambda: mla.EngineLimits(4, 64, 64, max_decode_qlen=0), "> 0"),
    ("small_head_mode", lambda: mla.Knobs(small_head_mode="fast"), "one of auto/gluon/asm, got 'fast'"),  # type: ignore[arg-type]
    ("fp8_prefill", lambda: mla.Knobs(fp8_prefill="yes"), "one of auto/on/off"),  # type: ignore[arg-type]
    ("num_compute_units", lambda: mla.Platform("cpu", "cpu", 0), "must be > 0, got 0"),
]


@pytest.mark.parametrize(("field", "build", "message"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_record_rejects_bad_field(field: str, build: Callable[[], object], message: str) -> None:
    with pytest.raises(mla.InvalidInputError, match=f"^{field}: .*") as info:
        build()
    assert info.value.argument == field
    assert message in str(info.value)


@pytest.mark.parametrize("field", ["max_qlen", "max_decode_qlen"])
def test_decode_context_rejects_counts_below_one(field: str) -> None:
    ctx = simulated_decode_context("cpu", q_dtype=torch.bfloat16)
    assert isinstance(ctx, DecodeContext)
    with pytest.raises(mla.InvalidInputError, match=f"^{field}: must be >= 1, got 0"):
        attrs.evolve(ctx, **{field: 0})


# -- fast constructors (mla.core.records) ----------------------------------------------------------


def _hot_records() -> list[tuple[type, dict[str, object]]]:
    """The records a decode build makes through fast constructors, with field values."""
    from mla.core.step_rules import HostLengths
    from mla.decode._paged import PagedPlan
    from mla.decode._small_head import SmallHeadPlan
    from mla.decode.base import DecodeBatch, DecodeGeometry
    from mla.engine.backend.step import MLAMetadata
    from mla.providers.calls import FillPagesCall

    t = torch.arange(5, dtype=torch.int32)
    lengths = HostLengths([1, 1], [3, 4], 1, 1, 3, 4)
    geometry = DecodeGeometry(4, 16, 2, 2, 2, 1, 1, 2, torch.float16, torch.float16, 4, 0)
    plan = {"strategy": "s", "geometry": geometry, "kv_indptr": t, "kv_indices": t}
    return [
        (HostLengths, attrs.asdict(lengths, recurse=False)),
        (DecodeGeometry, attrs.asdict(geometry, recurse=False)),
        (
            DecodeBatch,
            {
                "context": simulated_decode_context(),
                "query_start_loc_cpu": t[:3],
                "seq_lens_cpu": t[:2],
                "query_start_loc": t[:3],
                "seq_lens": t[:2],
                "block_table": t.view(5, 1),
                "num_tokens": 2,
                "cache_blocks": 0,
                "query_start_loc_list": [0, 1, 2],
                "lengths": lengths,
            },
        ),
        (
            FillPagesCall,
            {
                "seq_lens": t,
                "block_table": t.view(5, 1),
                "kv_indptr": t,
                "kv_indices": t,
                "block_size": 16,
                "max_len": 4,
                "num_blocks": None,
                "compact": False,
                "query_start_loc": None,
                "qo_indptr": None,
                "invalid_count": t[:1],
                "length_count": None,
            },
        ),
        (
            SmallHeadPlan,
            {**plan, "row_indptr": t, "page_table": t, "block_table": None, "row_request": None},
        ),
        (
            PagedPlan,
            {
                **plan,
                "qo_indptr": t,
                "qlen_padded": False,
                "source_index": t,
                "source_keep": t,
                "kernel_row": t,
                "schedule": None,
                "block_table": t.view(5, 1),
            },
        ),
        (
            MLAMetadata,
            {
                "num_decodes": 2,
                "num_decode_tokens": 2,
                "num_prefills": 0,
                "num_prefill_tokens": 0,
                "decode": None,
                "prefill": None,
                "decode_decision": None,
                "prefill_decision": None,
                "sparse_decode": None,
                "sparse_prefill": None,
                "index": None,
            },
        ),
    ]


@pytest.mark.parametrize(("cls", "values"), _hot_records(), ids=lambda v: getattr(v, "__name__", ""))
def test_a_fast_constructor_builds_what_the_public_one_builds(cls: type, values: dict[str, object]) -> None:
    from mla.core.records import fast_constructor

    make = fast_constructor(cls)
    fast, public = make(**values), cls(**values)
    assert type(fast) is cls
    assert all(getattr(fast, f.name) is getattr(public, f.name) for f in attrs.fields(cls))
    assert make(*values.values()).__class__ is cls  # in field order too
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast.x = 1
    with pytest.raises(TypeError, match="missing"):  # defaults are not applied
        make(**dict(list(values.items())[:-1]))


@attrs.frozen
class _Validated:
    x: int = attrs.field(validator=attrs.validators.ge(0))


@attrs.frozen
class _Converted:
    x: int = attrs.field(converter=int)


@attrs.frozen
class _PostInit:
    x: int

    def __attrs_post_init__(self) -> None:
        pass


@attrs.frozen
class _Derived:
    x: int
    y: int = attrs.field(init=False, default=0)


@attrs.frozen(cache_hash=True)
class _CachedHash:
    x: int


@attrs.define
class _Mutable:
    x: int


@attrs.frozen(slots=False)
class _Unslotted:
    x: int


@pytest.mark.parametrize(
    "cls", [_Validated, _Converted, _PostInit, _Derived, _CachedHash, _Mutable, _Unslotted, DecodeContext]
)
def test_a_fast_constructor_refuses_a_record_whose_init_does_more(cls: type) -> None:
    from mla.core.records import fast_constructor

    with pytest.raises(TypeError, match=cls.__name__):
        fast_constructor(cls)
