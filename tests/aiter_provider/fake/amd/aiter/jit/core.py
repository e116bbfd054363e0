"""Fake ``aiter.jit.core``: where the shipped C++ sources live (the native-H24 probes read them)."""

from __future__ import annotations

from aiter import _state

AITER_CSRC_DIR = str(_state.CONFIG.get("csrc_dir", ""))
