"""The ``mla`` command line: ``info``, ``explain`` and ``demo``.

* ``mla info``: the detected platform, every kernel provider with its availability (and why
  not), capability record and feature probes, and the strategies of each phase in priority
  order. ``--json`` for tools.
* ``mla explain``: simulate one case on any machine (any arch, provider, head count, qlen, KV
  dtype, knobs) and print every candidate strategy with its reasons and the winner. Exit code 0
  when a strategy fits, 2 when none does (``chosen`` is ``null`` in ``--json``); with an
  unavailable provider nothing can run here, and the output says what it would choose if it
  were available.
* ``mla demo``: a serving loop through :class:`~mla.engine.backend.MLABackend` checked against the
  reference math (:mod:`mla.tools.demo`). Exit code 0 when every step is within tolerance, 1 when one
  is not, 2 when the configuration cannot be served here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import IO, Any

import attrs
import torch

import mla
from mla.core.capabilities import ProviderCapabilities
from mla.core.config import EngineLimits, GraphMode, KVCacheSpec, MLADims, is_fp8, normalize_dtype
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.errors import InvalidInputError, MLAError, ProviderUnavailableError, UnsupportedError
from mla.core.explain import Explanation
from mla.core.platform import (
    FP8_PREFILL_MODES,
    KNOWN_ARCHS,
    SMALL_HEAD_MODES,
    Knobs,
    Platform,
    detect_platform,
    normalize_arch,
    simulated_platform,
)
from mla.core.support import Support
from mla.engine.registry import DEFAULT_REGISTRY, Registry
from mla.engine.resolver import Resolver
from mla.providers import (
    PROVIDER_MODULES,
    auto_order,
    auto_provider,
    emulation_capabilities,
    get_provider,
    provider_names,
)
from mla.providers.aiter.capabilities import with_native_h24
from mla.providers.base import KernelProvider
from mla.providers.torch_ref import TorchProvider
from mla.strategy import Phase
from mla.tools.demo import DemoConfig, StepRecord, run_demo
from mla.tools.demo_dcp import run_dcp_demo

_DEMO_DEFAULTS = DemoConfig()

EXIT_OK = 0
EXIT_FAILED = 1
"""``mla demo``: a step missed its tolerance."""
EXIT_UNSUPPORTED = 2
"""``mla explain``: no strategy fits; ``mla demo``: the configuration cannot be served here."""


def _json_default(value: object) -> str:
    return str(value).removeprefix("torch.")


def _dump(payload: object, out: IO[str]) -> None:
    out.write(json.dumps(payload, indent=2, default=_json_default) + "\n")


def _reasons_json(support: Support) -> list[dict[str, str]]:
    return [{"code": r.code, "message": r.message} for r in support.reasons]


def _unavailable(exc: Exception) -> Support:
    message = str(exc) if isinstance(exc, ProviderUnavailableError) else f"{type(exc).__name__}: {exc}"
    return Support.no("provider-unavailable", message)


# -- providers as the CLI sees them -----------------------------------------------------------


@attrs.frozen(eq=False)
class ProviderView:
    """A provider for ``info``/``explain``: the object when it imports, its availability here,
    and its capability record on the platform in question."""

    name: str
    provider: KernelProvider | None
    """``None`` when the provider module cannot be imported here."""
    availability: Support
    capabilities: ProviderCapabilities | None
    """``None`` when the record cannot be known here."""
    emulated_by: str | None = None
    """``"torch"`` when the torch reference kernels run under this provider's record."""


