"""The decision: which strategy runs a phase of a step.

:mod:`~mla.engine.decision.registry` (priority-ordered strategies per phase, registration),
:mod:`~mla.engine.decision.preference` (the pure rules that reorder supported strategies) and
:mod:`~mla.engine.decision.resolver` (``resolve(ctx)``: one frozen decision; ``explain(ctx)``:
every candidate with its reasons). Tensor-free: it reads contexts, never step data.
"""
