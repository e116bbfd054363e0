"""Static configuration records: model dims, KV-cache spec, engine limits.

All are frozen attrs records, validated on construction and hashable, so they can live inside a
:class:`~mla.core.context.DecodeContext` and key caches.
"""

from __future__ import annotations

import enum
import math

import attrs
import torch

from mla.core.errors import InvalidInputError, input_validator

FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
)
"""Every fp8 storage dtype a KV cache may use (per-tensor scale)."""

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})

DS_MLA_DTYPE: torch.dtype = torch.uint8
"""Storage dtype of an ``fp8_ds_mla`` cache (``KVCacheSpec(dtype="fp8_ds_mla")``): each token is
one row of bytes, the ``kv_lora_rank`` latent values as e4m3 in 128-wide tiles, one float32
power-of-two scale per tile, then the ``qk_rope_head_dim`` rope values in bf16 (656 bytes for
DeepSeek's 512/64; :mod:`mla.providers.formats` packs and unpacks it)."""
DS_MLA_TILE = 128
"""Latent values per scale tile of an ``fp8_ds_mla`` row."""

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}


def normalize_dtype(value: torch.dtype | str, *, argument: str = "dtype") -> torch.dtype:
    """Map engine spellings (``"bf16"``, ``"fp8_e4m3"``, ``torch.bfloat16`` ...) to a torch dtype.

    Raises :class:`InvalidInputError` naming ``argument`` for an unknown spelling.
    """
    if isinstance(value, torch.dtype):
        if value in FP8_DTYPES or value in FLOAT_DTYPES:
            return value
        raise InvalidInputError(argument, f"dtype {value} is not a supported float or fp8 dtype")
    if not isinstance(value, str):
        raise InvalidInputError(argument, f"expected a torch dtype or a name, got {type(value).__name__}")
    key = value.lower()
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    known = ", ".join(sorted(_DTYPE_ALIASES))
    raise InvalidInputError(argument, f"unknown dtype {value!r}; expected one of: {known}")


def is_fp8(dtype: torch.dtype) -> bool:
    """A per-tensor fp8 dtype (an ``fp8_ds_mla`` cache is not: its scales are per tile)."""
    return dtype in FP8_DTYPES


def is_ds_mla(dtype: torch.dtype) -> bool:
    """The storage dtype of an ``fp8_ds_mla`` cache."""
    return dtype == DS_MLA_DTYPE


def dtype_name(dtype: torch.dtype) -> str:
    """Short readable name used in reasons and tables (``bfloat16``, ``float8_e4m3fn``,
    ``fp8_ds_mla`` for the byte rows of that cache format)."""
    if dtype == DS_MLA_DTYPE:
        return "fp8_ds_mla"
    return str(dtype).removeprefix("torch.")


def ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes per token of an ``fp8_ds_mla`` row: ``L`` e4m3, ``L / 128`` float32 scales, ``R`` bf16."""
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_TILE) + 2 * rope_dim


def _require_int(_inst: object, _attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an int")


_positive = attrs.validators.and_(
    input_validator(attrs.validators.gt(0), "> 0"), input_validator(_require_int, "an int")
)


def _finite_positive(_inst: object, _attribute: attrs.Attribute[float], value: float) -> None:
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if not real or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{value!r} is not a finite float > 0")


SOFTMAX_SCALE_HINT = (
    "pass the model's softmax scale: qk_head_dim**-0.5 (192**-0.5 for DeepSeek-V3's "
    "128 + 64), times YaRN's mscale**2 when the model uses YaRN rope scaling "
    "(mla.deepseek_softmax_scale(qk_head_dim, rope_scaling) computes both); the kernels' "
    "1/sqrt(576) is never right"
)
"""How to compute the softmax scale, for the errors of a missing or bad one."""

_MISSING_SCALE: float = float("nan")
"""``MLADims.softmax_scale``'s default: a private object that only stands for "not given" (the
validator refuses it, naming the argument), so the field stays a ``float``."""


def _required_softmax_scale(_inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value is _MISSING_SCALE:
        raise InvalidInputError(attribute.name, f"is required (there is no default); {SOFTMAX_SCALE_HINT}")
    try:
        _finite_positive(_inst, attribute, value)
    except ValueError:
        raise InvalidInputError(
            attribute.name, f"must be a finite float > 0, got {value!r}; {SOFTMAX_SCALE_HINT}"
        ) from None


_softmax_scale = attrs.validators.optional(
    input_validator(_finite_positive, "a finite float > 0 (or None for head_dim ** -0.5)")
)


@attrs.frozen
class MLADims:
    """Head geometry of one MLA layer on one rank.

    Decode runs in the absorbed form: q and cache rows are ``kv_lora_rank + qk_rope_head_dim``
    wide, the output ``kv_lora_rank`` wide. Prefill runs in MHA form: q/k are
    ``qk_nope_head_dim + qk_rope_head_dim`` wide, v is ``v_head_dim`` wide.
    """

    num_heads: int = attrs.field(validator=_positive)
    """Query heads on this rank (128 / TP for DeepSeek-V3)."""
    kv_lora_rank: int = attrs.field(default=512, validator=_positive)
    qk_rope_head_dim: int = attrs.field(default=64, validator=_positive)
    qk_nope_head_dim: int = attrs.field(default=128, validator=_positive)
    v_head_dim: int = attrs.field(default=128, validator=_positive)
    softmax_scale: float = attrs.field(default=_MISSING_SCALE, validator=_required_softmax_scale)
    """The model's softmax scale, required (a finite float > 0; no default): ``qk_head_dim **
    -0.5`` times YaRN's ``mscale ** 2`` when the model scales its rope with YaRN (DeepSeek-V3),
    as :func:`mla.deepseek_softmax_scale` computes it; never the kernels' ``1/sqrt(576)``.
    Leaving it out raises :class:`InvalidInputError` naming ``softmax_scale``."""
    index_topk: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive), kw_only=True
    )
    """Tokens the model's indexer keeps per query row (DeepSeek Sparse Attention: 2048 for
    DeepSeek-V3.2 and GLM-5); ``None`` for a dense MLA model. A sparse model resolves only the
    sparse strategies (:mod:`mla.sparse`)."""

    @property
    def is_sparse(self) -> bool:
        return self.index_topk is not None

    @property
    def latent_dim(self) -> int:
        """Width of a cache row and of the decode query (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Prefill q/k head dim (192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """:attr:`softmax_scale` (the name the strategies read)."""
        return self.softmax_scale


def _kv_cache_dtype(value: torch.dtype | str) -> torch.dtype:
    if value == DS_MLA_DTYPE or (isinstance(value, str) and value.lower() == "fp8_ds_mla"):
        return DS_MLA_DTYPE
    return normalize_dtype(value, argument="kv_cache_dtype")


@attrs.frozen
class KVCacheSpec:
    """Paged latent cache: ``[num_blocks, block_size, kv_lora_rank + rope]`` of ``dtype``.

    ``dtype`` accepts engine spellings (``"auto"`` is not one: pass the model dtype), and
    ``"fp8_ds_mla"``: then the cache is ``[num_blocks, block_size, 656]`` bytes
    (:data:`DS_MLA_DTYPE`, per-tile scales; sparse strategies read it).
    """

    block_size: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(
        default=torch.bfloat16,
        converter=_kv_cache_dtype,
    )
    num_blocks: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    """Blocks in the cache, when known: block ids are then range-checked at build time under
    ``validate="full"``, and a run refuses a ``kv_cache`` with fewer blocks."""

    @property
    def is_fp8(self) -> bool:
        """A per-tensor fp8 cache (read with ``kv_scale``)."""
        return is_fp8(self.dtype)

    @property
    def is_ds_mla(self) -> bool:
        return is_ds_mla(self.dtype)

    def row_width(self, dims: MLADims) -> int:
        """Elements per token of the cache tensor's last dim (bytes for ``fp8_ds_mla``)."""
        if self.is_ds_mla:
            return ds_mla_row_bytes(dims.kv_lora_rank, dims.qk_rope_head_dim)
        return dims.latent_dim


def _index_key_dtype(value: torch.dtype | str) -> torch.dtype:
    dtype = normalize_dtype(value, argument="key_dtype")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        raise InvalidInputError(
            "key_dtype", f"index keys are stored in bf16, fp16, fp32 or fp8 (e4m3), got {dtype_name(dtype)}"
        )
    return dtype


@attrs.frozen
class IndexerSpec:
    """The lightning indexer of a DeepSeek Sparse Attention layer and its paged key cache.

    The index-key cache shares the latent cache's block table and block size: it is
    ``[num_blocks, block_size, head_dim]`` of ``key_dtype`` for a float dtype, or, for fp8,
    ``[num_blocks, block_size, head_dim + 4]`` bytes laid out per block as every token's
    ``head_dim`` e4m3 values followed by every token's float32 scale (132 bytes per token at
    ``head_dim`` 128, DeepGEMM's paged layout; :mod:`mla.providers.formats`).
    """

    num_heads: int = attrs.field(default=64, validator=_positive)
    """Index heads (64 for DeepSeek-V3.2; not divided by tensor parallelism)."""
    head_dim: int = attrs.field(default=128, validator=_positive)
    key_dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=_index_key_dtype)
    softmax_scale: float | None = attrs.field(default=None, validator=_softmax_scale)
    """Scale inside the ReLU of the score; ``None`` means ``head_dim ** -0.5`` (the model's)."""

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.key_dtype)

    @property
    def row_width(self) -> int:
        """Elements per token of the cache tensor's last dim (bytes for fp8)."""
        return self.head_dim + 4 if self.is_fp8 else self.head_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype (``uint8`` for fp8 keys with their scales)."""
        return torch.uint8 if self.is_fp8 else self.key_dtype


class GraphMode(enum.Enum):
    """How the engine captures decode steps in CUDA graphs."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


def _graph_mode(value: GraphMode | str) -> GraphMode:
    if isinstance(value, GraphMode):
        return value
    try:
        return GraphMode(value)
    except ValueError:
        choices = ", ".join(m.value for m in GraphMode)
        raise InvalidInputError(
            "graph_mode", f"expected a GraphMode or one of {choices}, got {value!r}"
        ) from None


@attrs.frozen
class EngineLimits:
    """Engine-wide maxima that size every persistent buffer at init."""

    max_num_seqs: int = attrs.field(validator=_positive)
    max_model_len: int = attrs.field(validator=_positive)
    max_num_batched_tokens: int = attrs.field(validator=_positive)
    max_decode_qlen: int = attrs.field(default=1, validator=_positive)
    """Largest decode query length the engine sends: speculative tokens + 1."""
    graph_mode: GraphMode = attrs.field(default=GraphMode.NONE, converter=_graph_mode)

    @property
    def max_decode_tokens(self) -> int:
        return self.max_num_seqs * self.max_decode_qlen
