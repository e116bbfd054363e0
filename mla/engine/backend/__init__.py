"""The engine pair: :class:`MLABackend` with its :class:`MetadataBuilder` and
:class:`AttentionImpl`, shaped like vLLM's builder/impl pair.

Modules: :mod:`~mla.engine.backend.state` (provider, resolver, strategies and their buffers),
:mod:`~mla.engine.backend.step` (the step's inputs and metadata records),
:mod:`~mla.engine.backend.builder` (plans a step), :mod:`~mla.engine.backend.impl` (runs it
through the custom ops of :mod:`~mla.engine.backend.ops`), :mod:`~mla.engine.backend.checks`
(the engine's input checks) and :mod:`~mla.engine.backend.mla_backend` (the backend itself).
"""

from mla.engine.backend.builder import MetadataBuilder
from mla.engine.backend.impl import AttentionImpl
from mla.engine.backend.mla_backend import MLABackend
from mla.engine.backend.step import MLAMetadata, StepInputs

__all__ = ["AttentionImpl", "MLABackend", "MLAMetadata", "MetadataBuilder", "StepInputs"]
