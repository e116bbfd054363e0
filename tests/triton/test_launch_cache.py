"""The cached Triton launch (:mod:`mla.providers.triton.launch_cache`) on a CPU.

Triton's own host path runs here against a stand-in driver (:mod:`mla.testing.triton_driver`)
whose launcher records launches and whose "compiler" makes one stand-in kernel per Triton cache
key. So for every call the test knows the compiled kernel Triton's ``kernel[grid](...)`` picks
and the arguments it hands the launcher, and checks that the cached launch picks the same
kernel with the same arguments. ``tests/triton/test_gpu_launch_cache.py`` checks the written
indices on a GPU.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from mla.providers.triton import launch_cache, schedule, utils  # noqa: E402
from mla.providers.triton.launch_cache import LaunchCache, arg_key  # noqa: E402
from mla.testing.triton_driver import Launch, StandInDriver, stand_in_driver  # noqa: E402

needs_verified_triton = pytest.mark.skipif(
    launch_cache.triton_version() not in launch_cache.VERIFIED_VERSIONS,
    reason="the cached path is off for this Triton version (its fallback is tested below)",
)


def fresh_fill_kernel() -> JITFunction:
    """The fill kernel as a new ``JITFunction`` (the module's own is interpreted on a CPU)."""
    return JITFunction(utils._fill_page_indices_kernel.fn, do_not_specialize=utils.FILL_DO_NOT_SPECIALIZE)


@pytest.fixture
def driver() -> Iterator[StandInDriver]:
    with stand_in_driver(compile_kernels=False) as stand_in:
        yield stand_in


def same_launch(a: Launch, b: Launch) -> bool:
    """Same grid, stream, compiled function and arguments (tensors by identity)."""
    if (a.grid, a.stream, a.function) != (b.grid, b.stream, b.function) or len(a.args) != len(b.args):
        return False
    return all(
        x is y if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y
        for x, y in zip(a.args, b.args, strict=True)
    )


def fill_args(
    batch: int,
    *,
    offset: int = 0,
    lens_dtype: torch.dtype = torch.int32,
    max_len: int = 64,
    num_blocks: int | None = 512,
    block_size: int = 16,
    copy_qo: bool = True,
    write_ids: bool = True,
) -> tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]:
    """``(grid, args, kwargs)`` of one fill launch; ``offset`` elements shift the tensors' start
    (an offset of 1 makes them 4 or 8 bytes off 16-byte alignment)."""
    width = min(-(-max(max_len, 1) // block_size), 64)  # (nothing reads the memory)
    seq_lens = torch.zeros(batch + offset, dtype=lens_dtype)[offset:]
    table = torch.zeros(batch * width + offset, dtype=torch.int32)[offset:].view(batch, width)
    indptr = torch.zeros(batch + 1 + offset, dtype=torch.int32)[offset:]
    indices = torch.zeros(batch * 64 + 1, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    qo = torch.zeros(batch + 1, dtype=torch.int32)
    args = (
        seq_lens,
        table,
        indptr,
        indices,
        batch,
        width,
        max_len,
        num_blocks or 1,
        qsl if copy_qo else seq_lens,
    )
    args += (
        qo if copy_qo else seq_lens,
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )
    kwargs = {
        "BLOCK_SIZE": block_size,
        "BLOCK": 1024,
        "BLOCK_B": 128,
        "CHECK_BLOCKS": num_blocks is not None,
        "COPY_QO": copy_qo,
        "WRITE_IDS": write_ids,
        "COUNT": True,
        "COUNT_LENGTHS": copy_qo,
        "QLEN_FROM_QSL": copy_qo,
        "num_warps": 4,
    }
    return (batch, max(1, -(-max_len // 1024))), args, kwargs


FILL_CASES: list[dict[str, Any]] = [
    {"batch": 128},
    {"batch": 128},
    {"batch": 1},
    {"batch": 17, "max_len": 1},
    {"batch": 16, "max_len": 17},
    {"batch": 3, "offset": 1},
    {"batch": 3, "offset": 4},
    {"batch": 5, "lens_dtype": torch.int64},
    {"batch": 5, "lens_dtype": torch.int64, "offset": 1},
    {"batch": 2, "num_blocks": None},
    {"batch": 2, "num_blocks": 1},
    {"batch": 2, "max_len": 1 << 31},
    {"batch": 7, "block_size": 1},
    {"batch": 7, "block_size": 64, "copy_qo": False},
    {"batch": 6, "write_ids": False},
    {"batch": 128},
]


@needs_verified_triton
def test_cached_fill_launches_tritons_kernel_with_the_same_arguments(driver: StandInDriver) -> None:
    kernel = fresh_fill_kernel()
    cache = LaunchCache(kernel)
    assert cache.active
    for case in FILL_CASES * 2:
        grid, args, kwargs = fill_args(**case)
        cache.launch(grid, *args, **kwargs)
        cached = driver.launches[-1]
        kernel[grid](*args, **kwargs)
        assert same_launch(cached, driver.launches[-1]), case
    # One launch through Triton per specialization, every other one cached: the cases make 9
    # kernels (int32 lens aligned/not, int64 lens aligned/not, no clamp, an i64 max_len, block
    # sizes 1 and 64, the indptr-only fill of block-table providers), and the cache's keys
    # split them no further.
    assert len(kernel.device_caches[0][0]) == 9
    assert cache.slow_launches == 9
    assert cache.fast_launches == 2 * len(FILL_CASES) - 9


@needs_verified_triton
def test_cached_launch_follows_the_current_device_and_binds_like_triton(driver: StandInDriver) -> None:
    kernel = fresh_fill_kernel()
    cache = LaunchCache(kernel)
    grid, args, kwargs = fill_args(4)
    cache.launch(grid, *args, **kwargs)
    cache.launch(grid, *args, **kwargs)
    assert driver.launches[-1].stream == 1000
    driver.device = 1
    cache.launch(grid, *args, **kwargs)
    cache.launch(grid, *args, **kwargs)
    assert driver.launches[-1].stream == 1001
    device_1 = driver.launches[-1]
    kernel[grid](*args, **kwargs)
    assert same_launch(device_1, driver.launches[-1])
    assert (cache.slow_launches, cache.fast_launches) == (2, 2)
    # Constexprs passed positionally bind to the same parameters (same key, cached).
    constexprs = tuple(v for k, v in kwargs.items() if k != "num_warps")
    cache.launch(grid, *args, *constexprs, num_warps=4)
    assert same_launch(driver.launches[-1], device_1)
    assert cache.fast_launches == 3
    # Another launch option is another key.
    cache.launch(grid, *args, **{**kwargs, "num_warps": 8})
    assert cache.slow_launches == 3


@needs_verified_triton
def test_another_driver_never_gets_a_kernel_compiled_under_the_first() -> None:
    kernel = fresh_fill_kernel()
    cache = LaunchCache(kernel)
    grid, args, kwargs = fill_args(4)
    for _ in range(2):
        kernel.device_caches.clear()  # (Triton's own: its kernels record to the driver they were made under)
        with stand_in_driver(compile_kernels=False) as stand_in:
            cache.launch(grid, *args, **kwargs)
            cache.launch(grid, *args, **kwargs)
            assert len(stand_in.launches) == 2
    assert (cache.slow_launches, cache.fast_launches) == (2, 2)


@needs_verified_triton
def test_the_planner_launch_is_cached(driver: StandInDriver) -> None:
    kernel = JITFunction(schedule._plan_split_kv_kernel.fn)
    cache = LaunchCache(kernel)
    buffers = [torch.zeros(n, dtype=torch.int32) for n in (129, 4 * 1024, 129, 1)]
    for batch in (128, 1, 64, 128, 1, 17):
        args = (*buffers, batch, 1024, 128, 256)
        cache.launch((1,), *args, BLOCK=128, num_warps=4)
        cached = driver.launches[-1]
        kernel[(1,)](*args, BLOCK=128, num_warps=4)
        assert same_launch(cached, driver.launches[-1])
    # batch_size is specialized: 128 and 64 (multiples of 16), 1, and 17 are three keys.
    assert (cache.slow_launches, cache.fast_launches) == (3, 3)


class Sixteen(enum.IntEnum):
    VALUE = 16


@needs_verified_triton
@pytest.mark.parametrize(
    "case",
    [
        "launch hook",
        "plain launch hook",
        "pre-run hook",
        "unkeyed argument",
        "callable grid",
        "four-dimensional grid",
        "unhashable global value",
        "disabled",
    ],
)
def test_fallbacks_launch_through_triton(
    case: str, driver: StandInDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = fresh_fill_kernel()
    grid, args, kwargs = fill_args(4)
    launch_grid: Any = grid
    seen: list[object] = []
    if case == "launch hook":
        knobs.runtime.launch_enter_hook.add(seen.append)
    elif case == "plain launch hook":
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", seen.append)
    elif case == "pre-run hook":
        kernel.add_pre_run_hook(lambda *a, **k: seen.append(a))
    elif case == "unkeyed argument":
        args = (*args[:4], Sixteen.VALUE, *args[5:])
    elif case == "callable grid":
        launch_grid = lambda meta: grid  # noqa: E731
    elif case == "four-dimensional grid":
        launch_grid = (*grid, 1, 1)  # Triton launches the first three
    elif case == "unhashable global value":
        kernel.used_global_vals = {("G", 0): ([1], {"G": [1]})}
    else:
        monkeypatch.setattr(launch_cache, "ENABLED", False)
    try:
        cache = LaunchCache(kernel)
        for _ in range(3):
            cache.launch(launch_grid, *args, **kwargs)
            assert driver.launches[-1].grid == (*grid, 1)
    finally:
        if case == "launch hook":
            knobs.runtime.launch_enter_hook.remove(seen.append)
    assert (cache.slow_launches, cache.fast_launches) == (3, 0)
    if case == "pre-run hook":
        assert len(seen) == 3


@needs_verified_triton
def test_global_values_are_cached_while_each_name_keeps_its_object(driver: StandInDriver) -> None:
    kernel = fresh_fill_kernel()
    scope: dict[str, object] = {"G": 16, "LAYOUT": ("swizzle", 128)}
    kernel.used_global_vals = {("G", 0): (16, scope), ("LAYOUT", 0): (("swizzle", 128), scope)}
    cache = LaunchCache(kernel)
    grid, args, kwargs = fill_args(4)
    for _ in range(3):
        cache.launch(grid, *args, **kwargs)
    assert (cache.slow_launches, cache.fast_launches) == (1, 2)
    # An equal value bound anew: Triton checks it (and launches), the entry records the new object.
    scope["LAYOUT"] = tuple(["swizzle", 128])  # noqa: C409 (a literal would be the same constant object)
    for _ in range(2):
        cache.launch(grid, *args, **kwargs)
    assert (cache.slow_launches, cache.fast_launches) == (2, 3)
    # A changed value: Triton's own check raises, as it does without the cache.
    scope["G"] = 32
    with pytest.raises(RuntimeError, match="Global variable G has changed"):
        cache.launch(grid, *args, **kwargs)
    assert cache.fast_launches == 3


@needs_verified_triton
def test_gluon_descriptors_are_keyed_by_their_type_string(driver: StandInDriver) -> None:
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl

    def copy_tile(desc, out, n) -> None:  # type: ignore[no-untyped-def]
        pass  # (never compiled: the stand-in driver records the launch)

    kernel = JITFunction(copy_tile)
    cache = LaunchCache(kernel)
    wide = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    narrow = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    out = torch.zeros(16)

    def descriptor(rows: int, cols: int, block: list[int], layout: object, dtype: torch.dtype) -> object:
        x = torch.zeros(rows, cols, dtype=dtype)
        return gluon_hopper.TensorDescriptor(x, [rows, cols], [cols, 1], block, layout)

    cases = [
        (256, 192, [128, 64], wide, torch.bfloat16),
        (512, 256, [128, 64], wide, torch.bfloat16),  # another shape and base: same kernel
        (256, 192, [64, 64], wide, torch.bfloat16),
        (256, 192, [128, 64], narrow, torch.bfloat16),
        (256, 192, [128, 64], wide, torch.float16),
    ]
    for case in cases * 2:
        desc = descriptor(*case)
        cache.launch((4,), desc, out, 7)
        cached = driver.launches[-1]
        assert cached.args[0] is desc
        kernel[(4,)](desc, out, 7)
        assert same_launch(cached, driver.launches[-1]), case
    # Triton makes one kernel per type string (dtype, block shape, layout); so does the cache.
    types = {native_specialize_impl(BaseBackend, descriptor(*case), False, True, True)[0] for case in cases}
    assert len(types) == len(kernel.device_caches[0][0]) == 4
    assert (cache.slow_launches, cache.fast_launches) == (4, 2 * len(cases) - 4)


@needs_verified_triton
def test_a_parameter_named_like_a_launch_option_reaches_the_options(driver: StandInDriver) -> None:
    """A kernel may read its launch's ``num_warps`` as a constexpr parameter: Triton then binds
    the keyword to the parameter and to the options; the cached path's launches through Triton
    must pass it the same way (else the kernel is compiled for the default 4 warps)."""
    from triton import language as tl

    def reads_warps(x, num_warps: tl.constexpr) -> None:  # type: ignore[no-untyped-def]
        pass  # (never compiled)

    kernel = JITFunction(reads_warps)
    cache = LaunchCache(kernel)
    x = torch.zeros(4)
    for warps in (8, 8, 4):
        cache.launch((1,), x, num_warps=warps)
        cached = driver.launches[-1]
        kernel[(1,)](x, num_warps=warps)
        assert same_launch(cached, driver.launches[-1]), warps
    compiled = kernel.device_caches[0][0].values()
    assert sorted(k.options.num_warps for k in compiled) == [4, 8]
    assert (cache.slow_launches, cache.fast_launches) == (2, 1)


def test_another_triton_version_or_an_interpreted_kernel_is_never_cached(
    driver: StandInDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_cache, "triton_version", lambda: (3, 2))
    cache = LaunchCache(fresh_fill_kernel())
    assert not cache.active
    grid, args, kwargs = fill_args(4)
    for _ in range(2):
        cache.launch(grid, *args, **kwargs)
    assert (cache.slow_launches, cache.fast_launches) == (2, 0)
    assert len(driver.launches) == 2
    monkeypatch.undo()
    if knobs.runtime.interpret:
        assert not utils.FILL_LAUNCH.active
        assert not schedule.PLAN_LAUNCH.active


@needs_verified_triton
def test_a_missing_argument_raises_tritons_error(driver: StandInDriver) -> None:
    kernel = fresh_fill_kernel()
    cache = LaunchCache(kernel)
    grid, args, kwargs = fill_args(4)
    del kwargs["BLOCK"]
    with pytest.raises(TypeError, match="BLOCK"):
        cache.launch(grid, *args, **kwargs)
    assert driver.launches == []


# -- the key against Triton's own specialization ---------------------------------------------------


def key_values() -> list[object]:
    ints = [0, 1, 2, 15, 16, 17, -1, -16, -17, 1 << 31, (1 << 31) - 1, -(1 << 31), -(1 << 31) - 1]
    ints += [1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 16, -(1 << 63)]
    base = torch.zeros(64, dtype=torch.int32)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.int64)[1:], torch.zeros(8)]
    tensors.append(torch.zeros(8, dtype=torch.bfloat16)[8:])
    return [*ints, *tensors, 1.5, True, False, None]


@pytest.mark.parametrize(
    ("kind", "align"),
    [(launch_cache._SPECIALIZED, True), (launch_cache._SPECIALIZED, False), (launch_cache._PLAIN, True)],
)
def test_equal_keys_mean_equal_triton_specializations(kind: int, align: bool) -> None:
    """The key is at least as fine as Triton's specialization of the argument."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = key_values()
    specialize = kind == launch_cache._SPECIALIZED
    specs = [native(BaseBackend, v, False, specialize, align) for v in values]
    keys = [arg_key(v, kind, align) for v in values]
    for (a, key_a, spec_a), (b, key_b, spec_b) in itertools.combinations(
        zip(values, keys, specs, strict=True), 2
    ):
        if key_a == key_b and type(key_a) is type(key_b):
            assert spec_a == spec_b, (a, b, key_a)


def _keyed(x_ptr, n, unaligned, BLOCK: triton.language.constexpr = 64):  # type: ignore[no-untyped-def]
    """A kernel signature for the key test (never compiled: the stand-in driver's kernels)."""


@needs_verified_triton
def test_the_generated_launch_keys_each_argument_by_arg_key(driver: StandInDriver) -> None:
    """The generated launch's key: the driver and the device, each parameter's :func:`arg_key` (defaults
    applied, constexprs by type and value), the options, then the debug and instrumentation
    settings; arguments it does not key and unhashable options go through Triton uncached."""

    kernel = JITFunction(_keyed, do_not_specialize=["n"], do_not_specialize_on_alignment=["unaligned"])
    cache = LaunchCache(kernel)
    assert cache.active
    plan = (
        (launch_cache._SPECIALIZED, True),
        (launch_cache._PLAIN, True),
        (launch_cache._SPECIALIZED, False),
    )
    base = torch.zeros(64, dtype=torch.int32)
    values: list[object] = [0, 1, 16, 17, 1 << 40, base, base[1:], 1.5, True, None]
    for x, n, u in itertools.product(values, repeat=3):
        cache.clear()
        cache.launch((1,), x, n, u, num_warps=2)
        (key,) = cache._entries
        parts = tuple(arg_key(v, kind, align) for v, (kind, align) in zip((x, n, u), plan, strict=True))
        settings = (kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        assert key == (driver, 0, *parts, int, 64, ("num_warps", 2), *settings)
        cache.launch((1,), x, n, u, num_warps=2)
        assert driver.launches[-1].args == (x, n, u, 64)
    slow = cache.slow_launches
    cache.launch((1,), base, 1, 1, BLOCK=True)
    assert any(key[5:7] == (bool, True) for key in cache._entries)  # another key than int 1
    cache.launch((1,), Sixteen.VALUE, 1, 1)  # not keyed: through Triton
    with pytest.raises(TypeError, match="unhashable"):  # through Triton, which raises
        cache.launch((1,), 1, 2, 3, BLOCK=[64])
    with pytest.raises(OverflowError):  # likewise
        cache.launch((1,), 1 << 64, 1, 1)
    assert cache.slow_launches == slow + 4
    assert len(cache._entries) == 2
    with pytest.raises(TypeError, match="unaligned"):
        cache.launch((1,), 1, 2)
    with pytest.raises(TypeError, match="multiple values"):
        cache.launch((1,), 1, 2, 3, n=2)


# -- the prefill launches ----------------------------------------------------------------------


def prefill_tensors(
    lengths: list[int], heads: int, dtype: torch.dtype, *, offset: int = 0
) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, cu, out, lse)`` of a varlen prefill over ``lengths`` (q and k rows alike);
    ``offset`` elements shift q's start off 16-byte alignment."""
    rows = sum(lengths)
    q = torch.zeros(rows * heads * 192 + offset, dtype=dtype)[offset:].view(rows, heads, 192)
    k = torch.zeros(rows, heads, 192, dtype=dtype)
    v = torch.zeros(rows, heads, 128, dtype=dtype)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    out_dtype = torch.float16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    out = torch.zeros(rows, heads, 128, dtype=out_dtype)
    return q, k, v, cu, out, torch.zeros(rows, heads)


VARLEN_CASES: list[dict[str, Any]] = [
    {"lengths": [16, 16], "heads": 2, "dtype": torch.float16},
    {"lengths": [16, 16], "heads": 2, "dtype": torch.float16},
    {"lengths": [5, 16, 3], "heads": 2, "dtype": torch.float16},
    {"lengths": [16, 16], "heads": 2, "dtype": torch.float16, "offset": 1},
    {"lengths": [16, 16], "heads": 4, "dtype": torch.float32},
    {"lengths": [100], "heads": 2, "dtype": torch.float16, "causal": False},
    {"lengths": [16, 16], "heads": 2, "dtype": torch.float16},
]


@needs_verified_triton
def test_the_varlen_prefill_launch_is_cached(driver: StandInDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """``varlen_attention_fwd`` launches through :data:`~mla.providers.triton.prefill.VARLEN_LAUNCH`:
    each specialization's first launch goes through Triton, the repeats through the cached
    compiled kernel, with the same kernel and arguments as Triton's launch of the same call."""
    from mla.providers.calls import VarlenPrefillCall
    from mla.providers.triton import prefill

    kernel = JITFunction(prefill._varlen_fwd_kernel.fn)
    cache = LaunchCache(kernel)
    monkeypatch.setattr(prefill, "VARLEN_LAUNCH", cache)
    for case in VARLEN_CASES:
        lengths, causal = case["lengths"], case.get("causal", True)
        q, k, v, cu, out, lse = prefill_tensors(
            lengths, case["heads"], case["dtype"], offset=case.get("offset", 0)
        )
        call = VarlenPrefillCall(
            q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out, lse=lse, max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths), softmax_scale=0.1, causal=causal,
        )  # fmt: skip
        prefill.varlen_attention_fwd(call)
        first = driver.launches[-1]
        prefill.varlen_attention_fwd(call)
        assert same_launch(first, driver.launches[-1]), case
    # One launch through Triton per specialization: fp16 (32 rows), 24 rows (not a multiple of
    # 16), q off 16-byte alignment, fp32, and 100 rows non-causal.
    assert len(kernel.device_caches[0][0]) == 5
    assert cache.slow_launches == 5
    assert cache.fast_launches == 2 * len(VARLEN_CASES) - cache.slow_launches


@needs_verified_triton
def test_the_fp8_prefill_launches_are_cached(driver: StandInDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 prefill's two kernels launch through their :class:`LaunchCache`: a repeated call
    launches both through the cached kernels, with Triton's arguments."""
    from mla.providers.calls import Fp8PrefillCall
    from mla.providers.triton import fp8_prefill

    prefill_cache = LaunchCache(JITFunction(fp8_prefill._fp8_prefill_kernel.fn))
    reduce_cache = LaunchCache(JITFunction(fp8_prefill._fp8_reduce_kernel.fn))
    monkeypatch.setattr(fp8_prefill, "FP8_PREFILL_LAUNCH", prefill_cache)
    monkeypatch.setattr(fp8_prefill, "FP8_REDUCE_LAUNCH", reduce_cache)
    lengths = [300, 7]
    q, k, v, cu, out, lse = prefill_tensors(lengths, 2, torch.float8_e4m3fn)
    plan = fp8_prefill.build_fp8_prefill_plan(
        cu, cu, num_heads=2, causal=True, device=torch.device("cpu"), tile_q=32, kv_split=128, num_programs=4
    )
    assert plan.num_groups > 0  # the reduce launches too
    one = torch.ones(1)
    call = Fp8PrefillCall(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=out, lse=lse, schedule=plan,
        softmax_scale=0.1, q_scale=one, k_scale=one, v_scale=one, causal=True,
    )  # fmt: skip
    fp8_prefill.fp8_prefill_fwd(call)
    first = driver.launches[-2:]
    fp8_prefill.fp8_prefill_fwd(call)
    # (the partials are allocated per call: their addresses may differ; everything else not)
    for a, b in zip(first, driver.launches[-2:], strict=True):
        assert (a.grid, a.stream, a.function, len(a.args)) == (b.grid, b.stream, b.function, len(b.args))
    assert (prefill_cache.slow_launches, prefill_cache.fast_launches) == (1, 1)
    assert (reduce_cache.slow_launches, reduce_cache.fast_launches) == (1, 1)
