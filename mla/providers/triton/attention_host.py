"""Host side of the Triton attention launches (varlen and fp8 prefill): the head-dim blocks,
the launch heuristic and the argument checks the launchers share.

Plain Python throughout (:mod:`.host_math`, not Triton's ~5 µs ``triton.next_power_of_2`` and
``triton.cdiv``), and a launch's head-dim blocks are computed once per shape
(:func:`head_dim_blocks`).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import triton.language as tl

from mla.core.errors import InvalidInputError
from mla.providers.calls import VarlenPrefillCall, appended_passes
from mla.providers.triton.host_math import next_power_of_2

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The float dtypes the attention kernels take (and write)."""


@attrs.frozen
class HeadDimBlocks:
    """How a head dim maps onto power-of-two Triton blocks (see :mod:`.prefill`'s docstring)."""

    block_a: int
    block_b: int
    block_v: int

    @classmethod
    def for_dims(cls, qk_dim: int, v_dim: int, *, min_k: int = 16) -> HeadDimBlocks:
        """``min_k``: the smallest dot reduction width the kernel's operand dtype allows (16 for
        16-bit operands, 32 for fp8 on sm_90); narrower head-dim pieces are padded (masked)."""
        block_a = max(min_k, 1 << (qk_dim.bit_length() - 1))
        rest = qk_dim - block_a
        block_b = max(min_k, next_power_of_2(rest)) if rest > 0 else 0
        return cls(block_a, block_b, max(16, next_power_of_2(v_dim)))

    @classmethod
    def for_split_keys(cls, nope_dim: int, rope_dim: int, v_dim: int) -> HeadDimBlocks:
        """Keys given as two operands (``k [Tk, H, nope]`` and the shared ``k_pe [Tk, rope]``):
        one block per operand, each its width rounded up to a power of two (at least 16): 128
        and 64 for 128 + 64, as :meth:`for_dims` splits 192."""
        blocks = (max(16, next_power_of_2(dim)) for dim in (nope_dim, rope_dim, v_dim))
        return cls(*blocks)


@functools.lru_cache(maxsize=64)
def head_dim_blocks(qk_dim: int, v_dim: int, min_k: int = 16) -> HeadDimBlocks:
    """:meth:`HeadDimBlocks.for_dims`, once per ``(qk_dim, v_dim, min_k)`` (a launch's)."""
    return HeadDimBlocks.for_dims(qk_dim, v_dim, min_k=min_k)


@functools.lru_cache(maxsize=64)
def split_key_blocks(nope_dim: int, rope_dim: int, v_dim: int) -> HeadDimBlocks:
    """:meth:`HeadDimBlocks.for_split_keys`, once per shape."""
    return HeadDimBlocks.for_split_keys(nope_dim, rope_dim, v_dim)


