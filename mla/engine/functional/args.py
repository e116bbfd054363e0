"""The records that carry one functional call's arguments through its route: the eager door,
the checks, the plan cache, the traced path under ``torch.compile`` and the op's body all take
one :class:`DecodeArgs` or :class:`PrefillArgs` instead of the call's parameters one by one.

They are named tuples: built in about a microsecond, and ``torch.compile`` traces them (the
compiled path builds one from its arguments too). The fields are the public functions'
parameters, unchecked: :func:`~mla.engine.functional.decode.mla_decode` and
:func:`~mla.engine.functional.prefill.mla_prefill` document them, and their doors check them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla.core.platform import Platform
from mla.core.validate import CallValidateMode
from mla.engine.decision.registry import AnyStrategy
from mla.engine.functional.decode_graphs import GraphReplay
from mla.providers.base import KernelProvider


class DecodeArgs(NamedTuple):
    """The arguments of one :func:`mla.mla_decode` call, as the caller passed them."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None
    softmax_scale: float
    kv_lora_rank: int
    kv_scale: float | torch.Tensor | None
    provider: str | KernelProvider
    strategy: str | AnyStrategy | None
    platform: Platform | str | None
    out: torch.Tensor | None
    lse: torch.Tensor | None
    return_lse: bool
    validate: CallValidateMode
    graph: GraphReplay


class PrefillArgs(NamedTuple):
    """The arguments of one :func:`mla.mla_prefill` call, as the caller passed them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool
    provider: str | KernelProvider
    strategy: str | AnyStrategy | None
    platform: Platform | str | None
    out: torch.Tensor | None
    lse: torch.Tensor | None
    return_lse: bool
    validate: CallValidateMode
