"""Shared-memory bank conflicts of the Gluon kernels' fp8 widening and transposes by Gluon's bank
model (``gl.bank_conflicts``: excess accesses a wavefront of ``ld.shared`` / ``st.shared``),
traced for sm_90 in a process without the Triton interpreter: the decode kernels' per-tensor fp8
widening (below), the ``fp8_ds_mla`` 64-row kernel's staged chunks and the fp8 prefill's V
transpose (their tests).

The 64-row and few-rows kernels widen a per-tensor fp8 KV tile 16 rows at a time
(:func:`mla.providers.gluon.kernels._mma_operands`): each thread reads 8 fp8 bytes of the
unswizzled ring slot (``PLAIN_LAYOUT``) and writes one 16-byte unit of the 128-byte-swizzled bf16
MMA tile (``MMA_TILE_LAYOUT``), in the register layouts of
:func:`mla.providers.gluon.kernels._kv_copy_layouts`; neither side may spend an excess
access, for the latent (512 columns) or the rope lanes (64), at 4 or 8 warps.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest
from sm90_compile import run_without_interpreter

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytestmark = pytest.mark.heavy  # (traces a kernel for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from mla.providers.gluon.kernels import MMA_TILE_LAYOUT, PLAIN_LAYOUT, _kv_copy_layouts
    from mla.testing.triton_driver import stand_in_driver

    @gluon.jit
    def probe(x_ptr, WARPS: gl.constexpr, COLS: gl.constexpr, PART: gl.constexpr):
        ld: gl.constexpr = _kv_copy_layouts(False, WARPS)[PART]
        slot = gl.allocate_shared_memory(gl.float8e4nv, [16, COLS], PLAIN_LAYOUT)
        wide = gl.allocate_shared_memory(gl.bfloat16, [16, COLS], MMA_TILE_LAYOUT)
        x = slot.load(ld)
        y = x.to(gl.bfloat16)
        loads: gl.constexpr = gl.bank_conflicts(x.type, slot.type)
        gl.static_print("banks", WARPS, COLS, loads, gl.bank_conflicts(y.type, wide.type))
        wide.store(y)

    with stand_in_driver(compile_kernels=True):
        for warps in (4, 8):
            for part, cols in ((0, 512), (1, 64)):
                probe[(1,)](torch.zeros(4), warps, cols, part, num_warps=warps)
    """
)


def _banks(tmp_path: pathlib.Path, script: str) -> dict[tuple[int, ...], tuple[int, int]]:
    """Run ``script`` (a probe kernel that prints ``banks <key ints...> <loads> <stores>`` while
    it is traced) in a process without the interpreter: ``{key: (load excess, store excess)}``."""
    # (Triton reads a kernel's source from its file; the package comes from the working directory;
    # an empty cache, so that the kernel is traced and prints)
    (tmp_path / "banks_probe.py").write_text(script)
    printed = run_without_interpreter(
        ["-c", f"import sys; sys.path.append({str(tmp_path)!r}); import banks_probe"],
        timeout=300,
        cache_dir=tmp_path / "cache",
    )
    found = {}
    for line in printed.splitlines():
        if line.startswith("banks"):
            *key, loads, stores = (int(word) for word in line.split()[1:])
            found[tuple(key)] = (loads, stores)
    return found


def test_fp8_widening_uses_every_bank(tmp_path: pathlib.Path) -> None:
    # {(warps, columns): (excess accesses a load wavefront, a store wavefront)}
    assert _banks(tmp_path, SCRIPT) == {(4, 512): (0, 0), (4, 64): (0, 0), (8, 512): (0, 0), (8, 64): (0, 0)}


