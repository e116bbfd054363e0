"""aiter's capability record, as data: its paged-decode kernel table, the fp8 block keys and the
native-H24 rule. Importable without aiter (the CLI, the emulation and the tests read it anywhere)."""

from __future__ import annotations

import attrs
import torch

from mla.core.capabilities import ALL_CONTRACTS, Contract, PagedKernel, ProviderCapabilities

_BF16 = frozenset({torch.bfloat16})

AITER_LATENT_DIMS = frozenset({(512, 64)})
"""``(kv_lora_rank, rope)`` of aiter's asm and Gluon decode kernels (576-wide rows)."""
AITER_FP8_PREFILL_DIMS = frozenset({(192, 128)})
"""``(qk, v)`` head dims of ``mla_pfl_qh192_vh128`` (the fp8 persistent prefill kernel)."""
AITER_FP8_PREFILL_HEADS = frozenset({16, 32, 48, 64, 96, 128})
"""Multiples of 16 that ``mla_reduce_v1`` reduces at ``v_head_dim`` 128 (``csrc/kernels/mla/reduce.cu``)."""
ARCH_FP8: dict[str, torch.dtype] = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
"""``aiter.dtypes.fp8`` per arch: the only fp8 format aiter's kernels read there."""

AITER_GET_BLOCK_N_FP8_KEYS: frozenset[int] = frozenset({8, 16, 24, 32, 48, 64, 128, 256, 384, 512})
"""Head x qlen products aiter's non-persistent fp8 decode has a kernel block for
(``aiter/mla.py::get_block_n_fp8``); any other product raises KeyError inside aiter. The
non-persistent fp8 rows of :func:`aiter_paged_kernels` stay within them."""


AITER_FOLD_HEADS = 16
"""aiter's persistent decode runs any multiple of 16 heads, natively or folded onto its
16-head kernel (``q.view(T * H / 16, 16, D)``: the extra heads become pseudo-requests), also
above 128 heads, as vLLM's ROCm AITER MLA backend relies on for 144, 160, ... heads per rank."""


def aiter_paged_kernels(arch: str) -> frozenset[PagedKernel]:
    """aiter's paged-decode kernel table on ``arch`` as the strategies can reach it (kernel heads
    a multiple of 16, or a native 24; fp8 KV always with an fp8 query).

    Derived from ROCm/aiter e4048607: ``aiter/mla.py::mla_decode_fwd``'s native/fold rule,
    ``csrc/py_itfs_cu/asm_mla.cu``'s qlen/gqa remap and the ``hsa/<arch>/mla/mla_asm.csv``
    rows, and ``mla_reduce_v1``'s head list (at most 128, so more heads run folded). A
    combination outside the table is a ``cannot get heuristic kernel`` abort, an
    ``AITER_CHECK`` or a ``get_block_n_fp8`` KeyError.
    """
    fold = AITER_FOLD_HEADS
    if arch == "gfx950":
        return frozenset(
            {
                # bf16 persistent remaps to the gqa32/qlen4 or gqa64/qlen1 kernel at any qlen;
                # 24 heads need the native-H24 reducer and planner (see native_head_counts).
                PagedKernel(True, False, frozenset({24}), head_multiple=fold, padded=False),
                # Fewer than 16 heads padded to 16: the padded persistent path stops at qlen 4.
                PagedKernel(True, False, frozenset({fold}), 1, 4, padded=True),
                # fp8 persistent: gqa16 qlen 1/2/4 and the gqa32 remap past qlen 4; 24 heads
                # run as 32 inside the aiter provider (mla_decode_fwd has no fp8 24-head path).
                PagedKernel(True, True, frozenset({24}), head_multiple=fold),
                PagedKernel(False, False, frozenset({16, 32, 64, 128})),
                PagedKernel(False, True, frozenset({16, 128}), 1, 4),
            }
        )
    if arch == "gfx942":
        return frozenset(
            {
                # Every head count folds onto the gqa16 kernel, which exists up to qlen 4.
                PagedKernel(True, False, frozenset(), 1, 4, head_multiple=fold),
                PagedKernel(True, True, frozenset(), 1, 4, head_multiple=fold),
                # 128 fp8 heads are native (qSeqLen 0: any qlen).
                PagedKernel(True, True, frozenset({128})),
                PagedKernel(False, False, frozenset({16, 32, 128})),
                PagedKernel(False, False, frozenset({64}), 2),
                PagedKernel(False, True, frozenset({16, 128}), 1, 4),
            }
        )
    return frozenset()


