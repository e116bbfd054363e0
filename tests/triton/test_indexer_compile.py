"""The indexer's Triton kernels compile for sm_90 (on the CPU) in every launch configuration the
heuristics pick and ``scratch/indexer_probe.py`` sweeps, without spilling registers.

Each configuration is launched under :func:`mla.testing.triton_driver.stand_in_driver` (Triton's
own compile for sm_90, the launch recorded, nothing run) in a process without the interpreter;
the cubins' resource usage (the ``cuobjdump`` Triton ships) shows no stack bytes but in the top-k
finish pass (:data:`FINISH_STACK`), and the scores kernel on fp8 queries runs e4m3 wgmma.
"""

from __future__ import annotations

import glob
import pathlib
import textwrap

import pytest
from sm90_compile import resource_usage, run_without_interpreter

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from mla.providers.calls import IndexTopkCall
    from mla.providers.triton.indexer import IndexScoresConfig, index_scores, score_chunk
    from mla.providers.triton.topk import TopkConfig, radix_topk, topk_config
    from mla.testing.triton_driver import stand_in_driver

    E4M3 = torch.float8_e4m3fn

    def call(rows, heads, n, block_size, q_dtype, key_dtype):
        blocks = n // block_size + 1
        width = 132 if key_dtype == E4M3 else 128
        cache = torch.zeros(blocks, block_size, width, dtype=torch.uint8 if key_dtype == E4M3 else key_dtype)
        return IndexTopkCall(
            q=torch.zeros(rows, heads, 128, dtype=q_dtype), weights=torch.zeros(rows, heads),
            index_cache=cache, key_dtype=key_dtype, block_table=torch.zeros(1, blocks, dtype=torch.int32),
            row_request=torch.zeros(rows, dtype=torch.int32), row_keys=torch.zeros(rows, dtype=torch.int32),
            max_keys=n, softmax_scale=0.1, topk=2048, indices=torch.zeros(rows, 2048, dtype=torch.int32))

    SCORES = [
        # (rows, heads, positions, block size, q dtype, key dtype, configs)
        (64, 64, 32768, 64, E4M3, E4M3, [
            IndexScoresConfig(num_stages=3), IndexScoresConfig(num_stages=4), IndexScoresConfig(num_stages=2),
            IndexScoresConfig(block_p=128, num_warps=8, num_stages=3)]),
        (8192, 64, 8192, 64, E4M3, E4M3, [
            IndexScoresConfig(num_stages=3), IndexScoresConfig(rows=2, num_stages=3),
            IndexScoresConfig(rows=2, block_p=128, num_warps=8, num_stages=3),
            IndexScoresConfig(rows=4, num_warps=8, num_stages=3),
            IndexScoresConfig(rows=2, num_warps=8, num_stages=4)]),
        (64, 64, 32768, 64, torch.bfloat16, E4M3, [IndexScoresConfig()]),
        (64, 64, 32768, 16, torch.bfloat16, E4M3, [IndexScoresConfig()]),
        (64, 130, 32768, 64, torch.bfloat16, E4M3, [IndexScoresConfig()]),
        (64, 64, 32768, 64, torch.bfloat16, torch.bfloat16, [IndexScoresConfig(rows=2)]),
    ]
    TOPK = [
        (64, 32768, [None, TopkConfig(split=2048), TopkConfig(split=8192, num_warps=8),
                     TopkConfig(split=4096, block=2048, num_warps=8, finish_warps=8)]),
        (8192, 8192, [None, TopkConfig(split=8192, block=2048, num_warps=8)]),
    ]

    with stand_in_driver(compile_kernels=True) as driver:
        for rows, heads, n, bs, q_dtype, key_dtype, configs in SCORES:
            c = call(rows, heads, n, bs, q_dtype, key_dtype)
            for config in configs:
                chunks = triton.cdiv(n, score_chunk(c, config, 8))
                index_scores(c, torch.zeros(rows, n), stats=torch.zeros(2, rows, chunks), config=config)
        for rows, n, configs in TOPK:
            for config in configs:
                config = config or topk_config(rows=rows, max_keys=n, num_sms=132)
                radix_topk(torch.zeros(rows, n), torch.zeros(rows, 2048, dtype=torch.int32), k=2048,
                           lengths=torch.zeros(rows, dtype=torch.int32), config=config)
    print(len(driver.launches))
    """
)


FINISH_STACK = 16
"""Stack bytes the top-k finish pass may keep: with the bins computed in float32 (the histogram
and collect passes run 2.4 µs faster at 64 x 32768 on an H200 than with the float64 scale a
``1e-38`` literal caused), ptxas keeps two to four registers of the finish pass on the stack in
two launch configurations (8 and 16 bytes); the whole top-k still ran faster (30.7 against
33.1 µs at 64 x 32768, interleaved runs)."""


@pytest.mark.heavy
def test_indexer_kernels_compile_for_sm90_without_spills(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    cuobjdump: str,
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launches = int(run_without_interpreter(["-c", SCRIPT]).strip().splitlines()[-1])
    assert launches == 13 + 6 * 4  # every scores config once, four top-k launches per config
    cubins = glob.glob(f"{tmp_path}/*/*.cubin")
    names = {pathlib.Path(c).stem for c in cubins}
    assert names == {
        "_index_scores_kernel",
        "_topk_range_kernel",
        "_topk_histogram_kernel",
        "_topk_collect_kernel",
        "_topk_finish_kernel",
    }
    for cubin in cubins:
        stack, usage = resource_usage(cubin, cuobjdump)
        allowed = FINISH_STACK if pathlib.Path(cubin).stem == "_topk_finish_kernel" else 0
        assert stack <= allowed, f"{cubin}: {usage.strip()}"
    fp8_dots = [
        p
        for p in glob.glob(f"{tmp_path}/*/_index_scores_kernel.ptx")
        if "wgmma.mma_async.sync.aligned" in (text := pathlib.Path(p).read_text()) and ".e4m3.e4m3" in text
    ]
    assert len(fp8_dots) == 8  # the fp8-query configurations (the 3-stage one-row kernel serves both)
