"""``MLAAttention``: the attention core of one DeepSeek-style MLA layer over a backend.

The model keeps its projections, norms and rope; this module takes their per-token results and
returns the attention output ready for ``o_proj``. It holds the layer's ``kv_b_proj`` weight and
splits it once into the absorbed ``W_UK`` / ``W_UV`` (as vLLM's MLA layer does after loading),
writes the new latent rows, runs decode in the absorbed MQA form through the backend's impl and
prefill in MHA form, up-projecting cached context with its own ``kv_b_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from mla.core.config import MLADims
from mla.core.errors import InvalidInputError
from mla.core.validate import require_float, require_tensor
from mla.distributed import DCPMetadata, DecodeContextParallel
from mla.engine.backend import MLABackend, MLAMetadata


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def deepseek_softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, object] | None = None) -> float:
    """The softmax scale of a DeepSeek-V2/V3 attention layer.

    ``qk_head_dim ** -0.5`` (``qk_nope_head_dim + qk_rope_head_dim``, 192 for DeepSeek-V3), times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the model's ``rope_scaling`` (a Hugging Face
    config's ``rope_scaling`` or ``rope_parameters``) names a scaled rope type and a non-zero
    ``mscale_all_dim`` (DeepSeek-V3: YaRN, factor 40, ``mscale_all_dim`` 1, so the scale is
    ``192 ** -0.5 * 1.3689 ** 2``). This is how Hugging Face's ``DeepseekV3Attention`` and vLLM
    compute it. The rope's own YaRN factor ``yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim)`` scales cos/sin, so it is already in ``q_pe``/``k_pe``
    and not part of this scale.
    """
    if qk_head_dim <= 0:
        raise InvalidInputError("qk_head_dim", f"must be > 0, got {qk_head_dim}")
    scale = 1.0 / math.sqrt(qk_head_dim)
    if not rope_scaling:
        return scale
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)
    if rope_type in (None, "default") or not mscale_all_dim:
        return scale
    factor = rope_scaling.get("factor")
    if not isinstance(factor, (int, float)) or not isinstance(mscale_all_dim, (int, float)):
        raise InvalidInputError(
            "rope_scaling", f"needs numeric 'factor' and 'mscale_all_dim', got {dict(rope_scaling)}"
        )
    m = yarn_mscale(float(factor), float(mscale_all_dim))
    return scale * m * m


class MLAAttention(nn.Module):
    """Attention of one MLA layer on one tensor-parallel rank.

    Args:
        attention: the :class:`~mla.engine.backend.MLABackend` serving this rank (one per rank, shared
            by every layer with these dims), or a
            :class:`~mla.distributed.DecodeContextParallel` when the KV cache is sharded across
            ranks. Its ``dims`` are this rank's: ``num_heads`` = the model's heads / ``tp_size``
            and ``softmax_scale`` the model's (see :func:`deepseek_softmax_scale`).
        kv_b_proj: the model's ``kv_b_proj`` weight, ``[num_heads * (qk_nope + v), kv_lora_rank]``
            as checkpoints store it (rows head by head, each head's ``qk_nope`` key rows then its
            ``v`` value rows), for all ``num_heads * tp_size`` heads; this rank keeps heads
            ``tp_rank * H .. tp_rank * H + H - 1``. With ``sharded=True`` it is already this
            rank's ``[H * (qk_nope + v), kv_lora_rank]`` slice.

    The weights are kept in the backend's model dtype. After changing ``kv_b_proj`` (e.g. by
    ``load_state_dict``) call :meth:`process_weights_after_loading` to re-split it.
    """

    w_uk_t: torch.Tensor
    w_uv: torch.Tensor

    def __init__(
        self,
        attention: MLABackend | DecodeContextParallel,
        kv_b_proj: torch.Tensor,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        sharded: bool = False,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.dims: MLADims = attention.dims
        self.model_dtype: torch.dtype = attention.model_dtype
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise InvalidInputError("tp_rank", f"must be in [0, tp_size={tp_size}), got {tp_rank}")
        dims = self.dims
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        heads = dims.num_heads * (1 if sharded else tp_size)
        require_tensor("kv_b_proj", kv_b_proj, ndim=2)
        require_float("kv_b_proj", kv_b_proj)
        if tuple(kv_b_proj.shape) != (heads * per_head, dims.kv_lora_rank):
            raise InvalidInputError(
                "kv_b_proj",
                f"expected [{heads} heads * (qk_nope {dims.qk_nope_head_dim} + v {dims.v_head_dim}), "
                f"kv_lora_rank {dims.kv_lora_rank}] = [{heads * per_head}, {dims.kv_lora_rank}], got "
                f"{tuple(kv_b_proj.shape)}; the backend's dims.num_heads ({dims.num_heads}) must be "
                f"the model's heads / tp_size ({tp_size})",
            )
        self.tp_rank, self.tp_size = tp_rank, tp_size
        rows = dims.num_heads * per_head
        start = 0 if sharded else tp_rank * rows
        weight = kv_b_proj.detach()[start : start + rows]
        self.kv_b_proj = nn.Parameter(
            weight.to(device=self.device, dtype=self.model_dtype).contiguous(), requires_grad=False
        )
        self.register_buffer("w_uk_t", torch.empty(0), persistent=False)
        self.register_buffer("w_uv", torch.empty(0), persistent=False)
        self.process_weights_after_loading()

    @property
    def device(self) -> torch.device:
        return self.attention.device

    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into ``w_uk_t`` ``[H, qk_nope, L]`` (absorbs ``q_nope`` into the
        latent space) and ``w_uv`` ``[H, L, v]`` (maps the latent output to ``v``)."""
        dims = self.dims
        weight = self.kv_b_proj.detach().view(
            dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank
        )
        w_uk, w_uv = torch.split(weight, [dims.qk_nope_head_dim, dims.v_head_dim], dim=1)
        self.w_uk_t = w_uk.contiguous()
        self.w_uv = w_uv.transpose(1, 2).contiguous()

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA-form keys and values of latent rows ``[n, L+R]`` (only the first ``L`` lanes are
        read; the up-projection: the backend's ``expand_context`` for cached rows, and the new
        tokens' k/v).

        Returns ``k_nope [n, H, qk_nope]`` (``c @ W_UK^T``) and ``v [n, H, v]`` (``c @ W_UV^T``) in
        the model dtype: strided views of the one ``kv_b_proj`` matmul output, no copies. The
        rope lanes are not repeated per head: ``expand_context`` takes this form and reads them
        from the latent rows it passed (shared by every head); :meth:`whole_keys` assembles
        ``[k_nope | k_pe]`` where whole keys are needed.
        """
        dims = self.dims
        c = latent[:, : dims.kv_lora_rank]
        kv = torch.nn.functional.linear(c.to(self.model_dtype), self.kv_b_proj)
        kv = kv.view(-1, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
        k_nope, v = torch.split(kv, [dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
        return k_nope, v

    def whole_keys(self, k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """``k [n, H, qk_nope + R]``: ``k_nope [n, H, qk_nope]`` and the rope lanes ``k_pe [n, R]``
        shared by every head, contiguous, in the model dtype."""
        dims = self.dims
        k = torch.empty(
            (k_nope.shape[0], dims.num_heads, dims.qk_head_dim), dtype=self.model_dtype, device=k_nope.device
        )
        k[..., : dims.qk_nope_head_dim] = k_nope
        k[..., dims.qk_nope_head_dim :] = k_pe.to(self.model_dtype)[:, None, :]
        return k

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """The absorbed decode query ``[T, H, L+R]``: ``[q_nope @ W_UK | q_pe]`` per head."""
        dims = self.dims
        q = torch.empty(
            (q_nope.shape[0], dims.num_heads, dims.latent_dim), dtype=self.model_dtype, device=q_nope.device
        )
        q_latent = torch.bmm(q_nope.to(self.model_dtype).transpose(0, 1), self.w_uk_t)  # [H, T, L]
        q[..., : dims.kv_lora_rank] = q_latent.transpose(0, 1)
        q[..., dims.kv_lora_rank :] = q_pe
        return q

    def forward(
        self,
        metadata: MLAMetadata | DCPMetadata,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor | None = None,
        kv_scale: float | torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        index_q: torch.Tensor | None = None,
        index_k: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        index_cache: torch.Tensor | None = None,
        topk_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend one step's tokens (decode rows first, as the metadata was built).

        Args:
            metadata: from ``backend.builder.build(step)`` (or ``DecodeContextParallel.build``).
            q_nope: ``[T, H, qk_nope]``; q_pe ``[T, H, R]`` after rope; this rank's heads.
            kv_c_normed: ``[T, L]`` (after ``kv_a_layernorm``); k_pe ``[T, R]`` after rope.
            kv_cache: ``[num_blocks, block_size, L+R]``; this step's rows are written first.
            slot_mapping: int ``[T]`` cache slot of each token (``-1``: padding, not written);
                required with an :class:`~mla.engine.backend.MLAMetadata`, derived by the builder
                under decode context parallelism (must then be ``None``).
            kv_scale: the fp8 cache's per-tensor dequant scale (``None`` for a float cache).
            out: optional ``[T, H, v]`` output in the model dtype.
            index_q, index_k, index_weights, index_cache, topk_indices: a sparse model's
                (DeepSeek Sparse Attention, ``MLADims.index_topk``) indexer inputs, as the model
                computes them: ``index_q [T, Hi, D]`` after the indexer's rope, ``index_k [T, D]``
                after its key norm and rope (written into ``index_cache`` at ``slot_mapping``),
                ``index_weights [T, Hi]`` (e.g. ``weights_proj(x) * Hi ** -0.5``). Pass
                ``topk_indices [T, K]`` (request-local positions, ``-1`` pads) instead of
                ``index_q``/``index_weights`` to reuse another layer's selection; ``index_k`` and
                ``index_cache`` are still written when given. Every row, prefill included, then
                attends only its selected tokens in the absorbed form. Under decode context
                parallelism (decode steps only) the index keys go to this rank's shard and
                ``topk_indices`` are this rank's local positions (``dcp.index_topk``); the row
                attends the union of the ranks' selections.

        Returns ``[T, H, v]`` in the model dtype (graph-padding rows are 0), ready for
        ``o_proj`` after flattening the heads.
        """
        dims = self.dims
        rows = metadata.num_decode_tokens + metadata.num_prefill_tokens
        heads = dims.num_heads
        for name, tensor, shape in (
            ("q_nope", q_nope, (rows, heads, dims.qk_nope_head_dim)),
            ("q_pe", q_pe, (rows, heads, dims.qk_rope_head_dim)),
            ("kv_c_normed", kv_c_normed, (rows, dims.kv_lora_rank)),
            ("k_pe", k_pe, (rows, dims.qk_rope_head_dim)),
        ):
            require_tensor(name, tensor, ndim=len(shape))
            if tuple(tensor.shape) != shape:
                raise InvalidInputError(
                    name, f"expected {list(shape)} (the step's {rows} rows), got {list(tensor.shape)}"
                )
        if out is None:
            out = torch.empty((rows, heads, dims.v_head_dim), dtype=self.model_dtype, device=q_nope.device)
        elif tuple(out.shape) != (rows, heads, dims.v_head_dim) or out.dtype != self.model_dtype:
            raise InvalidInputError(
                "out",
                f"expected [{rows}, {heads}, {dims.v_head_dim}] {self.model_dtype}, got "
                f"{list(out.shape)} {out.dtype}",
            )
        self._write(metadata, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_scale)
        if dims.is_sparse:
            return self._forward_sparse(
                metadata,
                self.absorb_query(q_nope, q_pe),
                kv_cache,
                slot_mapping,
                kv_scale,
                out,
                index=(index_q, index_k, index_weights, index_cache, topk_indices),
            )
        num_decode = metadata.num_decode_tokens
        if metadata.num_decodes:
            q = self.absorb_query(q_nope[:num_decode], q_pe[:num_decode])
            latent_out = torch.empty(
                (num_decode, heads, dims.kv_lora_rank), dtype=self.model_dtype, device=q.device
            )
            if isinstance(metadata, DCPMetadata):
                assert isinstance(self.attention, DecodeContextParallel)
                self.attention.forward_decode(metadata, q, kv_cache, out=latent_out, kv_scale=kv_scale)
            else:
                assert isinstance(self.attention, MLABackend)
                self.attention.impl.forward_decode(metadata, q, kv_cache, out=latent_out, kv_scale=kv_scale)
            out[:num_decode] = torch.bmm(latent_out.transpose(0, 1), self.w_uv).transpose(0, 1)
        if metadata.num_prefills:
            q = torch.cat([q_nope[num_decode:], q_pe[num_decode:]], dim=-1).to(self.model_dtype)
            k_nope, v = self.expand_latent(kv_c_normed[num_decode:])
            # The new tokens' keys whole and v contiguous, as forward_prefill takes them (the
            # cached context's stay views: expand_context's k_nope form).
            k, v = self.whole_keys(k_nope, k_pe[num_decode:]), v.contiguous()
            target = out[num_decode:]
            if isinstance(metadata, DCPMetadata):
                assert isinstance(self.attention, DecodeContextParallel)
                self.attention.forward_prefill(
                    metadata,
                    q,
                    k,
                    v,
                    out=target,
                    kv_cache=kv_cache,
                    kv_scale=kv_scale,
                    expand_context=self.expand_latent,
                )
            else:
                assert isinstance(self.attention, MLABackend)
                self.attention.impl.forward_prefill(
                    metadata,
                    q,
                    k,
                    v,
                    out=target,
                    kv_cache=kv_cache,
                    kv_scale=kv_scale,
                    expand_context=self.expand_latent,
                )
        return out

    def _forward_sparse(
        self,
        metadata: MLAMetadata | DCPMetadata,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        kv_scale: float | torch.Tensor | None,
        out: torch.Tensor,
        *,
        index: tuple[torch.Tensor | None, ...],
    ) -> torch.Tensor:
        """The DeepSeek Sparse Attention step over the written cache: index keys, top-k, then
        every row's sparse attention in the absorbed form, up-projected by ``W_UV``.

        Under decode context parallelism (a decode step; the build refuses sparse prefills) the
        index keys go to this rank's shard, each rank selects over its shard (``topk_indices``
        are then this rank's local positions) and the ranks' sparse states are LSE-combined."""
        index_q, index_k, index_weights, index_cache, topk_indices = index
        if isinstance(metadata, DCPMetadata):
            # _write has checked that the layer is built on DecodeContextParallel.
            dcp = self.attention
            assert isinstance(dcp, DecodeContextParallel)
            if index_k is not None or index_cache is not None:
                if index_k is None or index_cache is None:
                    raise InvalidInputError(
                        "index_k", "index_k and index_cache go together (the keys are written into the cache)"
                    )
                self._check_index_cache(index_cache, kv_cache)
                dcp.write_index_keys(metadata, index_k, index_cache)
            dcp_meta = metadata
            topk_indices = self._topk(
                q.shape[0],
                index_q,
                index_weights,
                index_cache,
                topk_indices,
                q.device,
                lambda iq, w, cache, sel: dcp.index_topk(dcp_meta, iq, w, cache, out=sel),
            )
            dims = self.dims
            latent_out = torch.empty(
                (q.shape[0], dims.num_heads, dims.kv_lora_rank), dtype=q.dtype, device=q.device
            )
            dcp.forward_sparse_decode(metadata, q, kv_cache, topk_indices, out=latent_out, kv_scale=kv_scale)
            out.copy_(torch.bmm(latent_out.transpose(0, 1), self.w_uv).transpose(0, 1))
            return out
        assert isinstance(self.attention, MLABackend)  # _write has checked it
        impl = self.attention.impl
        rows = q.shape[0]
        if index_cache is not None:
            self._check_index_cache(index_cache, kv_cache)
        if index_k is not None or index_cache is not None:
            if index_k is None or index_cache is None or slot_mapping is None:
                raise InvalidInputError(
                    "index_k", "index_k and index_cache go together (the keys are written into the cache)"
                )
            impl.write_index_keys(index_k, index_cache, slot_mapping)
        plain = metadata
        topk_indices = self._topk(
            rows,
            index_q,
            index_weights,
            index_cache,
            topk_indices,
            q.device,
            lambda iq, w, cache, sel: impl.index_topk(plain, iq, w, cache, out=sel),
        )
        dims = self.dims
        latent_out = torch.empty((rows, dims.num_heads, dims.kv_lora_rank), dtype=q.dtype, device=q.device)
        num_decode = metadata.num_decode_tokens
        if metadata.num_decodes:
            impl.forward_sparse_decode(
                metadata,
                q[:num_decode],
                kv_cache,
                topk_indices[:num_decode],
                out=latent_out[:num_decode],
                kv_scale=kv_scale,
            )
        if metadata.num_prefills:
            impl.forward_sparse_prefill(
                metadata,
                q[num_decode:],
                kv_cache,
                topk_indices[num_decode:],
                out=latent_out[num_decode:],
                kv_scale=kv_scale,
            )
        out.copy_(torch.bmm(latent_out.transpose(0, 1), self.w_uv).transpose(0, 1))
        return out

    @staticmethod
    def _check_index_cache(index_cache: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if index_cache.shape[:2] != kv_cache.shape[:2]:
            raise InvalidInputError(
                "index_cache",
                f"has {tuple(index_cache.shape[:2])} (blocks, block_size) but kv_cache has "
                f"{tuple(kv_cache.shape[:2])}: the index-key cache shares the KV cache's block table",
            )

    def _topk(
        self,
        rows: int,
        index_q: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        index_cache: torch.Tensor | None,
        topk_indices: torch.Tensor | None,
        device: torch.device,
        index_topk: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """The given ``topk_indices`` (checked for the step's rows), or the indexer's selection
        (``index_topk(index_q, index_weights, index_cache, out)``)."""
        if topk_indices is not None:
            if topk_indices.shape[0] != rows:
                raise InvalidInputError(
                    "topk_indices", f"expected {rows} rows (the step's), got {topk_indices.shape[0]}"
                )
            return topk_indices
        if index_q is None or index_weights is None or index_cache is None:
            raise InvalidInputError(
                "topk_indices",
                "a sparse model needs the indexer's inputs (index_q, index_weights, index_k and "
                "index_cache) or precomputed topk_indices",
            )
        topk = self.dims.index_topk
        assert topk is not None
        selection = torch.empty((rows, topk), dtype=torch.int32, device=device)
        index_topk(index_q, index_weights, index_cache, selection)
        return selection

    def _write(
        self,
        metadata: MLAMetadata | DCPMetadata,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        kv_scale: float | torch.Tensor | None,
    ) -> None:
        if isinstance(metadata, DCPMetadata):
            if slot_mapping is not None:
                raise InvalidInputError(
                    "slot_mapping",
                    "under decode context parallelism the builder derives each rank's slots; pass None",
                )
            if not isinstance(self.attention, DecodeContextParallel):
                raise InvalidInputError(
                    "metadata", "DCP metadata needs a layer built on DecodeContextParallel"
                )
            self.attention.write_kv(metadata, kv_c, k_pe, kv_cache, kv_scale=kv_scale)
            return
        if not isinstance(self.attention, MLABackend):
            raise InvalidInputError(
                "metadata", "this layer runs under decode context parallelism: build with its build()"
            )
        if slot_mapping is None:
            raise InvalidInputError("slot_mapping", "required: the cache slot of each of the step's tokens")
        rows = kv_c.shape[0]
        require_tensor("slot_mapping", slot_mapping, ndim=1)
        if slot_mapping.shape[0] != rows:
            raise InvalidInputError("slot_mapping", f"expected {rows} entries, got {slot_mapping.shape[0]}")
        self.attention.impl.write_kv(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=kv_scale)