STAGED_SCRIPT = textwrap.dedent(
    """
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from mla.providers.gluon.ds_mla_words import STAGED_WORDS, _chunk_layout, _dequantize
    from mla.providers.gluon.kernels import MMA_TILE_LAYOUT, PLAIN_LAYOUT
    from mla.testing.triton_driver import stand_in_driver

    @gluon.jit
    def probe(x_ptr, WARPS: gl.constexpr, STAGED: gl.constexpr):
        if STAGED:
            ld: gl.constexpr = _chunk_layout(WARPS)
            words = gl.allocate_shared_memory(gl.int32, [64, 32], STAGED_WORDS)
        else:
            ld: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
            words = gl.allocate_shared_memory(gl.int32, [64, 32], PLAIN_LAYOUT)
        chunk = gl.allocate_shared_memory(gl.bfloat16, [64, 128], MMA_TILE_LAYOUT)
        x = words.load(ld)
        y = _dequantize(x, gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, ld))).reshape([64, 128])
        loads: gl.constexpr = gl.bank_conflicts(x.type, words.type)
        gl.static_print("banks", WARPS, STAGED, loads, gl.bank_conflicts(y.type, chunk.type))
        chunk.store(y)

    with stand_in_driver(compile_kernels=True):
        for staged in (False, True):
            probe[(1,)](torch.zeros(4), 4, int(staged), num_warps=4)
    """
)


def test_staged_fp8_ds_mla_chunks_use_every_bank(tmp_path: pathlib.Path) -> None:
    """The producer of :mod:`mla.providers.gluon.ds_mla_heads` copies a chunk's words into its bf16
    tile, reads them back in the same layout and stores the dequantized bf16 values over them. In
    its layout (:func:`~mla.providers.gluon.ds_mla_words._chunk_layout`, the words view
    :data:`~mla.providers.gluon.ds_mla_words.STAGED_WORDS`) neither the read-back (as the copies)
    nor the stores spend an excess access; with 8 lanes across one row's 128 bytes (unswizzled
    words, the row-major copy layout) the stores spend one a wavefront."""
    # {(warps, staged layout): (excess accesses a load wavefront, a store wavefront)}
    assert _banks(tmp_path, STAGED_SCRIPT) == {(4, 0): (0, 1), (4, 1): (0, 0)}


VT_SCRIPT = textwrap.dedent(
    """
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from mla.providers.gluon.prefill_fp8_parts import FP8_TILE_LAYOUT, _pv_key_order, _vt_layout
    from mla.providers.gluon.prefill_fp8_split import _vt_load_layout
    from mla.testing.triton_driver import stand_in_driver

    @gluon.jit
    def probe(x_ptr, KEYS: gl.constexpr):
        ld: gl.constexpr = _vt_load_layout(KEYS, 64, 4)
        v_box = gl.allocate_shared_memory(gl.float8e4nv, [KEYS, 64], FP8_TILE_LAYOUT)
        vt_rows = gl.allocate_shared_memory(gl.float8e4nv, [64, KEYS], _vt_layout(KEYS))
        v = v_box.load(ld)
        vt = _pv_key_order(gl.permute(v, (1, 0)))
        loads: gl.constexpr = gl.bank_conflicts(v.type, v_box.type)
        gl.static_print("banks", KEYS, loads, gl.bank_conflicts(vt.type, vt_rows.type))
        vt_rows.store(vt)

    with stand_in_driver(compile_kernels=True):
        for keys in (64, 128):
            probe[(1,)](torch.zeros(4), keys, num_warps=4)
    """
)


def test_fp8_prefill_v_transpose_banks(tmp_path: pathlib.Path) -> None:
    """The fp8 split prefill's V transpose (:func:`mla.providers.gluon.prefill_fp8_split.
    _transpose_v_split`): a 64-lane box of the V landing tile read in
    :func:`~mla.providers.gluon.prefill_fp8_split._vt_load_layout` and stored, in ``P·V``'s key
    order, into the V^T rows. At 128 keys (the launch's tiles) the stores spend one excess access
    a wavefront; the 64-key layout, whose lanes step the value lanes 16, three."""
    # {keys: (excess accesses a load wavefront, a store wavefront)}
    assert _banks(tmp_path, VT_SCRIPT) == {(64,): (1, 3), (128,): (1, 1)}