def provider_view(
    name: str, platform: Platform, *, native_h24: bool = False, static_fallback: bool = True
) -> ProviderView:
    """Look ``name`` up without failing: a provider that cannot be imported or probed here is
    shown with the error as its availability reason.

    When the provider cannot give its record and ``static_fallback`` is set, its capabilities
    fall back to its :meth:`~mla.providers.base.KernelProvider.static_capabilities` for
    ``platform`` (aiter's as shipped). ``native_h24`` assumes aiter's native-H24 reducer and
    planner (:func:`mla.providers.aiter.capabilities.with_native_h24`).
    """
    provider: KernelProvider | None = None
    caps: ProviderCapabilities | None = None
    # Diagnostics must not die on a half-installed provider: any failure becomes a reason.
    try:
        provider = get_provider(name)
        availability = provider.availability()
    except Exception as exc:
        provider, availability = None, _unavailable(exc)
    if provider is not None:
        try:
            caps = provider.capabilities(platform)
        except Exception as exc:
            availability += Support.no("capabilities-failed", f"{type(exc).__name__}: {exc}")
    if caps is None and static_fallback:
        caps = _static_capabilities(name, provider, platform)
    if caps is not None and native_h24:
        caps = with_native_h24(caps, platform.arch)
    return ProviderView(name, provider, availability, caps)


def _static_capabilities(
    name: str, provider: KernelProvider | None, platform: Platform
) -> ProviderCapabilities | None:
    """The provider's static record, from its class when it could not be built here."""
    if provider is not None:
        return type(provider).static_capabilities(platform)
    module_name, class_name = PROVIDER_MODULES[name]
    try:
        cls: type[KernelProvider] = getattr(importlib.import_module(module_name), class_name)
    except Exception:  # the module itself does not import here: nothing is known
        return None
    return cls.static_capabilities(platform)


def emulated_view(name: str, platform: Platform, *, native_h24: bool = False) -> ProviderView:
    """The torch reference provider under ``name``'s capability record (always available; see
    :func:`mla.providers.emulation_capabilities`)."""
    try:
        caps = emulation_capabilities(name, platform, native_h24=native_h24)
    except Exception as exc:
        raise ProviderUnavailableError(
            f"emulate: the capability record of {name!r} is not known here ({exc}); "
            "emulate 'aiter', or install the provider's library"
        ) from exc
    return ProviderView(name, TorchProvider(capabilities=caps), Support.yes(), caps, emulated_by="torch")


# -- mla info --------------------------------------------------------------------------------


def _platform_json(platform: Platform) -> dict[str, Any]:
    return {
        "vendor": platform.vendor,
        "arch": platform.arch,
        "num_compute_units": platform.num_compute_units,
        "device_type": platform.device_type,
        "knobs": attrs.asdict(platform.knobs),
    }


def _strategies_json(registry: Registry) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for phase in Phase:
        rows = []
        for reg in registry.entries(phase):
            cls = reg.strategy
            paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
            rows.append(
                {
                    "name": cls.NAME,
                    "class": f"{cls.__module__}.{cls.__qualname__}",
                    "priority": reg.priority,
                    "kind": cls.KIND.value,
                    "requires": sorted(c.value for c in cls.REQUIRES),
                    "graph_support": cls.GRAPH_SUPPORT.value,
                    "summary": " ".join(paragraph.split()),
                }
            )
        out[phase.value] = rows
    return out


def _provider_json(view: ProviderView) -> dict[str, Any]:
    probes: dict[str, object] = {}
    if view.provider is not None:
        try:
            probes = view.provider.describe_probes()
        except Exception as exc:  # a diagnostic listing shows a failing probe instead of dying
            probes = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "name": view.name,
        "available": bool(view.availability),
        "reasons": _reasons_json(view.availability),
        "capabilities": view.capabilities.describe() if view.capabilities is not None else None,
        "probes": probes,
    }


def info_payload(platform: Platform | None = None) -> dict[str, Any]:
    """What ``mla info --json`` prints (a JSON-ready dict)."""
    platform = platform or detect_platform()
    providers = []
    for name in provider_names():
        view = provider_view(name, platform, static_fallback=platform.vendor == "amd")
        providers.append(_provider_json(view))
    return {
        "version": mla.__version__,
        "torch": torch.__version__,
        "platform": _platform_json(platform),
        "auto_provider": auto_provider(platform).name,
        "providers": providers,
        "strategies": _strategies_json(DEFAULT_REGISTRY),
    }


