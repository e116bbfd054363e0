"""mla: interchangeable attention strategies for Multi-head Latent Attention.

``import mla`` never imports a kernel library; providers import theirs on first use.
"""

from mla.core.capabilities import REFERENCE_CAPABILITIES, Contract, ProviderCapabilities
from mla.core.config import EngineLimits, GraphMode, IndexerSpec, KVCacheSpec, MLADims
from mla.core.context import DecodeContext, PrefillContext, decode_context, prefill_context
from mla.core.errors import (
    InvalidInputError,
    MLAError,
    PlanMismatchError,
    ProviderUnavailableError,
    UnsupportedError,
)
from mla.core.explain import Candidate, Explanation
from mla.core.platform import Knobs, Platform, detect_platform, simulated_platform
from mla.core.support import Reason, Support
from mla.decode.asm_non_persistent import AsmNonPersistent
from mla.decode.asm_padded_persistent import PaddedAsmPersistent
from mla.decode.base import DecodeBatch, DecodePlan, DecodeStrategy
from mla.decode.gluon import GluonDecode
from mla.decode.gluon_verify_flatten import GluonVerifyFlatten
from mla.distributed import DCPLayout, DCPMetadata, DecodeContextParallel
from mla.engine.backend import AttentionImpl, MetadataBuilder, MLABackend, MLAMetadata, StepInputs, ops
from mla.engine.backend.ops import ContextExpanderHandle, register_context_expander
from mla.engine.decision.registry import DEFAULT_REGISTRY, Registry, override, register
from mla.engine.decision.resolver import Decision, Resolver
from mla.engine.functional import mla_decode, mla_prefill, write_kv
from mla.layers import MLAAttention, deepseek_softmax_scale, yarn_mscale
from mla.prefill.base import PrefillBatch, PrefillPlan, PrefillStrategy
from mla.prefill.flash_varlen import FlashVarlen
from mla.prefill.fp8_persistent import Fp8PersistentPrefill
from mla.providers import KernelProvider, TorchProvider, get_provider, provider_names
from mla.providers.aiter.capabilities import aiter_capabilities
from mla.sparse import IndexerStrategy, LightningIndexer, SparseDecode, SparsePrefill, SparseStrategy
from mla.strategy import GraphSupport, Phase, StrategyKind, StrategySetup

__version__ = "0.1.0"

DECODE_STRATEGIES = (GluonDecode, GluonVerifyFlatten, PaddedAsmPersistent, AsmNonPersistent)
"""The built-in decode strategies in their default priority order."""
PREFILL_STRATEGIES = (Fp8PersistentPrefill, FlashVarlen)
"""The built-in prefill strategies in their default priority order."""
SPARSE_STRATEGIES = (SparseDecode, SparsePrefill)
"""The built-in sparse (DeepSeek Sparse Attention) strategies: decode, then prefill."""

__all__ = [
    "DECODE_STRATEGIES",
    "DEFAULT_REGISTRY",
    "PREFILL_STRATEGIES",
    "REFERENCE_CAPABILITIES",
    "SPARSE_STRATEGIES",
    "AsmNonPersistent",
    "AttentionImpl",
    "Candidate",
    "ContextExpanderHandle",
    "Contract",
    "DCPLayout",
    "DCPMetadata",
    "Decision",
    "DecodeBatch",
    "DecodeContext",
    "DecodeContextParallel",
    "DecodePlan",
    "DecodeStrategy",
    "EngineLimits",
    "Explanation",
    "FlashVarlen",
    "Fp8PersistentPrefill",
    "GluonDecode",
    "GluonVerifyFlatten",
    "GraphMode",
    "GraphSupport",
    "IndexerSpec",
    "IndexerStrategy",
    "InvalidInputError",
    "KVCacheSpec",
    "KernelProvider",
    "Knobs",
    "LightningIndexer",
    "MLAAttention",
    "MLABackend",
    "MLADims",
    "MLAError",
    "MLAMetadata",
    "MetadataBuilder",
    "PaddedAsmPersistent",
    "Phase",
    "PlanMismatchError",
    "Platform",
    "PrefillBatch",
    "PrefillContext",
    "PrefillPlan",
    "PrefillStrategy",
    "ProviderCapabilities",
    "ProviderUnavailableError",
    "Reason",
    "Registry",
    "Resolver",
    "SparseDecode",
    "SparsePrefill",
    "SparseStrategy",
    "StepInputs",
    "StrategyKind",
    "StrategySetup",
    "Support",
    "TorchProvider",
    "UnsupportedError",
    "__version__",
    "aiter_capabilities",
    "decode_context",
    "deepseek_softmax_scale",
    "detect_platform",
    "get_provider",
    "mla_decode",
    "mla_prefill",
    "ops",
    "override",
    "prefill_context",
    "provider_names",
    "register",
    "register_context_expander",
    "simulated_platform",
    "write_kv",
    "yarn_mscale",
]
