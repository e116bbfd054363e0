"""The bit moves behind the Gluon ``fp8_ds_mla`` dequantization
(:func:`mla.providers.gluon.ds_mla_words._e4m3_words_to_bf16`), modelled in torch on the CPU for
all 256 e4m3 bytes: ``(sign-extended byte << 4) & 0x87f0`` read as a bf16 is the e4m3 value times
``2**-120``, subnormals and signed zeros included, so one bf16 multiply by the scale times
``2**120`` (:func:`~mla.providers.gluon.ds_mla_words._bias_scales`) gives ``e4m3 · scale``:
exactly for power-of-two scales below ``2**8``, ``inf`` from ``2**8`` on, and an e4m3 NaN byte
as ``±480 · scale``. The kernels' own outputs are checked on the GPU
(``tests/gluon/test_gpu_sparse_ds_mla.py``)."""

from __future__ import annotations

import pytest
import torch

BYTES = torch.arange(256, dtype=torch.int32)
NAN_BYTES = (BYTES & 0x7F) == 0x7F
E4M3 = BYTES.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def moved_bits(byte: torch.Tensor) -> torch.Tensor:
    """The bf16 each byte becomes in the kernel: sign-extended into 16 bits (``prmt`` with a
    sign-replicating selector), shifted left by 4 and masked to ``0x87f0``."""
    lane = byte.to(torch.int8).to(torch.int32) & 0xFFFF
    return ((lane << 4) & 0x87F0).to(torch.int16).view(torch.bfloat16)


def dequantized(byte: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel's ``mul.rn.bf16x2``: the moved bits times ``bf16(scale · 2**120)``, the exact
    product (float64 holds it) rounded once to bf16."""
    multiplier = torch.tensor(scale * 2.0**120, dtype=torch.float32).to(torch.bfloat16)
    return (moved_bits(byte).to(torch.float64) * multiplier.to(torch.float64)).to(torch.bfloat16)


def test_moved_bits_are_the_e4m3_value_times_two_to_the_minus_120() -> None:
    moved = moved_bits(BYTES).to(torch.float64)
    expected = E4M3 * 2.0**-120
    assert torch.equal(moved[~NAN_BYTES], expected[~NAN_BYTES])
    # Signed zeros keep their sign, subnormals (exponent bits 0) their value.
    assert torch.equal(
        moved_bits(BYTES[[0x00, 0x80]]).view(torch.int16), torch.tensor([0, -0x8000], dtype=torch.int16)
    )
    assert moved[0x01].item() == 2.0**-9 * 2.0**-120


@pytest.mark.parametrize("exponent", [-22, -10, -1, 0, 3, 7])
def test_power_of_two_scales_dequantize_exactly(exponent: int) -> None:
    scale = 2.0**exponent
    got = dequantized(BYTES, scale)
    expected = (E4M3 * scale).to(torch.bfloat16)
    assert torch.equal(got[~NAN_BYTES].view(torch.int16), expected[~NAN_BYTES].view(torch.int16))


def test_other_scales_round_the_scale_to_bf16_first() -> None:
    scale = 0.0123
    got = dequantized(BYTES, scale).to(torch.float64)[~NAN_BYTES]
    exact = E4M3[~NAN_BYTES] * scale
    # Two roundings to bf16 (unit roundoff 2**-8): the scale's, then the product's.
    assert ((got - exact).abs() <= exact.abs() * ((1 + 2.0**-8) ** 2 - 1)).all()


def test_scales_from_two_to_the_eighth_overflow_and_nan_bytes_read_as_480() -> None:
    assert dequantized(BYTES[[0x7E]], 2.0**8).isinf().all()  # 448 · 256
    assert dequantized(BYTES[[0x7E]], 2.0**7).item() == 448 * 128
    assert dequantized(BYTES[NAN_BYTES], 0.5).tolist() == [240.0, -240.0]
