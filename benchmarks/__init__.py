"""The user-facing benchmarks: ``python -m benchmarks <name> [args]`` from the repository root.

* ``decode``: the decode providers (Gluon, Triton, vLLM's Triton MLA) side by side on the decode
  matrix (GPU).
* ``prefill``: the Triton varlen and fp8 prefill against ``varlen_attn`` (GPU).
* ``overhead``: the host cost of ``mla.mla_decode`` and of ``builder.build`` (GPU; ``--device
  cpu`` for a smoke run).
* ``dcp``: decode context parallelism, one long request on 1 GPU against 2 (``--cpu`` for a
  smoke run).

``python -m benchmarks <name> --help`` lists each one's options. The current results are in
``docs/performance.md``. Kernel-research probes (what-if variants, compile reports, racecheck
probes) live apart, in ``probes/``.
"""
