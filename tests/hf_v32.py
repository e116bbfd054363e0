"""Capture harness for Hugging Face transformers' ``DeepseekV32Attention`` (DeepSeek Sparse Attention).

HF's layer runs one whole sequence ``[S, hidden]`` once in float32 (eager attention, the causal
float mask of ``test_layers_hf.py``). Forward hooks capture what an engine would hand
``mla.MLAAttention`` per token, and HF's own rope functions rotate the pre-rope captures with
HF's cos/sin:

* MLA: ``q_b_proj`` (split into nope/rope), ``kv_a_proj_with_mqa`` (its rope slice), the
  ``kv_a_layernorm`` output, and ``o_proj``'s input (the attention output ``out``). HF V3.2
  always rotates MLA's rope dims *interleaved* (``apply_rotary_pos_emb_interleave``, which
  leaves them de-interleaved: evens then odds; q and k alike, so dot products are unchanged).
* Indexer: ``wq_b`` (index q), ``k_norm`` (index k, after the LayerNorm), ``weights_proj``
  and the indexer's returned top-k. The indexer rotates the first ``qk_rope_head_dim`` dims of
  its q/k with the *non-interleaved* (half-split) rope; its weights are
  ``weights_proj(x).float() * index_n_heads ** -0.5``.

HF's semantics the captures reproduce (checked by ``test_hf_v32_harness.py``):

* ``score[t, p] = sum_h w[t, h] * relu(Di ** -0.5 * q[t, h] . k[p])``, plus the causal mask
  (``-inf`` past ``t``);
* ``topk = min(index_topk, S)`` indices of the highest scores, so a row ``t < index_topk - 1``
  also holds ``index_topk - t - 1`` causally masked positions (its ``-inf`` scores, in an
  arbitrary order);
* attention sees (selected ∩ causal): unselected keys get ``finfo.min``, masked ones keep
  ``-inf``.

With 4 index heads about 1 position in 16 scores exactly 0 (every head's ReLU clipped), so
plain random sequences tie at selection boundaries; :func:`sample_hidden` draws tie-free ones.

Used by ``test_hf_v32_harness.py`` (the harness against HF itself) and ``test_sparse_hf.py``
(``mla``'s sparse layer against HF).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_common import YARN, Model, hook_outputs, mla_rows
from torch.overrides import TorchFunctionMode

transformers = pytest.importorskip(
    "transformers", reason="the HF cross-check needs transformers (pip install -e '.[test]')"
)
hf = pytest.importorskip(
    "transformers.models.deepseek_v32.modeling_deepseek_v32",
    reason="this transformers has no DeepSeek-V3.2 model",
)

KEYS = (
    "q_nope",
    "q_pe",
    "kv_c",
    "k_pe",
    "index_q",
    "index_k",
    "index_weights",
    "topk",
    "index_scores",
    "out",
)
"""What :func:`capture` returns per sequence of ``S`` tokens: ``q_nope [S,H,n]``, ``q_pe [S,H,R]``
(after rope), ``kv_c [S,L]`` (after ``kv_a_layernorm``), ``k_pe [S,R]`` (after rope),
``index_q [S,Hi,Di]`` (after the indexer's rope), ``index_k [S,Di]`` (after ``k_norm`` and
rope), ``index_weights [S,Hi]`` float32 (as the indexer scores with them), ``topk [S,K]`` int32
(HF's indices, ``K = min(index_topk, S)``), ``index_scores [S,S]`` float32 (HF's own, the
tensor its indexer runs ``topk`` on, recorded with a ``TorchFunctionMode``: ``-inf`` where
causally masked) and ``out [S,H,v]`` (``o_proj``'s input)."""


CONFIGS: dict[str, dict[str, Any]] = {
    "rope16": {"rope": {"rope_type": "default"}, "qk_rope_head_dim": 16, "index_head_dim": 32},
    # The indexer's rope covers its whole head (no pass-through dims).
    "yarn-rope32": {"rope": YARN, "qk_rope_head_dim": 32, "index_head_dim": 32},
    # mscale != mscale_all_dim: YaRN scales cos/sin (MLA's rope and the indexer's alike).
    "yarn-mscale-differs": {
        "rope": {
            **YARN,
            "factor": 8.0,
            "original_max_position_embeddings": 8,
            "mscale": 0.707,
            "mscale_all_dim": 0.5,
        },
        "qk_rope_head_dim": 16,
        "index_head_dim": 48,
    },
}
"""Tiny float32 DeepSeek-V3.2 attention configs by name (keyword arguments of :func:`hf_config`)."""

MARGIN = 0.05
"""Smallest :func:`relative_gaps` of the sampled sequences' index scores: the selection is
unique (tie-free), and rounding the index keys to bf16 or fp8 keeps all of it in practice
(on plain random sequences of this size fp8 keys keep only about 98.5-99.5% of HF's selection,
and exact zero-score ties make the float32 set ambiguous)."""
_CANDIDATES = 16
_MAX_DRAWS = 64


def hf_config(
    rope: dict[str, Any],
    *,
    qk_rope_head_dim: int = 16,
    index_head_dim: int = 32,
    index_topk: int = 8,
    index_n_heads: int = 4,
) -> Any:
    """A tiny DeepSeek-V3.2 config (4 heads, latent 128, nope 16, v 24, q_lora_rank 24) in
    float32 with eager attention."""
    config = transformers.DeepseekV32Config(
        vocab_size=32,
        hidden_size=48,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=128,  # fp8_ds_mla stores the latent in 128-wide tiles
        q_lora_rank=24,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=16,
        v_head_dim=24,
        max_position_embeddings=64,
        index_topk=index_topk,
        index_n_heads=index_n_heads,
        index_head_dim=index_head_dim,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )
    config._attn_implementation = "eager"
    return config


def rope_parameters(config: Any) -> dict[str, Any]:
    return dict(getattr(config, "rope_parameters", None) or {})


def make_attention(config: Any, seed: int) -> Any:
    """HF's layer with seeded random weights, norms included (their affine parameters would
    otherwise be ones and zeros, and a capture taken before a norm would go unnoticed)."""
    torch.manual_seed(seed)
    attn = hf.DeepseekV32Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for norm in (attn.q_a_layernorm, attn.kv_a_layernorm, attn.indexer.k_norm):
            norm.weight.uniform_(0.5, 1.5)
        attn.indexer.k_norm.bias.uniform_(-0.3, 0.3)
    return attn


def causal_mask(seq: int) -> torch.Tensor:
    """``[1, 1, S, S]`` float: 0 where visible, ``-inf`` past the row (as the dense test)."""
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


def index_scores(
    index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """The indexer's float32 scores ``[S, S]`` with HF's ops, shapes and order: ``-inf`` where
    causally masked."""
    seq = index_q.shape[0]
    q, k = index_q[None], index_k[None]  # [1, S, Hi, Di], [1, S, Di]
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale)
    summed = torch.matmul(weights[None].unsqueeze(-2), scores).squeeze(-2)
    return (summed + causal_mask(seq)[:, 0])[0]


def _index_rope(
    config: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's rope as HF applies it: half-split (``apply_rotary_pos_emb``) on the first
    ``qk_rope_head_dim`` dims of ``q [B, S, Hi, Di]`` and ``k [B, S, 1, Di]``."""
    rope_dim, index_dim = config.qk_rope_head_dim, config.index_head_dim
    q_rot, q_pass = q.split([rope_dim, index_dim - rope_dim], dim=-1)
    k_rot, k_pass = k.split([rope_dim, index_dim - rope_dim], dim=-1)
    q_rot, k_rot = hf.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


class _TopkInputs(TorchFunctionMode):
    """Records the tensor every ``topk`` runs on (in HF's layer: the indexer's masked scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.topk, torch.topk):
            self.inputs.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


def capture(config: Any, attn: Any, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run HF's layer on one sequence ``[S, hidden]``; return the :data:`KEYS` tensors."""
    seen: dict[str, torch.Tensor] = {}
    indexer = attn.indexer
    hooks = {
        "q": attn.q_b_proj,
        "kv_c": attn.kv_a_layernorm,
        "kv": attn.kv_a_proj_with_mqa,
        "index_q": indexer.wq_b,
        "index_k": indexer.k_norm,
        "index_w": indexer.weights_proj,
        "topk": indexer,
    }
    handles = hook_outputs(hooks, attn.o_proj, seen)
    seq = hidden.shape[0]
    rotary = hf.DeepseekV32RotaryEmbedding(config=config)
    cos, sin = rotary(hidden[None], torch.arange(seq)[None])
    try:
        with torch.no_grad(), _TopkInputs() as topk_inputs:
            attn(hidden[None], (cos, sin), causal_mask(seq))
    finally:
        for handle in handles:
            handle.remove()
    assert len(topk_inputs.inputs) == 1, "HF's layer should run topk once (the indexer's)"
    # MLA: interleaved rope on [B, H, S, R] / [B, 1, S, R] (unsqueeze_dim 1, as HF calls it).
    rows = mla_rows(config, seen, seq, cos, sin, hf.apply_rotary_pos_emb_interleave)
    index_heads, index_dim = indexer.n_heads, indexer.head_dim
    index_q, index_k = _index_rope(
        config, seen["index_q"].view(1, seq, index_heads, index_dim), seen["index_k"].unsqueeze(2), cos, sin
    )
    return {
        **rows,
        "index_q": index_q[0].contiguous(),
        "index_k": index_k[0, :, 0].contiguous(),
        "index_weights": (seen["index_w"].float() * index_heads**-0.5)[0].contiguous(),
        "topk": seen["topk"][0].contiguous(),
        "index_scores": topk_inputs.inputs[0][0],
    }


def relative_gaps(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row of ``scores [M, N]`` (``-inf`` where masked), the gap between its ``topk``-th and
    next visible score over the row's largest ``|score|``: ``inf`` when the row sees at most
    ``topk`` positions (its selection is all of them). 0 is a tie at the selection boundary (the
    selected set is not unique); a small gap is one that a rounding of the keys may flip."""
    gaps = torch.full((scores.shape[0],), float("inf"))
    if scores.shape[-1] <= topk:
        return gaps
    finite = torch.isfinite(scores)
    top = scores.topk(topk + 1, dim=-1).values
    amax = torch.where(finite, scores.abs(), 0.0).amax(dim=-1)
    cut = finite.sum(dim=-1) > topk
    gaps[cut] = (top[cut, topk - 1] - top[cut, topk]) / amax[cut]
    return gaps


def sample_hidden(
    config: Any, attn: Any, length: int, generator: torch.Generator, *, margin: float = MARGIN
) -> torch.Tensor:
    """Standard-normal hidden states ``[length, hidden]`` drawn token by token, each redrawn
    until its row of index scores has a :func:`relative_gaps` of at least ``margin``.

    Causality makes this possible one token at a time: token ``t``'s key only enters rows
    ``>= t``, and row ``t``'s scores depend on tokens ``0..t`` alone. The draw computes index
    q/k/weights with HF's submodules and rope; :func:`capture` then takes the real ones from
    HF's forward (the harness tests check the margin on those).
    """
    indexer = attn.indexer
    heads, index_dim, topk = indexer.n_heads, indexer.head_dim, config.index_topk
    rotary = hf.DeepseekV32RotaryEmbedding(config=config)
    accepted: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    with torch.no_grad():
        for position in range(length):
            for _ in range(_MAX_DRAWS):
                candidates = torch.randn(_CANDIDATES, config.hidden_size, generator=generator)
                cos, sin = rotary(candidates[None], torch.full((1, _CANDIDATES), position))
                q = indexer.wq_b(attn.q_a_layernorm(attn.q_a_proj(candidates)))
                k = indexer.k_norm(indexer.wk(candidates))
                q, k = _index_rope(
                    config, q.view(1, _CANDIDATES, heads, index_dim), k[None, :, None], cos, sin
                )
                q, k = q[0], k[0, :, 0]
                weights = indexer.weights_proj(candidates).float() * heads**-0.5
                # Each candidate's row: the accepted keys, then its own.
                prefix = torch.stack(keys) if keys else k.new_empty(0, index_dim)
                row_keys = torch.cat([prefix[None].expand(_CANDIDATES, -1, -1), k[:, None]], dim=1)
                logits = torch.relu(torch.einsum("chd,cpd->chp", q, row_keys) * indexer.softmax_scale)
                scores = torch.einsum("ch,chp->cp", weights, logits)
                good = (relative_gaps(scores, topk) >= margin).nonzero()
                if good.numel():
                    pick = int(good[0, 0])
                    accepted.append(candidates[pick])
                    keys.append(k[pick])
                    break
            else:
                raise AssertionError(f"no draw gives row {position} a score gap of {margin}")
    return torch.stack(accepted)


def visible_sets(indices: torch.Tensor, last: torch.Tensor | list[int]) -> list[set[int]]:
    """Per row, the request-local positions of ``indices [M, K]`` that the row may see
    (``0 <= p <= last[m]``; ``-1`` pads and causally masked positions dropped)."""
    return [
        {p for p in row if 0 <= p <= int(limit)} for row, limit in zip(indices.tolist(), last, strict=True)
    ]


def pad_masked(indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's ``indices [M, K]`` of the rows at ``positions [M]`` with the causally masked picks
    (``> position``: HF's top-k over ``-inf`` scores) replaced by ``-1``, int32: the
    request-local form an engine passes (a position a row may not see is invalid input there)."""
    masked = indices.long() > positions.long()[:, None]
    return torch.where(masked, -1, indices.long()).to(torch.int32)


def attend_selected(
    attn: Any, rows: dict[str, torch.Tensor], selected: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """HF's ``out`` recomputed in MHA form for the query rows at ``positions [M]`` (default:
    all ``S``): keys and values from ``kv_b_proj(kv_c)`` and ``k_pe`` of the whole sequence, row
    ``m`` attending the positions in ``selected [M, K]`` (``-1`` pads) that are ``<=
    positions[m]``. Returns ``[M, H, v]``."""
    seq, heads = rows["q_nope"].shape[:2]
    positions = torch.arange(seq) if positions is None else positions.long()
    nope, v_dim = attn.qk_nope_head_dim, attn.v_head_dim
    with torch.no_grad():
        kv = attn.kv_b_proj(rows["kv_c"]).view(seq, heads, nope + v_dim)
    k_nope, value = kv.split([nope, v_dim], dim=-1)
    logits = torch.einsum("thd,phd->htp", rows["q_nope"][positions], k_nope)
    logits = logits + torch.einsum("thr,pr->htp", rows["q_pe"][positions], rows["k_pe"])
    picks = selected.long()
    allowed = torch.zeros(len(positions), seq + 1, dtype=torch.bool)
    allowed.scatter_(1, torch.where(picks >= 0, picks, seq), True)
    allowed = allowed[:, :seq] & (torch.arange(seq)[None] <= positions[:, None])
    probs = torch.softmax((logits * attn.scaling).masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("htp,phv->thv", probs, value)


def build_model(name: str, lengths: dict[str, int], *, seed: int = 7, margin: float = MARGIN) -> Model:
    """The :data:`CONFIGS` entry ``name``, its seeded layer and one capture per ``lengths`` entry
    (hidden states from :func:`sample_hidden`, so the index scores are tie-free)."""
    config = hf_config(**CONFIGS[name])
    attn = make_attention(config, seed)
    generator = torch.Generator().manual_seed(seed)
    rows = {
        request: capture(config, attn, sample_hidden(config, attn, length, generator, margin=margin))
        for request, length in lengths.items()
    }
    return Model(name, config, attn, rows)
