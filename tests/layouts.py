"""Tensor layouts the bad-input tests hand to the checks."""

from __future__ import annotations

import torch


def strided_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a tensor of the same shape whose last dim is not contiguous (the
    last two dims swapped in memory)."""
    return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
