"""What the HF cross-checks of the dense layer (``test_layers_hf``) and of the sparse one
(``test_sparse_hf`` through ``hf_v32``) share: the requests and the steps that serve them, the
hooks that capture an HF attention layer's per-token tensors, and the MLA rows taken from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

import mla

LENGTHS = {"a": 19, "b": 26, "c": 18}
"""Sequence length of each request; HF runs each whole sequence once."""

# (decodes [(request, qlen)], prefills [(request, new tokens)]), decodes first as engines order them.
STEPS: tuple[tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]], ...] = (
    ((), (("a", 12), ("b", 8))),  # prefills without context
    ((("a", 1),), (("b", 12), ("c", 5))),  # decode + prefill with context + prefill without
    ((("a", 3), ("b", 1)), (("c", 7),)),  # verify qlen 3 next to a decode; prefill with context
    ((("a", 2), ("b", 4), ("c", 1)), ()),  # mixed verify step (qlen 2 and 4)
    ((("a", 1), ("b", 1), ("c", 3)), ()),
    ((("c", 2),), ()),
)


YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
"""The YaRN rope parameters of the HF configs (short original context, so the tests' lengths
scale)."""


@attrs.frozen
class Model:
    """One HF config: its layer and the captures of each named sequence (request)."""

    name: str
    config: Any
    attn: Any
    rows: dict[str, dict[str, torch.Tensor]]
    """request -> captured name -> tensor: :func:`mla_rows`' (``q_nope [S,H,n]``, ``q_pe
    [S,H,R]``, ``kv_c [S,L]``, ``k_pe [S,R]``, ``out [S,H,v]``), for V3.2 all of
    :data:`hf_v32.KEYS`."""


def hook_outputs(modules: dict[str, Any], o_proj: Any, seen: dict[str, torch.Tensor]) -> list[Any]:
    """Forward hooks that keep each of ``modules``' outputs in ``seen[name]`` and a pre-hook that
    keeps ``o_proj``'s input (the attention output) in ``seen["o"]``; the handles, to remove."""

    def keep(name: str) -> Any:
        def hook(_module: Any, _args: Any, output: torch.Tensor) -> None:
            seen[name] = output.detach()

        return hook

    def keep_input(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
        seen["o"] = args[0].detach()

    handles = [module.register_forward_hook(keep(name)) for name, module in modules.items()]
    handles.append(o_proj.register_forward_pre_hook(keep_input))
    return handles


def mla_rows(
    config: Any,
    seen: dict[str, torch.Tensor],
    seq: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """One sequence's (``seq`` tokens) MLA rows from the captured ``q``, ``kv_c``, ``kv`` and
    ``o`` (rope applied by ``apply_rope`` on ``[B, H, S, R]`` / ``[B, 1, S, R]``, as HF calls it):
    ``q_nope [S,H,n]``, ``q_pe [S,H,R]``, ``kv_c [S,L]``, ``k_pe [S,R]``, ``out [S,H,v]``."""
    heads, nope, rope_dim = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    q = seen["q"].view(1, seq, heads, nope + rope_dim).transpose(1, 2)
    q_nope, q_rot = q.split([nope, rope_dim], dim=-1)
    k_rot = seen["kv"][..., config.kv_lora_rank :].view(1, 1, seq, rope_dim)
    q_rot, k_rot = apply_rope(q_rot, k_rot, cos, sin)
    return {
        "q_nope": q_nope[0].transpose(0, 1).contiguous(),
        "q_pe": q_rot[0].transpose(0, 1).contiguous(),
        "kv_c": seen["kv_c"][0].contiguous(),
        "k_pe": k_rot[0, 0].contiguous(),
        "out": seen["o"][0].view(seq, heads, config.v_head_dim),
    }


def grow_slots(blocks: list[int], free: list[int], block_size: int, start: int, count: int) -> list[int]:
    """The cache slots of positions ``start .. start + count - 1`` of a request that holds
    ``blocks``, taking blocks from the end of ``free`` as it grows."""
    while len(blocks) * block_size < start + count:
        blocks.append(free.pop())
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


def step_inputs(
    picks: list[tuple[str, int, int]], blocks: dict[str, list[int]], num_decodes: int
) -> mla.StepInputs:
    """The engine step of ``picks`` (``(request, start, count)`` rows, the first ``num_decodes``
    decodes) over each request's ``blocks`` (the table zero-padded to the longest)."""
    qsl = [0]
    for _, _, count in picks:
        qsl.append(qsl[-1] + count)
    width = max(len(blocks[n]) for n, _, _ in picks)
    table = [blocks[n] + [0] * (width - len(blocks[n])) for n, _, _ in picks]
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor([start + count for _, start, count in picks], dtype=torch.int32)
    return mla.StepInputs(
        query_start_loc_cpu=qsl_t,
        query_start_loc=qsl_t,
        seq_lens=seq_t,
        seq_lens_cpu=seq_t,
        block_table=torch.tensor(table, dtype=torch.int32),
        num_decodes=num_decodes,
        num_decode_tokens=sum(count for _, _, count in picks[:num_decodes]),
    )