def _format_value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return _json_default(value)


def render_info(payload: dict[str, Any]) -> str:
    plat = payload["platform"]
    knobs = ", ".join(f"{k}={v}" for k, v in plat["knobs"].items())
    lines = [
        f"mla {payload['version']} (torch {payload['torch']})",
        f"platform: {plat['arch']} ({plat['vendor']}, {plat['num_compute_units']} compute units, "
        f"device {plat['device_type']}); knobs: {knobs}",
        f"provider='auto' picks here: {payload['auto_provider']}",
        "",
        "providers:",
    ]
    for prov in payload["providers"]:
        lines.append(f"  {prov['name']}: {'available' if prov['available'] else 'unavailable'}")
        lines += [f"      - [{r['code']}] {r['message']}" for r in prov["reasons"]]
        caps = prov["capabilities"]
        if caps is None:
            lines.append("    capabilities: unknown here")
        else:
            lines.append(f"    capabilities on {plat['arch']}:")
            lines += [
                f"      {key}: {_format_value(value)}" for key, value in caps.items() if key != "provider"
            ]
        probes = prov["probes"]
        if probes:
            lines.append("    probes:")
            lines += [f"      {key}: {_format_value(value)}" for key, value in probes.items()]
    lines += ["", "strategies in priority order (preference rules reorder per case; see `mla explain`):"]
    for phase, rows in payload["strategies"].items():
        lines.append(f"  {phase}:")
        for row in rows:
            lines.append(
                f"    {row['priority']:>4}  {row['name']:<24} kind={row['kind']:<12} "
                f"graph={row['graph_support']:<14} requires={','.join(row['requires'])}"
            )
            lines += textwrap.wrap(
                row["summary"], width=100, initial_indent=" " * 10, subsequent_indent=" " * 10
            )
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace, out: IO[str]) -> int:
    payload = info_payload()
    if args.json:
        _dump(payload, out)
    else:
        out.write(render_info(payload) + "\n")
    return EXIT_OK


# -- mla explain -----------------------------------------------------------------------------


@attrs.frozen(eq=False)
class ExplainResult:
    """One simulated case: the provider as seen here and the resolver's explanation."""

    view: ProviderView
    explanation: Explanation
    kernel_note: str | None = None
    """The provider's word on which of its kernel families serves the case (``kernel_note``)."""

    def to_json(self) -> dict[str, Any]:
        """``Explanation.to_json()`` (``phase``, ``chosen``, ``candidates`` with ``name``,
        ``supported``, ``reasons``...) plus the provider's availability and the capability
        record the case was resolved with."""
        payload = self.explanation.to_json()
        payload["provider"] = {
            "name": self.view.name,
            "available": bool(self.view.availability),
            "reasons": _reasons_json(self.view.availability),
            "emulated_by": self.view.emulated_by,
            "kernel_note": self.kernel_note,
        }
        caps = self.view.capabilities
        payload["capabilities"] = caps.describe() if caps is not None else None
        return payload


def _explain_platform(args: argparse.Namespace) -> Platform:
    base = Knobs.from_env()
    knobs = Knobs(
        small_head_mode=args.small_head_mode or base.small_head_mode,
        fp8_prefill=args.fp8_prefill or base.fp8_prefill,
    )
    if args.arch:
        return simulated_platform(args.arch, knobs=knobs)
    return detect_platform(knobs=knobs)


def _as_gpu(platform: Platform) -> Platform:
    """``platform`` with a simulated GPU arch counted as a GPU."""
    return platform if platform.vendor == "cpu" else attrs.evolve(platform, device_type="cuda")


def _auto_choice(platform: Platform) -> str:
    """What ``provider="auto"`` picks for ``platform`` with the libraries installed here."""
    return auto_provider(_as_gpu(platform)).name


