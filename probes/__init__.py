"""Kernel-research probes: research scratch, not part of the package, the benchmarks or CI.

Run from the repository root as modules (``python -m probes.whatif --help``); see
``probes/README.md``.
"""
