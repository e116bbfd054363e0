"""A strict fake of AMD aiter's MLA API for mla's tests.

Importable as ``aiter`` only inside ``tests/aiter_provider`` (a fixture copies it to a temporary
directory with a ``fake_config.json``, puts that on ``sys.path`` and removes it afterwards).
Each function checks what real aiter checks (shapes, dtypes, contiguity, head counts, argument
order, buffer sizes, the asm kernel table) and computes the reference math; a few checks are
stricter than aiter where aiter would be silently wrong (explicit scales and dtypes).
"""

from __future__ import annotations

from aiter import _state
from aiter.jit import core as core
from aiter.utility import dtypes as dtypes

from aiter import mla as mla  # isort: skip  (needs dtypes bound first, as in aiter)
from aiter.ops.attention import (
    get_mla_metadata_info_v1,
    get_mla_metadata_v1,
    get_ps_metadata_info_v1,
    get_ps_metadata_v1,
    mla_prefill_ps_asm_fwd,
    mla_reduce_v1,
    mla_reduce_v1_legacy,
)
from aiter.ops.mha import flash_attn_varlen_func

if _state.CONFIG.get("reduce_signature", "current") == "legacy":
    mla_reduce_v1 = mla_reduce_v1_legacy
del mla_reduce_v1_legacy

__all__ = [
    "core",
    "dtypes",
    "flash_attn_varlen_func",
    "get_mla_metadata_info_v1",
    "get_mla_metadata_v1",
    "get_ps_metadata_info_v1",
    "get_ps_metadata_v1",
    "mla",
    "mla_prefill_ps_asm_fwd",
    "mla_reduce_v1",
]
for _name in list(__all__):
    if _state.omitted(_name):
        del globals()[_name]
