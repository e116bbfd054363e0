"""The engine-facing backend (:class:`MLABackend`): a metadata builder and an attention impl
over one resolver.

Shaped like vLLM's builder/impl pair. The builder turns a step's inputs into
:class:`MLAMetadata`, resolving each phase exactly once; the impl runs the strategy recorded in
the metadata and never decides anything itself.

Usage::

    backend = MLABackend(dims, cache, limits, model_dtype=torch.bfloat16)
    meta = backend.builder.build(StepInputs(...))
    backend.impl.forward_decode(meta, q_decode, kv_cache, out=out_decode)
    backend.impl.forward_prefill(meta, q, k, v, out=out_prefill, kv_cache=kv_cache,
                                 expand_context=up_project)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.engine.backend.builder import MetadataBuilder
from mla.engine.backend.impl import AttentionImpl
from mla.engine.backend.state import BackendState
from mla.engine.backend.step import MLAMetadata

__all__ = ["MLABackend"]


class MLABackend(BackendState):
    """Owns the provider, the resolver, the strategies and their persistent buffers (the
    :class:`~mla.engine.backend.state.BackendState`), with the ``builder``/``impl`` pair over them.

    Decode strategies for every step the limits allow are resolved and allocated at init (an
    unsupported qlen within the limits raises :class:`UnsupportedError` here, not mid-run).
    ``decode_strategy``/``prefill_strategy`` force a strategy (``NAME``, class name or class)
    through the same checks. A provider that cannot run here raises
    :class:`ProviderUnavailableError` (an :class:`UnsupportedError`) with its reasons.

    ``validate`` (see :data:`mla.core.validate.ValidateMode`): ``"fast"`` never copies device data to
    the host in ``builder.build``; ``"full"`` adds the host checks of every block id and checks
    that the device ``query_start_loc``/``seq_lens`` equal their host copies.

    The backend registers itself with the custom ops (:mod:`mla.engine.backend.ops`) under ``op_id``;
    ``builder.build`` makes the step's metadata the backend's ``current_metadata``, which the
    ops run.
    """

    builder: MetadataBuilder
    """Plans each step: ``builder.build(step)`` returns the step's :class:`MLAMetadata`."""
    impl: AttentionImpl
    """Runs the current step: ``forward_decode``, ``forward_prefill`` and ``write_kv``."""

    if not TYPE_CHECKING:  # the checker sees BackendState.__init__'s signature

        def __init__(self, *args, **kwargs):
            _require_device_available(kwargs.get("device"))
            super().__init__(*args, **kwargs)
            # Plain attributes, made here: torch.compile(fullgraph=True) traces ``backend.impl``
            # (a functools.cached_property takes an RLock on Python 3.11, which dynamo cannot
            # enter), and two threads never race to make two of them.
            self.builder = MetadataBuilder(self)
            self.impl = AttentionImpl(self)
            _LIVE_BACKENDS.add(self)

    def check_current(self, metadata: MLAMetadata, phase: str) -> None:
        """As :meth:`BackendState.check_current`, and metadata that another live backend built
        (its current step) is named as such rather than as "another step" of this one."""
        if metadata is not self.current_metadata and any(
            other is not self and other.current_metadata is metadata for other in list(_LIVE_BACKENDS)
        ):
            raise PlanMismatchError(
                "metadata was built by another MLABackend (its builder.build), not by this one: "
                "pass each backend the metadata its own builder.build returned (a backend runs "
                "only the plans it built, sized for its own dims, cache and buffers)"
            )
        super().check_current(metadata, phase)


_LIVE_BACKENDS: weakref.WeakSet[MLABackend] = weakref.WeakSet()
"""Every backend alive (to name metadata a different backend built)."""


def _require_device_available(device: object) -> None:
    """``device`` names an accelerator this torch can use (``device="cuda"`` on a CPU-only torch
    raised torch's raw ``AssertionError`` at the first allocation)."""
    if isinstance(device, str | torch.device):
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            return  # BackendState names the bad value
        if kind == "cuda" and not torch.cuda.is_available():
            raise InvalidInputError(
                "device",
                f"{device!r} was asked for but torch sees no CUDA/ROCm device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                "pass device='cpu' or install a torch build for your accelerator",
            )
