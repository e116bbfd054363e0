"""Host-side TMA descriptors made without the constructor's checks
(:mod:`mla.providers.gluon.descriptors`) against Triton's ``TensorDescriptor``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")

from mla.providers.gluon import descriptors  # noqa: E402
from mla.providers.gluon.descriptors import KNOWN_FIELDS, token_descriptor, unchecked_descriptor  # noqa: E402
from mla.providers.gluon.prefill_parts import BOX, TILE_LAYOUT  # noqa: E402


def test_the_installed_descriptor_has_the_known_fields() -> None:
    """Else every descriptor goes through the checking constructor (correct, slower)."""
    assert tuple(field.name for field in dataclasses.fields(hopper.TensorDescriptor)) == KNOWN_FIELDS


def _views() -> dict[str, torch.Tensor]:
    kv = torch.zeros(40, 4, 192 + 128, dtype=torch.bfloat16)
    return {
        "contiguous": torch.zeros(40, 4, 192, dtype=torch.bfloat16),
        "k of a kv buffer": kv[..., :192],
        "v of a kv buffer": kv[..., 192:],
        "one token": torch.zeros(1, 4, 128, dtype=torch.float16),
        "fp8": torch.zeros(40, 2, 192, dtype=torch.float8_e4m3fn),
    }


@pytest.mark.parametrize("name", sorted(_views()))
def test_token_descriptor_equals_the_checked_constructor(name: str) -> None:
    x = _views()[name]
    desc = token_descriptor(x, 128, BOX.value, TILE_LAYOUT)
    checked = hopper.TensorDescriptor(desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout)
    assert type(desc) is hopper.TensorDescriptor
    assert desc.base is x
    for field in KNOWN_FIELDS[1:]:
        assert getattr(desc, field) == getattr(checked, field), field
    tokens, heads, dim = x.shape
    assert desc.shape == [tokens, (heads - 1) * x.stride(1) + dim]
    assert desc.strides[0] * x.element_size() % 16 == 0


def test_unknown_fields_fall_back_to_the_checking_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptors, "_descriptor_class", lambda: (hopper.TensorDescriptor, False))
    unaligned = torch.zeros(65, dtype=torch.bfloat16)[1:].view(8, 8)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        unchecked_descriptor(unaligned, [8, 8], [8, 1], [8, 8], TILE_LAYOUT)
