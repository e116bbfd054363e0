"""The Triton varlen kernel's chunked-context forms, from Triton's sm_90 compile on the CPU.

The launch the heuristic picks on the H200 (bf16 192/128, 128 x 64 tiles, 8 warps, 3 stages) is
compiled without a GPU (:mod:`mla.testing.triton_driver`) in three forms and read with the
``cuobjdump`` Triton ships: whole keys (the plain kernel), split keys (``k_nope`` views plus the
shared ``k_pe`` rows: a second pointer, the same two dot chunks), and split keys merged into a
prior state in the epilogue. The split keys cost the key loop nothing and spill nothing; the
merge epilogue leaves the unmasked key loop (all but the last block of a non-causal context
chunk) as it is (it spills a few bytes outside the loops and lengthens the masked loop, which
is why ``FlashVarlen`` runs the causal pass plain and merges the chunks).
"""

from __future__ import annotations

import glob
import pathlib
import textwrap

import pytest
from sm90_compile import run_without_interpreter, sass_of, stack_and_mma_loops, wgmma_register_hazards

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from mla.providers.calls import VarlenPrefillCall
    from mla.providers.triton.attention_host import AttentionLaunchConfig
    from mla.providers.triton.prefill import varlen_attention_fwd
    from mla.testing.triton_driver import stand_in_driver

    bf16, tokens, keys, heads = torch.bfloat16, 256, 512, 16
    q = torch.zeros(tokens, heads, 192, dtype=bf16)
    out, lse = torch.zeros(tokens, heads, 128, dtype=bf16), torch.zeros(tokens, heads)
    kv = torch.zeros(keys, heads, 256, dtype=bf16)  # one up-projection output
    split = {"k": kv[..., :128], "v": kv[..., 128:], "k_pe": torch.zeros(keys, 576, dtype=bf16)[:, 512:]}
    forms = {
        "plain": {"k": torch.zeros(keys, heads, 192, dtype=bf16), "v": kv[..., 128:].contiguous()},
        "split": split,
        "merge": {**split, "prior_out": out, "prior_lse": lse},
    }
    cu_q, cu_k = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0, keys], dtype=torch.int32)
    with stand_in_driver(compile_kernels=True) as driver:
        for form, tensors in forms.items():
            os.environ["TRITON_CACHE_DIR"] = os.path.join(sys.argv[1], form)  # (read at each compile)
            varlen_attention_fwd(
                VarlenPrefillCall(
                    q=q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out, lse=lse, max_seqlen_q=tokens,
                    max_seqlen_k=keys, softmax_scale=0.1, causal=False, **tensors,
                ),
                config=AttentionLaunchConfig(128, 64, 8, 3),
            )
    print(len(driver.launches))
    """
)


def test_split_keys_and_the_merge_epilogue_leave_the_key_loop_alone(
    tmp_path: pathlib.Path, cuobjdump: str
) -> None:
    assert run_without_interpreter(["-c", SCRIPT, str(tmp_path)]).strip().splitlines()[-1] == "3"
    read = {}
    for form in ("plain", "split", "merge"):
        (cubin,) = glob.glob(f"{tmp_path / form}/*/_varlen_fwd_kernel.cubin")
        read[form] = stack_and_mma_loops(cubin, cuobjdump)
        # (Triton's pipelined P·V reads P from registers: untouched until its wait)
        assert wgmma_register_hazards(sass_of(cubin, cuobjdump)) == [], form
    (plain_stack, plain), (split_stack, split), (_, merged) = read["plain"], read["split"], read["merge"]
    assert plain_stack == 0
    assert split_stack == 0
    assert len(plain) == len(split) == len(merged) == 2, read  # the unmasked and the masked loop
    assert abs(split[0] - plain[0]) <= 4, read
    assert abs(split[1] - plain[1]) <= 4, read
    assert abs(merged[0] - plain[0]) <= 8, read
