"""The fake's configuration (written by the test fixture next to this file) and its call log.

``fake_config.json`` keys: ``arch`` (``"gfx942"``, ``"gfx950"`` or ``null``: ``rocminfo`` is
missing and ``import aiter`` fails, as on a host without ROCm), ``cu_num``, ``omit`` (public
names ``aiter/__init__`` does not export), ``decode_signature`` (``"current"``,
``"no_return_lse"`` or ``"legacy"``: the pre-Dec-2025 one without ``page_size``/``nhead_kv``/
``return_lse``), ``reduce_signature`` (``"current"`` or ``"legacy"``: no ``num_kv_splits``),
``native_h24_planner`` (the planner accepts 24 heads), ``csrc_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = json.loads((Path(__file__).parent / "fake_config.json").read_text())

CALLS: list[tuple[str, dict[str, Any]]] = []
"""Every kernel call: ``(name, facts)``; tests read it to check how the provider called aiter."""

INFOS: list[dict[str, Any]] = []
"""Every ``get_mla_metadata_info_v1`` answer: the call's facts and the six buffer shapes."""

PLANS: dict[int, dict[str, Any]] = {}
"""Decode metadata plans by ``work_metadata_ptrs.data_ptr()``: what each was planned for."""


def record(name: str, **facts: Any) -> None:
    CALLS.append((name, facts))


def calls(name: str) -> list[dict[str, Any]]:
    return [facts for call, facts in CALLS if call == name]


def arch() -> str:
    """The GPU arch, as aiter reads it from ``rocminfo`` (which fails without ROCm)."""
    value = CONFIG.get("arch")
    if value is None:
        raise RuntimeError(
            "Get GPU arch from rocminfo failed: [Errno 2] No such file or directory: 'rocminfo'"
        )
    return str(value)


def cu_num() -> int:
    return int(CONFIG.get("cu_num", 8))


def omitted(name: str) -> bool:
    return name in CONFIG.get("omit", ())
