"""vLLM's Triton MLA decode (``triton_decode_attention.py``), called as vLLM's TRITON_MLA backend
calls it, for side-by-side timing. The file is not part of this repository: pass its path with
``--vllm-decode`` (a local copy of vllm/v1/attention/ops/triton_decode_attention.py, or of the
older vllm/attention/ops/triton_decode_attention.py; a file importing ``vllm.platforms`` needs
that import replaced by ``is_hip_ = False`` to load without vLLM).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from types import ModuleType

import torch


def load(path: str) -> ModuleType:
    """Import the file at ``path`` as a module (it needs only torch and triton)."""
    spec = importlib.util.spec_from_file_location("vllm_triton_decode_attention", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_fn(
    module: ModuleType,
    *,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
) -> Callable[[], None]:
    """One qlen-1 decode step as ``TritonMLAImpl.forward_mqa`` runs it: q ``[B, H, 576]``, cache
    ``[num_blocks, page, 576]`` (bf16), ``block_table [B, pages]`` page ids, out ``[B, H, 512]``.
    Split count: 4, the fixed ``num_kv_splits`` of vLLM's ``TritonMLAImpl`` (a batch-size
    heuristic seen in some vLLM versions gives hundreds of splits here and runs 5x slower)."""
    batch, heads, _ = q.shape
    rank = out.shape[-1]
    k_buffer = cache.unsqueeze(2)
    v_buffer = k_buffer[..., :rank]
    splits = 4
    logits = torch.empty(batch, heads, splits, rank + 1, dtype=torch.float32, device=q.device)
    lse = torch.zeros(batch, heads, dtype=q.dtype, device=q.device)

    # vLLM's signature changed over time: older files take no ``lse`` (between ``o`` and the
    # block table), newer ones may take ``is_mla``; call whichever this file has.
    params = inspect.signature(module.decode_attention_fwd).parameters
    head = (q, k_buffer, v_buffer, out, lse) if "lse" in params else (q, k_buffer, v_buffer, out)
    extra = {"is_mla": True} if "is_mla" in params else {}

    def run() -> None:
        module.decode_attention_fwd(
            *head, block_table, seq_lens, logits, splits, softmax_scale, cache.shape[1], **extra
        )

    return run
