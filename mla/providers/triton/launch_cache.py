"""Cached Triton launches: a repeated launch skips ``JITFunction.run``'s binding and specialization.

``kernel[grid](*args, **kwargs)`` costs 10-20 µs of host time on Triton 3.6 even when the
kernel is compiled: each call binds the arguments, specializes every one of them, builds and
looks up the cache key, builds the launch metadata for the (empty) launch hooks and then calls
the compiled kernel's launcher. The cached path costs about half (``benchmarks/build_host.py
--launch triton`` times both on a CPU).
:class:`LaunchCache` keeps the compiled kernel of each specialization and calls its launcher
directly on later calls with the same specialization::

    _FILL = LaunchCache(_fill_page_indices_kernel)
    _FILL.launch(grid, seq_lens, block_table, ..., BLOCK=1024, num_warps=4)

Contract: :meth:`LaunchCache.launch` takes what ``kernel[grid](...)`` takes (``grid`` a tuple of
1-3 ints, the kernel's parameters positionally or by name, launch options such as
``num_warps`` by name) and launches the same compiled kernel with the same arguments on the
current device and stream.

How: the first call with a given key goes through ``kernel[grid](...)`` (compiling if needed),
which returns the :class:`~triton.compiler.CompiledKernel` it launched; that kernel is stored
under the key, and a later call with the same key calls its launcher the way ``JITFunction.run``
does. The key is at least as fine as Triton's own: per argument the facts Triton specializes on
(an int's width class i32/i64/u64, whether it is 1 and whether it is a multiple of 16, unless
the parameter is in ``do_not_specialize``; a tensor's dtype and whether its address is 16-byte
aligned; the type and value of a constexpr; a float or bool by type), plus the launch options,
the debug and instrumentation settings and the current device. Two calls with the same key
therefore get the same compiled kernel from Triton, so the cached one is the one Triton would
launch. Values that are not specialized on (an int's value, a tensor's address) are passed
through on every call.

Limits (each one sends the call through ``kernel[grid](...)``, so nothing changes but the cost):

* Triton versions other than those in :data:`VERIFIED_VERSIONS`, whose ``JITFunction.run`` this
  module mirrors (an older launcher took only the non-constexpr arguments), and any installed
  Triton lacking the attributes used here (checked once per kernel);
* the interpreter (``TRITON_INTERPRET=1``: the kernel is not a ``JITFunction``);
* kernels with pre-run hooks or global values (Triton re-checks those per call), launch
  enter/exit hooks set in ``triton.knobs`` (profilers), arguments of other types (numpy
  scalars, tuples, descriptors), unhashable constexprs or options, missing arguments, a grid
  that is not a tuple of 1-3 sizes;
* ``MLA_TRITON_LAUNCH_CACHE=0`` in the environment when this module is imported.

The cache holds one entry per key (a few per call site: the keys differ only in alignment,
width and 1/16-divisibility classes) and references only compiled kernels, never tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton

VERIFIED_VERSIONS: frozenset[tuple[int, int]] = frozenset({(3, 6)})
"""Triton ``(major, minor)`` versions whose ``JITFunction.run`` launch sequence this module
mirrors (read in ``triton/runtime/jit.py`` of each)."""

ENABLED = os.environ.get("MLA_TRITON_LAUNCH_CACHE", "1") not in ("0", "")
"""``MLA_TRITON_LAUNCH_CACHE=0`` turns the cache off (every launch goes through Triton)."""

_CONSTEXPR, _SPECIALIZED, _PLAIN = 0, 1, 2
"""Parameter kinds: constexpr (keyed by type and value), specialized (int facts, tensor
alignment), not specialized (``do_not_specialize``: int width class, tensor dtype)."""

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX, _U64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1


def triton_version() -> tuple[int, int] | None:
    """The installed Triton's ``(major, minor)``, or ``None`` when it cannot be read."""
    parts = str(getattr(triton, "__version__", "")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _runtime() -> tuple[Any, Any, Any] | None:
    """``(JITFunction, driver, knobs)`` of the installed Triton, or ``None`` if the launch
    sequence is not the verified one (version or missing attribute)."""
    if triton_version() not in VERIFIED_VERSIONS:
        return None
    try:
        from triton import knobs  # noqa: PLC0415 (feature check)
        from triton.runtime.driver import driver  # noqa: PLC0415
        from triton.runtime.jit import JITFunction  # noqa: PLC0415
    except ImportError:
        return None
    runtime = knobs.runtime
    if not all(hasattr(runtime, name) for name in ("debug", "launch_enter_hook", "launch_exit_hook")):
        return None
    if not hasattr(knobs.compilation, "instrumentation_mode"):
        return None
    return JITFunction, driver, knobs


def _param_plan(fn: Any, jit_function: Any) -> tuple[tuple[str, int, bool, object], ...] | None:
    """Per parameter ``(name, kind, align, default)`` (``default`` is ``_MISSING`` when the
    parameter has none), or ``None`` when ``fn`` is not a plain ``JITFunction`` this module can
    launch (interpreted, or missing an attribute)."""
    if not isinstance(fn, jit_function):
        return None
    plan = []
    try:
        if not isinstance(fn.pre_run_hooks, list) or not isinstance(fn.used_global_vals, dict):
            return None
        for param in fn.params:
            kind = _PLAIN if param.do_not_specialize else _SPECIALIZED
            if param.is_constexpr:
                kind = _CONSTEXPR
            default = param.default if param.has_default else _MISSING
            plan.append((param.name, kind, not param.do_not_specialize_on_alignment, default))
    except AttributeError:
        return None
    if any(name.startswith("_lc_") or not name.isidentifier() for name, _, _, _ in plan):
        return None
    return tuple(plan)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


class UnkeyedArgumentError(Exception):
    """An argument of a type this module does not key (the launch goes through Triton)."""


def int_width(value: int) -> int:
    """Triton's width class of an int argument: 0 (i32), 1 (i64), 2 (u64)."""
    if _I32_MIN <= value <= _I32_MAX:
        return 0
    if _I64_MIN <= value <= _I64_MAX:
        return 1
    if 0 <= value <= _U64_MAX:
        return 2
    raise UnkeyedArgumentError(f"int {value} does not fit 64 bits")


def arg_key(value: object, kind: int, align: bool) -> Hashable:
    """The part of the cache key for one argument: what Triton specializes a parameter of
    ``kind`` on (see the module docstring). Raises :class:`UnkeyedArgumentError` for a type
    this module does not key. (The generated binder inlines the tensor and int cases.)"""
    if kind == _CONSTEXPR:
        return (type(value), value)
    if type(value) is int:
        width = int_width(value)
        return width if kind == _PLAIN else (width, value == 1, value % 16 == 0)
    if isinstance(value, torch.Tensor):
        return (value.dtype, align and value.data_ptr() % 16 == 0)
    if type(value) in (float, bool) or value is None:
        return type(value).__name__
    raise UnkeyedArgumentError(f"no launch key for a {type(value).__name__} argument")


def _arg_expr(name: str, kind: int, align: bool) -> str:
    """Python expression of :func:`arg_key` for one parameter, with the common tensor and int
    cases inline (no call)."""
    if kind == _CONSTEXPR:
        return f"(type({name}), {name})"
    aligned = f"{name}.data_ptr() & 15 == 0" if align else "False"
    width = f"(0 if {_I32_MIN} <= {name} <= {_I32_MAX} else _lc_width({name}))"
    int_part = width if kind == _PLAIN else f"({width}, {name} == 1, {name} & 15 == 0)"
    return (
        f"({name}.dtype, {aligned}) if type({name}) is _lc_Tensor else "
        f"({int_part} if type({name}) is int else _lc_key({name}, {kind}, {align}))"
    )


def make_binder(plan: tuple[tuple[str, int, bool, object], ...]) -> Callable[..., Any]:
    """A function taking the kernel's arguments as ``kernel[grid](...)`` does (positionally or
    by name, defaults applied, launch options as extra keywords) and returning ``(arg_keys,
    values, options)``: the per-argument key parts, every parameter's value in order and the
    options dict. Generated once per kernel (as Triton generates its own binder), so binding is
    Python's own and the key costs a few attribute reads per tensor. Raises ``TypeError`` for
    a missing or repeated argument and :class:`UnkeyedArgumentError` for an argument it does
    not key."""
    namespace: dict[str, Any] = {
        "_lc_Tensor": torch.Tensor,
        "_lc_width": int_width,
        "_lc_key": arg_key,
    }
    params = []
    for i, (name, _, _, default) in enumerate(plan):
        if default is _MISSING:
            params.append(name)
        else:
            namespace[f"_lc_default_{i}"] = default
            params.append(f"{name}=_lc_default_{i}")
    keys = ", ".join(_arg_expr(name, kind, align) for name, kind, align, _ in plan)
    values = ", ".join(name for name, _, _, _ in plan)
    source = (
        f"def _lc_bind({', '.join([*params, '**_lc_options'])}):\n"
        f"    return ({keys},), ({values},), _lc_options\n"
    )
    exec(compile(source, f"<launch binder of {len(plan)} parameters>", "exec"), namespace)
    binder: Callable[..., Any] = namespace["_lc_bind"]
    return binder


class LaunchCache:
    """Launches one ``@triton.jit`` kernel, through its compiled kernel once one is known for
    the call's specialization (see the module docstring for the contract and the limits).

    ``fast_launches`` and ``slow_launches`` count the launches of each kind (for tests and
    benchmarks)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        runtime = _runtime() if ENABLED else None
        self._runtime = runtime
        plan = None if runtime is None else _param_plan(fn, runtime[0])
        self._bind = None if plan is None else make_binder(plan)
        self._entries: dict[tuple[Hashable, ...], tuple[Any, Any, Any]] = {}
        self.fast_launches = 0
        self.slow_launches = 0

    @property
    def active(self) -> bool:
        """Whether launches can take the cached path (version, runtime and kernel checks passed)."""
        return self._bind is not None

    def clear(self) -> None:
        """Forget every cached compiled kernel (the next launch of each key goes through Triton)."""
        self._entries.clear()

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """``fn[grid](*args, **kwargs)``, through the cached compiled kernel when possible."""
        bind, runtime, fn = self._bind, self._runtime, self.fn
        if bind is None or runtime is None or fn.pre_run_hooks or type(grid) is not tuple:
            self._slow(grid, args, kwargs, None)
            return
        size = len(grid)
        _, driver, knobs = runtime
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        # Triton 3.6's hooks are chains that call nothing until a hook is added (a profiler):
        # then, or for any other hook object, Triton's path runs them.
        if not (
            0 < size <= 3
            and (enter is None or getattr(enter, "calls", None) == [])
            and (leave is None or getattr(leave, "calls", None) == [])
        ):
            self._slow(grid, args, kwargs, None)
            return
        device = driver.active.get_current_device()
        try:
            arg_keys, values, options = bind(*args, **kwargs)
            key = (
                device,
                arg_keys,
                tuple(options.items()),
                fn.debug,
                rt.debug,
                knobs.compilation.instrumentation_mode,
            )
            entry = self._entries.get(key)
        except (TypeError, UnkeyedArgumentError):
            # A missing or repeated argument (Triton raises its own error), an argument or an
            # unhashable constexpr/option this module does not key.
            self._slow(grid, args, kwargs, None)
            return
        if entry is None:
            self._slow(grid, args, kwargs, key)
            return
        run, function, packed_metadata = entry
        if size == 1:
            grid_0, grid_1, grid_2 = grid[0], 1, 1
        elif size == 2:
            grid_0, grid_1, grid_2 = grid[0], grid[1], 1
        else:
            grid_0, grid_1, grid_2 = grid
        stream = driver.active.get_current_stream(device)
        run(grid_0, grid_1, grid_2, stream, function, packed_metadata, None, None, None, *values)
        self.fast_launches += 1

    def _slow(
        self,
        grid: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Hashable, ...] | None,
    ) -> None:
        """``fn[grid](...)``; with a ``key``, store the compiled kernel it returns (when it has
        the launcher attributes this module calls and the kernel reads no global values, which
        Triton re-checks on every launch)."""
        self.slow_launches += 1
        compiled = self.fn[grid](*args, **kwargs)
        if key is None or self.fn.used_global_vals:
            return
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata)
        except AttributeError:
            return
        if callable(entry[0]) and entry[1] is not None:
            self._entries[key] = entry