@attrs.frozen
class AttentionLaunchConfig:
    """Tile sizes and compiler knobs of one attention kernel launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=16)
def _device_arch(device: torch.device) -> tuple[str, int]:
    """``(vendor, major capability)``: ``("cpu", 0)`` for the interpreter, ``("amd", 0)`` on ROCm."""
    if device.type != "cuda":
        return ("cpu", 0)
    if torch.version.hip is not None:
        return ("amd", 0)
    return ("nvidia", torch.cuda.get_device_capability(device)[0])


def choose_varlen_config(
    device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, max_seqlen_q: int
) -> AttentionLaunchConfig:
    """Launch heuristic for :func:`~mla.providers.triton.prefill.varlen_attention_fwd` (no
    autotuning in the hot path).

    * CPU (Triton interpreter): 32 x 32 tiles, so tiny test shapes still cross block boundaries.
    * 32-bit inputs: 64 x 32 tiles, 4 warps (fp32 tiles are twice the bytes).
    * NVIDIA sm80+ and 16-bit inputs with ``Dqk, Dv <= 256``: 128 x 64 tiles, 8 warps,
      3 pipeline stages on sm90+ (2 below: 164 KB of shared memory on sm80). For 192/128 this
      holds Q (48 KB) plus three K/V stages (40 KB each) in shared memory, 255 registers, no
      spills. The best swept on all four shapes (192/128 causal bf16, H 16/128, 4 x 4096 and
      16 x 1024): 2 stages -18%, 128 x 128 (spills) -8%, 64 x 64 with 4 warps -30%, 4 stages no
      gain (``docs/performance.md``).
    * AMD and older NVIDIA: 64 x 64, 4 warps, 1 stage.
    * ``max_seqlen_q <= 64`` halves ``block_m`` to 64 (a 128-row block would be half empty).

    One record per distinct answer (:func:`_varlen_config`): a launch builds none.
    """
    return _varlen_config(device, dtype, qk_dim, v_dim, max_seqlen_q <= 64)


@functools.lru_cache(maxsize=64)
def _varlen_config(
    device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int, short_queries: bool
) -> AttentionLaunchConfig:
    vendor, major = _device_arch(device)
    if vendor == "cpu":
        return AttentionLaunchConfig(32, 32, 4, 1)
    if dtype == torch.float32:
        return AttentionLaunchConfig(64, 32, 4, 2)
    if vendor == "nvidia" and major >= 8 and qk_dim <= 256 and v_dim <= 256:
        block_m = 64 if short_queries else 128
        return AttentionLaunchConfig(block_m, 64, 8 if block_m == 128 else 4, 3 if major >= 9 else 2)
    return AttentionLaunchConfig(64, 64, 4, 1)


_TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TRITON_DTYPES[dtype]


def _check(name: str, tensor: torch.Tensor, ndim: int, *, last_contiguous: bool = True) -> None:
    if tensor.dim() != ndim:
        raise InvalidInputError(name, f"expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if last_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise InvalidInputError(name, "the last dim must be contiguous (stride 1); pass .contiguous()")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    *,
    k_pe: torch.Tensor | None = None,
    prior_out: torch.Tensor | None = None,
    prior_lse: torch.Tensor | None = None,
) -> None:
    """Shape/dtype/device checks shared by the varlen and fp8 launchers (no host sync); the
    varlen call's ``k_pe`` and prior state too (:class:`~mla.providers.calls.VarlenPrefillCall`)."""
    for name, tensor in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check(name, tensor, 3)
    _check("lse", lse, 2, last_contiguous=False)
    num_tokens, num_heads, qk_dim = q.shape
    key_dim = qk_dim
    if k_pe is not None:
        _check("k_pe", k_pe, 2)
        rope = k_pe.shape[1]
        if k_pe.shape[0] != k.shape[0] or not 0 < rope < qk_dim:
            raise InvalidInputError(
                "k_pe", f"expected [{k.shape[0]}, R] (k's rows), 0 < R < {qk_dim}, got {tuple(k_pe.shape)}"
            )
        if k_pe.dtype != q.dtype or k_pe.device != q.device:
            raise InvalidInputError(
                "k_pe", f"expected q's {q.dtype} on {q.device}, got {k_pe.dtype} on {k_pe.device}"
            )
        key_dim = qk_dim - rope
    if k.shape[1:] != (num_heads, key_dim):
        what = "" if k_pe is None else f" (q's {qk_dim} lanes less k_pe's {qk_dim - key_dim})"
        raise InvalidInputError("k", f"expected [Tk, {num_heads}, {key_dim}]{what}, got {tuple(k.shape)}")
    if v.shape[:2] != k.shape[:2]:
        raise InvalidInputError("v", f"expected [{k.shape[0]}, {num_heads}, Dv], got {tuple(v.shape)}")
    if out.shape != (num_tokens, num_heads, v.shape[2]):
        raise InvalidInputError(
            "out", f"expected {(num_tokens, num_heads, v.shape[2])}, got {tuple(out.shape)}"
        )
    if lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise InvalidInputError("lse", f"expected float32 {(num_tokens, num_heads)}, got {lse.dtype} "
                                f"{tuple(lse.shape)}")  # fmt: skip
    for name, index in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if index.dim() != 1 or index.dtype != torch.int32:
            raise InvalidInputError(
                name, f"expected a 1-D int32 tensor, got {index.dtype} {tuple(index.shape)}"
            )
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise InvalidInputError(
            "cu_seqlens_k", f"has {cu_seqlens_k.numel()} entries, cu_seqlens_q {cu_seqlens_q.numel()}"
        )
    devices = {t.device for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) != 1:
        raise InvalidInputError("q", f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if out.dtype not in FLOAT_DTYPES:
        raise InvalidInputError("out", f"dtype {out.dtype} is not one of {FLOAT_DTYPES}")
    if (prior_out is None) != (prior_lse is None):
        raise InvalidInputError("prior_out", "prior_out and prior_lse come together (or neither)")
    if prior_out is not None and prior_lse is not None:
        _check("prior_out", prior_out, 3)
        float_out = prior_out.dtype in FLOAT_DTYPES
        if prior_out.shape != out.shape or not float_out or prior_out.device != q.device:
            raise InvalidInputError(
                "prior_out", f"expected a float {tuple(out.shape)} tensor on {q.device} (out's shape), got "
                f"{prior_out.dtype} {tuple(prior_out.shape)} on {prior_out.device}",
            )  # fmt: skip
        if prior_lse.shape != lse.shape or prior_lse.dtype != torch.float32 or prior_lse.device != q.device:
            raise InvalidInputError(
                "prior_lse", f"expected float32 {tuple(lse.shape)} on {q.device}, got {prior_lse.dtype} "
                f"{tuple(prior_lse.shape)} on {prior_lse.device}",
            )  # fmt: skip
    if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise InvalidInputError("softmax_scale", f"must be a positive finite float, got {softmax_scale}")


def check_varlen_call(call: VarlenPrefillCall) -> None:
    """:func:`check_attention_args` for a varlen call, with q/k/v of one float dtype; with
    ``appended`` keys, for both of its passes (:func:`~mla.providers.calls.appended_passes`),
    an error of the appended pass naming ``appended.<argument>``. No host sync."""
    if call.appended is not None:
        appended, own = appended_passes(call)
        try:
            check_varlen_call(appended)
        except InvalidInputError as exc:
            if exc.argument not in ("k", "v", "cu_seqlens_k"):
                raise
            raise InvalidInputError(f"appended.{exc.argument}", exc.reason) from exc
        check_varlen_call(own)
        return
    q, k, v = call.q, call.k, call.v
    check_attention_args(
        q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.out, call.lse, call.softmax_scale,
        k_pe=call.k_pe, prior_out=call.prior_out, prior_lse=call.prior_lse,
    )  # fmt: skip
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidInputError("q", f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
