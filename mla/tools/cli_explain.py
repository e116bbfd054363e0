"""``mla explain``: one simulated case (arch, provider, heads, qlen, KV dtype, knobs) resolved with
every candidate's reasons, as a record with its JSON form and text rendering."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from mla.core.config import (
    DS_MLA_DTYPE,
    EngineLimits,
    GraphMode,
    KVCacheSpec,
    MLADims,
    is_fp8,
    normalize_dtype,
)
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.errors import ProviderUnavailableError
from mla.core.explain import Explanation
from mla.core.platform import Knobs, Platform, detect_platform, simulated_platform
from mla.engine.decision.resolver import Resolver
from mla.providers import auto_order, auto_provider
from mla.tools.cli_info import ProviderView, emulated_view, provider_view, reasons_json, static_capabilities


@attrs.frozen(eq=False)
class ExplainResult:
    """One simulated case: the provider as seen here and the resolver's explanation."""

    view: ProviderView
    explanation: Explanation
    kernel_note: str | None = None
    """The provider's word on which of its kernel families serves the case (``kernel_note``)."""
    refused: str | None = None
    """Why a backend with the case's limits refuses the step before any strategy is asked
    (``--qlen`` above ``--max-decode-qlen``), or ``None``."""

    @property
    def runs(self) -> bool:
        """A strategy fits and the limits admit the step (exit code 0)."""
        return self.explanation.chosen is not None and self.refused is None

    def to_json(self) -> dict[str, Any]:
        """``Explanation.to_json()`` (``phase``, ``chosen``, ``candidates`` with ``name``,
        ``supported``, ``reasons``...) plus the provider's availability and the capability
        record the case was resolved with."""
        payload = self.explanation.to_json()
        payload["provider"] = {
            "name": self.view.name,
            "available": bool(self.view.availability),
            "reasons": reasons_json(self.view.availability),
            "emulated_by": self.view.emulated_by,
            "kernel_note": self.kernel_note,
        }
        caps = self.view.capabilities
        payload["capabilities"] = caps.describe() if caps is not None else None
        payload["refused_by_limits"] = self.refused
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
            if static_capabilities(name, None, platform) is not None:
                return name
        return _auto_choice(platform)
    return _auto_choice(platform) if requested == "auto" else requested


def explain_case(args: argparse.Namespace) -> ExplainResult:
    """Build the case's context the way the backend does and explain it.

    ``--qlen`` above ``--max-decode-qlen`` is explained like any other case (the persistent path
    says why it declines), and the result records that a backend with those limits refuses the
    step (``refused``: exit code 2). Raises :class:`ProviderUnavailableError` when the provider's capability
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
    if args.kv_dtype == "fp8_ds_mla":
        kv_dtype = DS_MLA_DTYPE
    else:
        kv = normalize_dtype(args.kv_dtype, argument="--kv-dtype")
        kv_dtype = caps.fp8_dtype if is_fp8(kv) else kv
    # The softmax scale decides nothing: DeepSeek's 192 ** -0.5 stands in for the model's.
    index_topk = getattr(args, "index_topk", None)
    dims = MLADims(num_heads=args.heads, softmax_scale=192**-0.5, index_topk=index_topk)
    cache = KVCacheSpec(block_size=args.block_size, dtype=kv_dtype)
    max_decode_qlen = args.max_decode_qlen or args.qlen
    if args.phase == "decode":
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
    refused = None
    if args.phase == "decode" and args.qlen > max_decode_qlen:
        refused = (
            f"a backend with these limits refuses this step: --qlen {args.qlen} exceeds the engine's "
            f"--max-decode-qlen {max_decode_qlen} (speculative tokens + 1); raise --max-decode-qlen "
            f"to {args.qlen} to serve it"
        )
    return ExplainResult(view, explanation, note, refused)


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
    if result.refused:
        lines.append(result.refused)
    return "\n".join(lines)
