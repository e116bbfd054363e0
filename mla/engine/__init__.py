"""Choosing and running a strategy per step, in three parts, each a layer of the import graph
(``tests/test_layering.py``) that imports only the ones before it:

- :mod:`mla.engine.decision`: the decision: the strategy registry, the preference rules and the
  resolver (which strategy runs a context, and why not the others).
- :mod:`mla.engine.backend`: the engine pair: :class:`~mla.engine.backend.MLABackend` (its
  state, the metadata builder and the attention impl), the step checker, the torch custom ops
  and the engine's input checks.
- :mod:`mla.engine.functional`: the functional API (``mla_decode``, ``mla_prefill``,
  ``write_kv``) with its plan caches: a thin client of the engine pair.
"""