def aiter_capabilities(
    arch: str,
    *,
    gluon: bool | None = None,
    fp8_prefill: bool | None = None,
    native_h24: bool = False,
    provider: str = "aiter",
) -> ProviderCapabilities:
    """The capability record of AMD aiter's MLA kernels on ``arch`` (ROCm/aiter e4048607).

    ``gluon`` / ``fp8_prefill`` default to "shipped on gfx950 only"; ``native_h24`` is the
    reducer-and-planner probe (off unless both ship; honoured on gfx950 only, where
    ``mla_decode_fwd`` runs 24 bf16 heads natively). The paged kernels' gaps are the table
    :func:`aiter_paged_kernels` (e.g. no padded bf16 persistent kernel past qlen 4, fp8
    non-persistent only to qlen 4 at ``get_block_n_fp8`` products, gfx942 persistent past qlen 4
    only for 128 fp8 heads).
    """
    gfx950 = arch == "gfx950"
    # DeepSeek Sparse Attention: aiter's sparse decode is reached through its metadata call's
    # ``is_sparse`` flag and kernels this project cannot run or test on a ROCm device, so the
    # record does not claim the sparse contracts; sparse models resolve to the reason below.
    contracts = set(ALL_CONTRACTS) - {Contract.SPARSE_ATTENTION, Contract.INDEXER}
    if not (gfx950 if gluon is None else gluon):
        contracts.discard(Contract.SMALL_HEAD_DECODE)
    if not (gfx950 if fp8_prefill is None else fp8_prefill):
        contracts.discard(Contract.FP8_PREFILL)
    return ProviderCapabilities(
        provider=provider,
        contracts=frozenset(contracts),
        decode_masks_outside_ids=False,
        decode_multi_row_stores_masked=False,
        decode_float32_out=False,
        archs=frozenset({"gfx942", "gfx950"}),
        q_dtypes=_BF16,
        kv_dtypes=_BF16 | frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz}),
        # aiter's CK varlen flash attention (flash_attn_varlen_func) takes fp16 and bf16.
        varlen_q_dtypes=_BF16 | frozenset({torch.float16}),
        head_granularity=16,
        max_unpadded_heads=128,
        native_head_counts=frozenset({24}) if native_h24 and gfx950 else frozenset(),
        small_head_max_heads=15,
        small_head_q_dtypes=_BF16,
        small_head_kv_dtypes=_BF16,
        uniform_qlen_padding=((2, 4), (3, 4)),
        paged_kernels=aiter_paged_kernels(arch),
        fp8_prefill_head_multiple=16,
        fp8_dtype=torch.float8_e4m3fn if gfx950 else torch.float8_e4m3fnuz,
    )


def with_native_h24(caps: ProviderCapabilities, arch: str) -> ProviderCapabilities:
    """``caps`` with aiter's native-H24 reducer and planner assumed present: 24 heads run
    unpadded where aiter's record allows it on ``arch`` (gfx950); no change elsewhere."""
    extra = aiter_capabilities(arch, native_h24=True).native_head_counts
    if extra <= caps.native_head_counts:
        return caps
    return attrs.evolve(caps, native_head_counts=caps.native_head_counts | extra)


def real_kernel_limits(caps: ProviderCapabilities, arch: str, *, decode_fp8: bool) -> ProviderCapabilities:
    """Limits of the real kernels that the CPU emulation record does not carry: 576-wide
    rows, the fp8 prefill's 192/128 dims and reducible head counts, and the one fp8 format
    aiter reads on ``arch`` (an ``mla_decode_fwd`` without q/kv scales takes no fp8 cache)."""
    fp8 = ARCH_FP8.get(arch, caps.fp8_dtype)
    kv_dtypes = frozenset({torch.bfloat16} | ({fp8} if decode_fp8 else set()))
    return attrs.evolve(
        caps,
        kv_dtypes=kv_dtypes,
        latent_dims=AITER_LATENT_DIMS,
        fp8_prefill_heads=AITER_FP8_PREFILL_HEADS,
        fp8_prefill_dims=AITER_FP8_PREFILL_DIMS,
        fp8_dtype=fp8,
    )
