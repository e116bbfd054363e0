"""The ``mla`` command line: ``info``, ``explain`` and ``demo``.

* ``mla info``: the detected platform, every kernel provider with its availability (and why
  not), capability record and feature probes, and the strategies of each phase in priority
  order. ``--json`` for tools.
* ``mla explain``: simulate one case on any machine (any arch, provider, head count, qlen, KV
  dtype, knobs) and print every candidate strategy with its reasons and the winner. Exit code 0
  when a strategy fits, 2 when none does (``chosen`` is ``null`` in ``--json``) or when the
  limits refuse the step (``--qlen`` above ``--max-decode-qlen``: ``refused_by_limits``); with an
  unavailable provider nothing can run here, and the output says what it would choose if it
  were available.
* ``mla demo``: a serving loop through :class:`~mla.engine.backend.MLABackend` checked against the
  reference math (:mod:`mla.tools.demo`). Exit code 0 when every step is within tolerance, 1 when one
  is not, 2 when the configuration cannot be served here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

import mla
from mla.core.config import GraphMode
from mla.core.errors import InvalidInputError, MLAError, UnsupportedError
from mla.core.platform import FP8_PREFILL_MODES, KNOWN_ARCHS, SMALL_HEAD_MODES, normalize_arch
from mla.engine.decision.registry import DEFAULT_REGISTRY
from mla.providers import provider_names
from mla.tools.cli_explain import explain_case, render_explain
from mla.tools.cli_info import dump_json, info_payload, provider_view, render_info
from mla.tools.demo import run_demo
from mla.tools.demo_dcp import run_dcp_demo
from mla.tools.demo_records import DemoConfig, StepRecord
from mla.tools.demo_sparse import run_sparse_demo

_DEMO_DEFAULTS = DemoConfig()

EXIT_OK = 0
EXIT_FAILED = 1
"""``mla demo``: a step missed its tolerance."""
EXIT_UNSUPPORTED = 2
"""``mla explain``: no strategy fits; ``mla demo``: the configuration cannot be served here."""


def cmd_info(args: argparse.Namespace, out: IO[str]) -> int:
    payload = info_payload()
    if args.json:
        dump_json(payload, out)
    else:
        out.write(render_info(payload) + "\n")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace, out: IO[str]) -> int:
    result = explain_case(args)
    if args.json:
        dump_json(result.to_json(), out)
    else:
        out.write(render_explain(result) + "\n")
    return EXIT_OK if result.runs else EXIT_UNSUPPORTED


# -- mla demo --------------------------------------------------------------------------------


class ProgressBar:
    """Prints demo progress to ``stream``: one redrawn line on a terminal, a line per tenth of
    the run elsewhere (CI logs)."""

    def __init__(self, stream: IO[str], *, width: int = 28) -> None:
        self.stream, self.width = stream, width
        self.tty = stream.isatty()
        self.failed = 0

    def __call__(self, record: StepRecord) -> None:
        done = record.index + 1
        self.failed += not record.ok
        filled = self.width * done // record.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"[{bar}] {done:>4}/{record.total} steps  decode: {record.decode_strategy or '-'}  "
            f"prefill: {record.prefill_strategy or '-'}" + (f"  FAILED: {self.failed}" if self.failed else "")
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(110))
            if done == record.total:
                self.stream.write("\n")
        elif done == record.total or done % max(1, record.total // 10) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


def cmd_demo(args: argparse.Namespace, out: IO[str]) -> int:
    config = DemoConfig(
        provider=args.provider,
        steps=args.steps,
        heads=args.heads,
        seed=args.seed,
        kv_dtype=args.kv_dtype,
        max_decode_qlen=args.max_decode_qlen,
        dtype=args.dtype,
        arch=args.arch,
        emulate=args.emulate,
        block_size=args.block_size,
        dcp=args.dcp,
        sparse=args.sparse,
        index_topk=args.index_topk,
        index_key_dtype=args.index_dtype,
    )
    progress = None if args.quiet else ProgressBar(sys.stderr)
    runner = run_sparse_demo if config.sparse else run_dcp_demo if config.dcp > 1 else run_demo
    report = runner(config, progress=progress)
    out.write(report.summary() + "\n")
    return EXIT_OK if report.passed else EXIT_FAILED


# -- parser ----------------------------------------------------------------------------------


def _named(name: str) -> Callable[[Callable[[str], Any]], Callable[[str], Any]]:
    """Give an argparse type function the name argparse shows in its errors."""

    def apply(function: Callable[[str], Any]) -> Callable[[str], Any]:
        function.__name__ = name
        return function

    return apply


@_named("positive integer")
def positive_int(text: str) -> int:
    """``--heads 16``: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (must be > 0)")
    return value


@_named("arch")
def arch_name(text: str) -> str:
    """``--arch``: a known arch in its canonical spelling (``sm_90`` -> ``sm90``)."""
    try:
        return normalize_arch(text, argument="--arch")
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--arch: ")) from None


