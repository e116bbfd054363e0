"""The functional KV write, :func:`write_kv` (under ``torch.compile`` one op of
:mod:`mla.engine.functional.ops`, no graph break)."""

from __future__ import annotations

import torch

from mla.core.errors import InvalidInputError
from mla.core.platform import Platform, resolve_platform
from mla.core.validate import CallValidateMode, require_call_validate_mode, require_slots_inside
from mla.engine.backend import ops
from mla.engine.backend.checks import check_kv_write
from mla.engine.functional import ops as functional_ops
from mla.engine.functional.plan_cache import available_provider
from mla.providers.base import KernelProvider

__all__ = ["write_kv"]


def write_kv(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_scale: float | torch.Tensor | None = None,
    provider: str | KernelProvider = "auto",
    platform: Platform | str | None = None,
    validate: CallValidateMode = "checked",
) -> None:
    """Write new latent rows into the paged cache, in vLLM's ``concat_and_cache_mla`` order.

    kv_c ``[N, kv_lora_rank]`` and k_pe ``[N, rope]`` (float), kv_cache
    ``[num_blocks, block_size, kv_lora_rank + rope]`` (float, or fp8 with ``kv_scale``: the
    cache stores ``value / kv_scale``), slot_mapping int ``[N]`` flat slots
    ``block * block_size + offset`` (negative: skipped). ``kv_scale`` is a finite float > 0 or
    a 0-d / one-element float tensor on the cache's device, and ``None`` for a float cache.
    Every provider skips a slot outside the cache (memory-safe). ``validate``:

    * ``"checked"`` (default): a slot past the cache raises :class:`InvalidInputError` naming
      ``slot_mapping``, after the write (the valid rows are written, the bad one skipped): the
      largest slot is computed on the device before the launch and read after it, one small
      device-to-host read that waits for the write (not in a call recorded into the caller's
      CUDA graph, which runs as ``"fast"``);
    * ``"fast"``: trusts the slots (no read back; a slot past the cache is skipped silently);
    * ``"full"`` (debug): reads ``slot_mapping`` on the host before the write and rejects slots
      outside the cache and any slot two tokens share.

    Runs ``mla::write_kv`` (under ``torch.compile``: one ``mla::functional_write_kv`` op, whose
    body is this function). Raises :class:`InvalidInputError` naming the bad argument.
    """
    if torch.compiler.is_compiling():
        _traced_write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, provider, platform, validate)
        return
    mode = require_call_validate_mode(validate)
    check_kv_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, "full" if mode == "full" else "fast")
    prov = available_provider(provider, resolve_platform(platform, kv_cache.device))
    scale: torch.Tensor | None
    if isinstance(kv_scale, torch.Tensor):
        scale = kv_scale.reshape(1).to(torch.float32)
    elif kv_scale is not None:
        scale = torch.full((1,), kv_scale, dtype=torch.float32, device=kv_cache.device)
    else:
        scale = None
    top = None
    if mode == "checked" and slot_mapping.numel() and not _capturing(kv_cache):
        top = slot_mapping.amax()  # (on the device; read after the write)
    ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, scale, ops.provider_handle(prov))
    if top is not None:
        _check_written_slots(slot_mapping, int(top), kv_cache)


def _capturing(kv_cache: torch.Tensor) -> bool:
    """The call is being recorded into the caller's CUDA graph (nothing can be read back)."""
    return kv_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_written_slots(slot_mapping: torch.Tensor, top: int, kv_cache: torch.Tensor) -> None:
    """``validate="checked"``: the largest slot (read after the write) is inside the cache; when
    it is not, the host rule on a copy of the slots names the token (if the slots changed
    since, the largest slot is the error)."""
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    if top < num_blocks * block_size:
        return
    require_slots_inside(slot_mapping.cpu(), num_blocks=num_blocks, block_size=block_size)
    raise InvalidInputError(
        "slot_mapping",
        f"held slot {top} (skipped) when the write ran, outside the cache's {num_blocks * block_size} "
        "slots, but the current slot_mapping has none; was it changed while the call ran?",
    )


# -- under torch.compile: one op per call (see mla.engine.functional.decode) -----------------------

_eager_write_kv = torch.compiler.disable(write_kv, reason=functional_ops.UNTRACEABLE)  # type: ignore[no-untyped-call]


def _traced_write_kv(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None,
    provider: str | KernelProvider,
    platform: Platform | str | None,
    validate: CallValidateMode,
) -> None:
    """What a compiled :func:`write_kv` records: ``mla::functional_write_kv``."""
    scales = functional_ops.scale_arguments(kv_scale)
    handle = -1
    if scales is not None and functional_ops.tensors(kv_c, k_pe, kv_cache, slot_mapping):
        handle = functional_ops.options_handle(provider, platform, validate)
    if scales is None or handle < 0:
        _eager_write_kv(
            kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale, provider=provider, platform=platform,
            validate=validate,
        )  # fmt: skip
        return
    functional_ops.write_kv(kv_c, k_pe, kv_cache, slot_mapping, scales[0], scales[1], handle)


def _write_kv_body(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
    kv_scale_value: float | None,
    options: int,
) -> None:
    """The body of ``mla::functional_write_kv`` (its schema's arguments): the eager call."""
    provider, platform, validate = functional_ops.options(options)
    write_kv(
        kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale_value if kv_scale is None else kv_scale,
        provider=provider, platform=platform, validate=validate,
    )  # fmt: skip


functional_ops.implement("functional_write_kv", _write_kv_body)
