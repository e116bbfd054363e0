"""The Triton sparse kernels with and without ``lengths``, from Triton's sm_90 compile on the CPU.

The sparse attention (bf16 cache, 16 heads, 64 rows: split slot lists; ``fp8_ds_mla`` cache,
128 heads, 4 rows) and the slot conversion (64 rows of 2048 entries) are launched under
:func:`mla.testing.triton_driver.stand_in_driver` (Triton's own compile for sm_90, nothing run)
in a process without the interpreter, once without ``lengths`` and once with, each form into a
Triton cache of its own, and read with the ``cuobjdump`` Triton ships. ``HAS_LENGTHS`` only
stops the slot-id scan at the row's length (where the walk then ends), so each attention
launch's key loop (the MMA loop) stays within 16 instructions of its form without lengths
(bf16: 1319 against 1307) and spills no more; the slot conversion with ``lengths`` (one program
of 8 warps per row) spills nothing.
"""

from __future__ import annotations

import glob
import pathlib
import textwrap

import pytest
from sm90_compile import run_without_interpreter, sass_of, stack_and_mma_loops, wgmma_register_hazards

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.heavy  # (compiles eight launches for sm_90 in a process of its own)

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
    from mla.providers.calls import SparseAttentionCall, SparseSlotsCall
    from mla.providers.triton.sparse import sparse_attention, sparse_slots
    from mla.testing.triton_driver import stand_in_driver

    i32, bf16 = torch.int32, torch.bfloat16

    def attention(rows, heads, kv_dtype, lengths):
        width = ds_mla_row_bytes(512, 64) if kv_dtype == DS_MLA_DTYPE else 576
        return SparseAttentionCall(
            q=torch.zeros(rows, heads, 576, dtype=bf16), kv_cache=torch.zeros(4096, width, dtype=kv_dtype),
            slots=torch.zeros(rows, 2048, dtype=i32), out=torch.zeros(rows, heads, 512, dtype=bf16),
            lse=torch.zeros(rows, heads), kv_lora_rank=512, rope_dim=64, softmax_scale=0.1, kv_scale=None,
            lengths=torch.zeros(rows, dtype=i32) if lengths else None)

    def slots(rows, lengths):
        return SparseSlotsCall(
            indices=torch.zeros(rows, 2048, dtype=i32), block_table=torch.zeros(4, 64, dtype=i32),
            row_request=torch.zeros(rows, dtype=i32), row_keys=torch.zeros(rows, dtype=i32), block_size=64,
            num_blocks=64, slots=torch.zeros(rows, 2048, dtype=i32), invalid_count=torch.zeros(1, dtype=i32),
            lengths=torch.zeros(rows, dtype=i32) if lengths else None)

    with stand_in_driver(compile_kernels=True) as driver:
        for form in ("plain", "lengths"):
            with_lengths = form == "lengths"
            for name, rows, heads, kv_dtype in (("bf16", 64, 16, bf16), ("ds_mla", 4, 128, DS_MLA_DTYPE)):
                # (Triton reads the cache directory at each compile)
                os.environ["TRITON_CACHE_DIR"] = os.path.join(sys.argv[1], form, name)
                sparse_attention(attention(rows, heads, kv_dtype, with_lengths))
            os.environ["TRITON_CACHE_DIR"] = os.path.join(sys.argv[1], form, "slots")
            sparse_slots(slots(64, with_lengths))
    print(len(driver.launches))
    """
)


def test_lengths_leave_the_key_loop_alone_and_spill_nothing_more(
    tmp_path: pathlib.Path, cuobjdump: str
) -> None:
    launches = int(run_without_interpreter(["-c", SCRIPT, str(tmp_path)]).strip().splitlines()[-1])
    assert launches == 2 * (2 + 1 + 1)  # per form: two attentions, the bf16 one's split reduce, slots
    for name in ("bf16", "ds_mla"):
        read = {}
        for form in ("plain", "lengths"):
            (cubin,) = glob.glob(f"{tmp_path / form / name}/*/_sparse_mla_kernel.cubin")
            read[form] = stack_and_mma_loops(cubin, cuobjdump)
            assert wgmma_register_hazards(sass_of(cubin, cuobjdump)) == [], (name, form)
        (plain_stack, plain_loops), (stack, loops) = read["plain"], read["lengths"]
        assert stack <= plain_stack, (name, read)
        assert len(loops) == len(plain_loops) == 1, (name, read)  # the key loop
        assert loops[0] <= plain_loops[0] + 16, (name, read)
    for form in ("plain", "lengths"):
        (cubin,) = glob.glob(f"{tmp_path / form / 'slots'}/*/_sparse_slots_kernel.cubin")
        assert stack_and_mma_loops(cubin, cuobjdump)[0] == 0, form
