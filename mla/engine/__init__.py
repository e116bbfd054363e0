"""Choosing and running a strategy per step: the registry, preference order and resolver;
the engine-facing backend (metadata builder and impl), torch custom ops and the functional
API."""
