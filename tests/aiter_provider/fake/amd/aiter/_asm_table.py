"""aiter's MLA decode dispatch: ``mla_decode_fwd``'s head/qlen rules and the asm kernel table.

Emulates ROCm/aiter e4048607: the Python-level
native/fold/assert rule of the persistent path, the ``get_block_n_fp8`` dict of the
non-persistent fp8 path, ``asm_mla.cu``'s (gqa, qSeqLen) remap and the exact-match lookup in
``hsa/<arch>/mla/mla_asm.csv`` (decode rows with ``causal=1``, no ``cprr``).
"""

from __future__ import annotations

from aiter._math import check

# (qType, kvType, Gqa, ps, qSeqLen, lse) rows of mla_asm.csv (prefill 0, causal 1, cprr 0).
CSV_ROWS: dict[str, frozenset[tuple[str, str, int, int, int, int]]] = {
    "gfx942": frozenset(
        {
            ("bf16", "bf16", 128, 0, 0, 0),
            ("bf16", "bf16", 16, 1, 4, 0),
            ("bf16", "bf16", 16, 0, 1, 0),
            ("bf16", "bf16", 16, 0, 4, 0),
            ("bf16", "bf16", 16, 0, 8, 0),
            ("bf16", "fp8", 16, 1, 4, 0),
            ("fp8", "fp8", 16, 1, 1, 0),
            ("fp8", "fp8", 64, 1, 1, 0),
            ("fp8", "fp8", 64, 1, 1, 1),
            ("fp8", "fp8", 16, 1, 2, 0),
            ("fp8", "fp8", 16, 1, 4, 0),
            ("fp8", "fp8", 16, 0, 1, 0),
            ("fp8", "fp8", 16, 0, 2, 0),
            ("fp8", "fp8", 16, 0, 4, 0),
            ("fp8", "fp8", 128, 0, 0, 0),
            ("fp8", "fp8", 128, 1, 0, 0),
            ("bf16", "bf16", 32, 0, 0, 0),
            ("bf16", "bf16", 64, 0, 0, 0),
            ("bf16", "bf16", 8, 0, 1, 0),
            ("fp8", "fp8", 8, 0, 1, 0),
            ("bf16", "bf16", 8, 1, 2, 0),
        }
    ),
    "gfx950": frozenset(
        {
            ("bf16", "bf16", 128, 0, 0, 0),
            ("bf16", "bf16", 16, 1, 4, 0),
            ("bf16", "bf16", 16, 1, 4, 1),
            ("bf16", "bf16", 16, 0, 1, 0),
            ("bf16", "bf16", 16, 0, 4, 0),
            ("bf16", "bf16", 16, 0, 8, 0),
            ("bf16", "fp8", 16, 1, 4, 0),
            ("fp8", "fp8", 16, 1, 1, 0),
            ("fp8", "fp8", 16, 1, 1, 1),
            ("fp8", "fp8", 16, 1, 2, 0),
            ("fp8", "fp8", 16, 1, 4, 0),
            ("fp8", "fp8", 16, 1, 4, 1),
            ("fp8", "fp8", 16, 0, 1, 0),
            ("fp8", "fp8", 16, 0, 2, 0),
            ("fp8", "fp8", 16, 0, 4, 0),
            ("fp8", "fp8", 32, 1, 4, 0),
            ("fp8", "fp8", 32, 1, 4, 1),
            ("fp8", "fp8", 32, 1, 1, 0),
            ("fp8", "fp8", 32, 1, 1, 1),
            ("fp8", "fp8", 128, 0, 0, 0),
            ("bf16", "bf16", 32, 0, 0, 0),
            ("bf16", "bf16", 64, 0, 0, 0),
            ("bf16", "bf16", 64, 0, 1, 0),
            ("bf16", "bf16", 8, 0, 1, 0),
            ("bf16", "bf16", 8, 0, 2, 0),
            ("fp8", "fp8", 8, 0, 1, 0),
            ("fp8", "fp8", 8, 1, 4, 0),
            ("fp8", "fp8", 8, 1, 4, 1),
            ("bf16", "bf16", 32, 1, 4, 0),
            ("bf16", "bf16", 32, 1, 4, 1),
            ("bf16", "bf16", 64, 1, 1, 0),
            ("bf16", "bf16", 64, 1, 1, 1),
        }
    ),
}

GET_BLOCK_N_FP8 = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32, 256: 32, 384: 32, 512: 32}
"""``aiter/mla.py::get_meta_param``'s dict: the non-persistent fp8 path indexes it by heads x qlen."""

REDUCE_HEADS = {
    512: frozenset({8, 16, 24, 32, 48, 64, 80, 96, 112, 128}),
    128: frozenset({1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128}),
    64: frozenset({64}),
}
"""``mla_reduce_v1``'s (Dv -> heads) instantiations."""


