"""Fake ``aiter.jit.utils.chip_info``: the arch from the fixture's config (or rocminfo's failure)."""

from __future__ import annotations

from aiter import _state


def get_gfx() -> str:
    return _state.arch()


def get_cu_num() -> int:
    return _state.cu_num()