def _provider_name(requested: str | None, platform: Platform) -> str:
    """``--provider``: a name; ``auto``; or, when omitted, the first provider ``auto`` tries on
    ``platform`` whose record is known without its library (aiter on a gfx arch), else auto's
    choice with the libraries installed here."""
    if requested is None:
        for name in auto_order(_as_gpu(platform)):
            if _static_capabilities(name, None, platform) is not None:
                return name
        return _auto_choice(platform)
    return _auto_choice(platform) if requested == "auto" else requested


def explain_case(args: argparse.Namespace) -> ExplainResult:
    """Build the case's context the way the backend does and explain it.

    ``--qlen`` above ``--max-decode-qlen`` is a case like any other (the persistent path says
    why it declines). Raises :class:`ProviderUnavailableError` when the provider's capability
    record is unknown here.
    """
    platform = _explain_platform(args)
    if args.emulate:
        view = emulated_view(args.emulate, platform, native_h24=args.native_h24)
    else:
        view = provider_view(_provider_name(args.provider, platform), platform, native_h24=args.native_h24)
    if view.capabilities is None:
        raise ProviderUnavailableError(
            f"provider: the capability record of {view.name!r} is not known here "
            f"({view.availability}); try --emulate aiter or another provider"
        )
    caps = view.capabilities
    q_dtype = normalize_dtype(args.q_dtype, argument="--q-dtype")
    kv = normalize_dtype(args.kv_dtype, argument="--kv-dtype")
    kv_dtype = caps.fp8_dtype if is_fp8(kv) else kv
    dims = MLADims(num_heads=args.heads)
    cache = KVCacheSpec(block_size=args.block_size, dtype=kv_dtype)
    if args.phase == "decode":
        max_decode_qlen = args.max_decode_qlen or args.qlen
        limits = EngineLimits(
            max_num_seqs=max(1, args.batch_size),
            max_model_len=4096,
            max_num_batched_tokens=8192,
            max_decode_qlen=max_decode_qlen,
            graph_mode=GraphMode(args.graph_mode),
        )
        ctx: DecodeContext | PrefillContext = decode_context(
            dims=dims,
            cache=cache,
            q_dtype=q_dtype,
            platform=platform,
            capabilities=caps,
            availability=view.availability,
            limits=limits,
            max_qlen=args.qlen,
            uniform_qlen=not args.mixed_qlen,
        )
    else:
        ctx = prefill_context(
            dims=dims,
            cache=cache,
            q_dtype=q_dtype,
            platform=platform,
            capabilities=caps,
            availability=view.availability,
            has_chunked_context=args.chunked_context,
        )
    explanation = Resolver().explain(ctx, force=args.force)
    note = None
    if view.provider is not None and view.emulated_by is None:
        note = view.provider.kernel_note(
            phase=args.phase,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            kv_lora_rank=dims.kv_lora_rank,
            rope_dim=dims.qk_rope_head_dim,
        )
    return ExplainResult(view, explanation, note)


def render_explain(result: ExplainResult) -> str:
    view = result.view
    lines = []
    if view.emulated_by:
        lines.append(f"provider {view.name}: emulated by the {view.emulated_by} reference kernels")
    elif not view.availability:
        lines.append(
            f"provider {view.name}: not available here, so no strategy can run here; the reasons "
            "below say why, once, then what would decide where it is available"
        )
    lines.append(str(result.explanation))
    if result.kernel_note:
        lines.append(f"provider {view.name}: {result.kernel_note}")
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace, out: IO[str]) -> int:
    result = explain_case(args)
    if args.json:
        _dump(result.to_json(), out)
    else:
        out.write(render_explain(result) + "\n")
    return EXIT_OK if result.explanation.chosen is not None else EXIT_UNSUPPORTED


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
    )
    progress = None if args.quiet else ProgressBar(sys.stderr)
    runner = run_dcp_demo if config.dcp > 1 else run_demo
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
    explain.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp32", "fp8"), default="bf16")
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
    demo.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
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