@_named("strategy")
def strategy_name(text: str) -> str:
    """``--force``: a registered strategy's NAME or class name, as its NAME."""
    try:
        return DEFAULT_REGISTRY.get(text, argument="--force").NAME
    except UnsupportedError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--force: ")) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mla", description="Interchangeable attention strategies for Multi-head Latent Attention."
    )
    parser.add_argument("--version", action="version", version=f"mla {mla.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    providers = (*provider_names(), "auto")

    info = sub.add_parser("info", help="platform, providers, capabilities and strategies")
    info.add_argument("--json", action="store_true", help="print JSON")

    explain = sub.add_parser(
        "explain",
        help="simulate one case and explain the strategy choice",
        description="Explain the strategy choice for one case on any (simulated) platform. "
        "Exit code 0 when a strategy fits, 2 when none does.",
    )
    explain.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    explain.add_argument(
        "--provider",
        choices=providers,
        help="kernel provider (default: aiter for a gfx arch, else what 'auto' picks)",
    )
    explain.add_argument(
        "--emulate",
        choices=provider_names(),
        help="run the torch reference kernels under this provider's capability record "
        "(available everywhere; replaces --provider)",
    )
    explain.add_argument(
        "--arch",
        type=arch_name,
        help=f"simulate this arch ({', '.join(KNOWN_ARCHS)}; sm_90 or mi300x spellings too); default: detect",
    )
    explain.add_argument("--heads", type=positive_int, default=16, help="query heads per rank (default 16)")
    explain.add_argument(
        "--qlen", type=positive_int, default=1, help="the batch's max decode qlen (default 1)"
    )
    explain.add_argument(
        "--max-decode-qlen", type=positive_int, help="engine's max decode qlen (default: --qlen)"
    )
    explain.add_argument("--mixed-qlen", action="store_true", help="requests have different qlens")
    explain.add_argument("--batch-size", type=positive_int, default=1)
    explain.add_argument(
        "--graph-mode",
        choices=[mode.value for mode in GraphMode],
        default=GraphMode.NONE.value,
        help="how the engine captures decode steps in CUDA graphs",
    )
    explain.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp32", "fp8", "fp8_ds_mla"), default="bf16")
    explain.add_argument(
        "--index-topk",
        type=positive_int,
        help="a DeepSeek Sparse Attention model keeping this many tokens per row (sparse strategies)",
    )
    explain.add_argument("--q-dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    explain.add_argument("--block-size", type=positive_int, default=16)
    explain.add_argument(
        "--small-head-mode", choices=SMALL_HEAD_MODES, help="default: environment, else auto"
    )
    explain.add_argument("--fp8-prefill", choices=FP8_PREFILL_MODES, help="default: environment, else auto")
    explain.add_argument("--chunked-context", action="store_true", help="prefill step has cached context")
    explain.add_argument("--native-h24", action="store_true", help="provider runs 24 heads natively")
    explain.add_argument(
        "--force",
        metavar="STRATEGY",
        type=strategy_name,
        help="force a strategy, by NAME or class name (same checks)",
    )
    explain.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser(
        "demo",
        help="serve mixed steps through the backend, checked against the reference",
        description="A serving loop through MLABackend on random latent data: prefills with and "
        "without cached context, decodes, speculative verifies, CUDA-graph padding. Every step "
        "is checked against mla.tools.reference; exit code 1 when one misses its tolerance.",
    )
    demo.add_argument("--provider", choices=providers, default="auto")
    demo.add_argument("--steps", type=positive_int, default=_DEMO_DEFAULTS.steps)
    demo.add_argument("--heads", type=positive_int, default=_DEMO_DEFAULTS.heads)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp8", "fp8_ds_mla"),
        default="bf16",
        help="latent cache format (fp8_ds_mla: per-tile scales, with --sparse)",
    )
    demo.add_argument(
        "--sparse",
        action="store_true",
        help="serve a DeepSeek Sparse Attention model: indexer, top-k, sparse attention",
    )
    demo.add_argument(
        "--index-topk",
        type=positive_int,
        default=_DEMO_DEFAULTS.index_topk,
        help=f"tokens the indexer keeps per row with --sparse (default {_DEMO_DEFAULTS.index_topk})",
    )
    demo.add_argument("--index-dtype", choices=("bf16", "fp8"), default="bf16", help="index-key cache")
    demo.add_argument("--max-decode-qlen", type=positive_int, default=_DEMO_DEFAULTS.max_decode_qlen)
    demo.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="model dtype")
    demo.add_argument("--block-size", type=positive_int, default=_DEMO_DEFAULTS.block_size)
    demo.add_argument(
        "--arch",
        type=arch_name,
        help=f"simulate this arch instead of detecting the device ({', '.join(KNOWN_ARCHS)})",
    )
    demo.add_argument(
        "--emulate",
        choices=provider_names(),
        help="torch reference kernels under this provider's capability record (e.g. aiter with "
        "--arch gfx950 runs the Gluon and padding paths on a CPU)",
    )
    demo.add_argument(
        "--dcp", type=positive_int, default=1, help="serve with N processes, the KV cache sharded by token"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mla`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    commands = {"info": cmd_info, "explain": cmd_explain, "demo": cmd_demo}
    try:
        return commands[args.command](args, sys.stdout)
    except MLAError as exc:
        sys.stderr.write(f"mla {args.command}: {exc}\n")
        return EXIT_UNSUPPORTED


__all__ = ["build_parser", "explain_case", "info_payload", "main", "provider_view"]
