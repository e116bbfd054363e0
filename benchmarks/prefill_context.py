"""The chunked-context prefill step against the same attention without context.

An engine prefills new tokens of requests whose earlier tokens sit in the paged latent cache:
``FlashVarlen`` attends the new tokens causally, then each context chunk (gathered from the
cache and up-projected by the engine's callback, here to ``k_nope``/``v`` views of one matmul
output, the rope lanes read from the latent) non-causally, merging it into the running result
by LSE in the attention's epilogue (on providers whose varlen kernel takes those operands).
Its peer is one varlen attention over the same pairs: each request's new queries against its
context and new keys as one key range (bottom-right causal), so both rows count the same FLOPs
and the ratio says what the chunking costs.

Rows (``time_us``: the median over ``rounds`` of the timer's result, the four timed in turn each
round, so that the step and its peer meet the same clocks: the GPU's power cap lowers them over a
run; TFLOP/s of the attention FLOPs):

* ``chunked-context step``: ``builder.build`` once, then ``impl.forward_prefill`` timed (the
  engine path: gather, the up-projection callback, the attention passes);
* ``latent gather alone``: the provider's gather of every context chunk
  (``KernelProvider.gather_context``), the step's own work before the callback;
* ``up-projection alone``: the callback on every context token once (a bf16 matmul standing in
  for the model's ``kv_b_proj``): how much of the step is the engine's own work;
* ``attention without context``: the provider's varlen attention over the whole key ranges.

Before timing, the step's output is compared with the torch reference (float32 math on the same
inputs and the same up-projection).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

import mla
from benchmarks._common import attention_flops, interleaved_medians
from mla.prefill.flash_varlen import gather_context
from mla.providers.calls import VarlenPrefillCall
from mla.testing import PrefillCase, make_prefill_inputs, prefill_case_backend
from mla.tools.reference import reference_prefill

Timer = Callable[[Callable[[], Any]], float]


@attrs.frozen
class ContextShape:
    heads: int
    batch: int
    new_tokens: int
    cached_tokens: int

    @property
    def name(self) -> str:
        return f"H={self.heads} {self.batch}x({self.new_tokens} new + {self.cached_tokens} cached)"


SHAPE = ContextShape(16, 4, 2048, 16384)
QUICK_SHAPE = ContextShape(16, 2, 256, 1024)


class Bf16UpProjection:
    """Latent rows ``[n, L+R]`` to ``k_nope [n, H, nope]`` and ``v [n, H, Dv]`` with one bf16
    matmul, as a model's ``kv_b_proj`` does: both strided views of its output, no copies
    (``expand_context``'s k_nope form: the step reads the rope lanes, shared by every head,
    from the latent rows)."""

    def __init__(self, w_k: torch.Tensor, w_v: torch.Tensor, kv_lora_rank: int) -> None:
        self.heads, self.nope, self.v_dim = w_k.shape[1], w_k.shape[2], w_v.shape[2]
        self.rank = kv_lora_rank
        self.weight = torch.cat([w_k, w_v], dim=-1).reshape(kv_lora_rank, -1).to(torch.bfloat16)

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = latent.shape[0]
        kv = (latent[:, : self.rank] @ self.weight).view(n, self.heads, -1)
        return kv[..., : self.nope], kv[..., self.nope :]


def context_rows(
    shape: ContextShape, *, timer: Timer, device: str = "cuda", provider: str = "auto", rounds: int = 5
) -> tuple[list[dict[str, Any]], float]:
    """The four rows for ``shape`` and the step's relative output error (checked first); each
    row's time the median of ``rounds`` interleaved rounds."""
    case = PrefillCase(
        heads=shape.heads,
        q_lens=(shape.new_tokens,) * shape.batch,
        context_lens=(shape.cached_tokens,) * shape.batch,
        block_size=64,
        dtype=torch.bfloat16 if device == "cuda" else torch.float32,
    )
    inputs = make_prefill_inputs(case, device)
    platform = mla.detect_platform(device)
    backend = prefill_case_backend(
        case, provider=provider, platform=platform, device=device,
        num_blocks=inputs.context.kv_cache.shape[0],
    )  # fmt: skip
    expand = Bf16UpProjection(inputs.context.expand.w_k, inputs.context.expand.w_v, case.kv_lora_rank)
    if device != "cuda":
        expand = inputs.context.expand  # type: ignore[assignment]  # float32 math on the CPU
    metadata = backend.builder.build(inputs.step())
    out, lse = inputs.poisoned_outputs()

    def step() -> None:
        backend.impl.forward_prefill(
            metadata, inputs.q, inputs.k, inputs.v, out=out, lse=lse,
            kv_cache=inputs.context.kv_cache, kv_scale=None, expand_context=expand,
        )  # fmt: skip

    # The peer: one key range per request (its context's k/v, then its new tokens').
    context_kv = inputs.context_kv(expand)
    keys = shape.cached_tokens + shape.new_tokens
    news = inputs.k.split(shape.new_tokens), inputs.v.split(shape.new_tokens)
    k_all = torch.cat([t for (ck, _), nk in zip(context_kv, news[0], strict=True) for t in (ck, nk)])
    v_all = torch.cat([t for (_, cv), nv in zip(context_kv, news[1], strict=True) for t in (cv, nv)])
    cu_q = (torch.arange(shape.batch + 1) * shape.new_tokens).to(torch.int32).to(device)
    cu_k = (torch.arange(shape.batch + 1) * keys).to(torch.int32).to(device)
    peer_out, peer_lse = torch.empty_like(out), torch.empty_like(lse)
    peer = VarlenPrefillCall(
        q=inputs.q, k=k_all, v=v_all, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=peer_out, lse=peer_lse,
        max_seqlen_q=shape.new_tokens, max_seqlen_k=keys, softmax_scale=case.scale, causal=True,
    )  # fmt: skip
    kernel_provider = backend.provider

    step()
    # Checked on the first and last head (a float64 reference of every head is minutes of CPU).
    heads = sorted({0, shape.heads - 1})
    ref_out, _ = reference_prefill(
        inputs.q[:, heads], k_all[:, heads], v_all[:, heads], cu_q, cu_k, softmax_scale=case.scale
    )
    got = out[:, heads].double().cpu()
    error = float((got - ref_out).norm() / ref_out.norm())
    flops = attention_flops(
        [shape.new_tokens] * shape.batch, [keys] * shape.batch,
        h=shape.heads, d_qk=case.qk_dim, d_v=case.v_dim, causal=True,
    )  # fmt: skip
    latents = inputs.context_latents()
    assert metadata.prefill is not None
    chunks = metadata.prefill.context_chunks
    cache = inputs.context.kv_cache
    flat = cache.view(-1, cache.shape[-1])

    def gather() -> None:
        for chunk in chunks:
            gather_context(kernel_provider, chunk, flat, None, inputs.q.dtype)

    timed_fns: dict[str, Callable[[], Any]] = {
        "chunked-context step": step,
        "latent gather alone": gather,
        "up-projection alone": lambda: [expand(latent) for latent in latents],
        "attention without context": lambda: kernel_provider.varlen_attention(peer),
    }
    timed = interleaved_medians(timed_fns, timer=timer, rounds=rounds)
    parts = ("latent gather alone", "up-projection alone")
    rows = [
        {
            "shape": shape.name, "impl": name, "time_us": us,
            "TFLOP/s": float("nan") if name in parts else flops / (us * 1e-6) / 1e12,
            "x without context": (
                timed["attention without context"] / us if name == "chunked-context step" else float("nan")
            ),
        }
        for name, us in timed.items()
    ]  # fmt: skip
    return rows, error