def persistent_heads(arch: str, nhead: int, qlen: int, q_fp8: bool, kv_fp8: bool) -> tuple[int, bool]:
    """``mla_decode_fwd``'s persistent head rule: ``(heads the kernel runs, folded)``."""
    fp8 = q_fp8 and kv_fp8
    bf16 = not q_fp8 and not kv_fp8
    if nhead > 128 and nhead % 16 == 0:
        return 16, True  # past the reducer's 128 heads every multiple of 16 runs folded
    native = (
        nhead == 16
        or (arch == "gfx942" and nhead == 128 and fp8)
        or (arch == "gfx950" and fp8 and nhead in (32, 64, 128))
        or (arch == "gfx950" and nhead == 8 and fp8 and qlen == 4)
        or (arch == "gfx942" and nhead == 8 and bf16 and qlen == 2)
        or (arch == "gfx942" and nhead == 64 and fp8 and qlen == 1)
        or (arch == "gfx950" and bf16)
    )
    if native:
        return nhead, False
    if nhead % 16 == 0:
        return 16, True
    raise AssertionError(f"nhead={nhead} and max_seqlen_q={qlen} not supported")


def keeps_persistent(arch: str, batch: int, nhead: int, qlen: int, q_fp8: bool, kv_fp8: bool) -> bool:
    """``_use_persistent_mla_decode``: gfx950 bf16 16-head qlen-1 decode at batch >= 32 silently
    runs non-persistent."""
    regression = arch == "gfx950" and not q_fp8 and not kv_fp8 and nhead == 16 and qlen == 1
    return not regression or batch < 32


def block_n_fp8(nhead: int, qlen: int) -> int:
    """The non-persistent fp8 lookup (a ``KeyError`` for any other product, as in aiter)."""
    return GET_BLOCK_N_FP8[int(nhead * qlen)]


def asm_kernel(
    arch: str, q: str, kv: str, gqa: int, persistent: bool, qlen: int, lse: bool
) -> tuple[object, ...]:
    """``asm_mla.cu``'s remap and ``get_heuristic_kernel_mla``'s exact match; the row found."""
    cfg_gqa, cfg_qlen, ps = gqa, qlen, persistent
    bf16 = q == "bf16" and kv == "bf16"
    fp8 = q == "fp8" and kv == "fp8"
    if gqa == 128:
        cfg_qlen = 0
        if bf16 and arch == "gfx942":
            ps = False
    elif gqa == 16:
        if bf16 and persistent:
            cfg_qlen = 4 if qlen <= 4 else qlen
        elif bf16:
            cfg_qlen = 1 if qlen == 1 else 4 if qlen <= 4 else 8
        elif q == "bf16" and kv == "fp8":
            cfg_qlen = 4 if persistent and qlen <= 4 else qlen
        elif q == "fp8":
            if qlen in (1, 2):
                cfg_qlen = qlen
            elif qlen <= 4:
                cfg_qlen = 4
            else:
                check(
                    persistent and arch == "gfx950",
                    "mla_decode_stage1_asm_fwd:only support gqa_ratio=16 fp8 mla decoding with qo_len <= 4 "
                    "and qo_len>4 in persistent mode on gfx950",
                )
                cfg_gqa, cfg_qlen = 32, 4
    elif gqa == 32:
        if bf16 and not persistent:
            cfg_qlen = 0
        elif fp8:
            if qlen == 1:
                cfg_qlen = 1
            elif qlen == 2 and persistent:
                cfg_qlen = 2
            elif qlen >= 3 and persistent and arch == "gfx950":
                cfg_qlen = 4
            else:
                check(
                    False,
                    "mla_decode_stage1_asm_fwd: fp8/fp8 with gqa_ratio=32 only supports decode_qlen=1,2 "
                    "in persistent mode and decode_qlen>=3 in persistent mode on gfx950",
                )
    elif gqa == 64:
        if bf16 and not persistent:
            cfg_qlen = 1 if qlen == 1 else 0
        elif fp8:
            check(
                persistent,
                "mla_decode_stage1_asm_fwd: fp8/fp8 with gqa_ratio=64 only supports persistent mode",
            )
            cfg_qlen = 1 if qlen == 1 else 4
    if arch == "gfx950" and persistent:
        if bf16 and (gqa * qlen >= 128 or gqa > 64) and gqa != 48:
            cfg_gqa, cfg_qlen = 32, 4
        elif bf16 and (gqa * qlen >= 64 or gqa >= 16):
            cfg_gqa, cfg_qlen = 64, 1
        elif fp8 and ((gqa == 32 and qlen >= 4) or (gqa == 64 and qlen >= 2) or gqa == 128):
            cfg_gqa, cfg_qlen = 32, 4
        elif fp8 and (
            (gqa == 16 and qlen in (3, 4)) or (gqa == 32 and qlen in (2, 3)) or (gqa == 64 and qlen == 1)
        ):
            cfg_gqa, cfg_qlen = 16, 4
    lse_flag = int(lse and persistent)
    row = (q, kv, cfg_gqa, int(ps), cfg_qlen, lse_flag)
    check(
        row in CSV_ROWS.get(arch, frozenset()),
        f"get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q} kv_type:{kv} gqa:{cfg_gqa} "
        f"ps:{int(ps)} prefill:0 causal:1 qseqlen:{cfg_qlen} lse:{lse_flag} cprr:0",
    )
    return row


def check_reduce(heads: int, value_dim: int) -> None:
    check(
        heads in REDUCE_HEADS.get(value_dim, frozenset()),
        f"kn_mla_reduce_v1 doesn't support head dim {value_dim} with #heads: {heads}",
    )
