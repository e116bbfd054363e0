"""``python -m benchmarks <name> [args]``: run one of the user-facing benchmarks."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "decode": "decode providers side by side on the decode matrix (GPU)",
    "prefill": "Triton varlen and fp8 prefill against varlen_attn (GPU)",
    "overhead": "host cost of mla_decode and builder.build (--device cpu: a smoke run)",
    "dcp": "decode context parallelism, 1 GPU against 2 (--cpu: a smoke run)",
    "sparse": "sparse MLA: decode, prefill, the indexer and the DSA step against dense (GPU)",
}
"""The benchmarks by name (each is the module ``benchmarks.<name>`` with a ``main(argv)``)."""


def usage() -> str:
    lines = ["usage: python -m benchmarks <name> [args]   (<name> --help for its options)", ""]
    lines += [f"  {name:10s} {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
