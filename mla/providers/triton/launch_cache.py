"""Cached Triton launches: a repeated launch skips ``JITFunction.run``'s binding and specialization.

``kernel[grid](*args, **kwargs)`` costs 10-20 µs of host time on Triton 3.6 even when the
kernel is compiled: each call binds the arguments, specializes every one of them, builds and
looks up the cache key, builds the launch metadata for the (empty) launch hooks and then calls
the compiled kernel's launcher. The cached path costs about half (``probes/build_host.py
--launch triton`` times both on a CPU).
:class:`LaunchCache` keeps the compiled kernel of each specialization and calls its launcher
directly on later calls with the same specialization::

    _FILL = LaunchCache(_fill_page_indices_kernel)
    _FILL.launch(grid, seq_lens, block_table, ..., BLOCK=1024, num_warps=4)

Contract: :attr:`LaunchCache.launch` takes what ``kernel[grid](...)`` takes (``grid`` a tuple of
1-3 ints, the kernel's parameters positionally or by name, launch options such as
``num_warps`` by name) and launches the same compiled kernel with the same arguments on the
current device and stream; a missing or repeated argument raises ``TypeError`` naming it, as
Triton does.

How: the first call with a given key goes through ``kernel[grid](...)`` (compiling if needed),
which returns the :class:`~triton.compiler.CompiledKernel` it launched; that kernel is stored
under the key, and a later call with the same key calls its launcher the way ``JITFunction.run``
does, from one generated function per kernel (:func:`make_launcher`). The key is at least as
fine as Triton's own: per argument the facts Triton specializes on (an int's width class
i32/i64/u64, whether it is 1 and whether it is a multiple of 16, unless the parameter is in
``do_not_specialize``; a tensor's dtype and whether its address is 16-byte aligned; the type and
value of a constexpr; a float or bool by type; a Gluon ``TensorDescriptor``'s dtype, block
shape and shared layout, the parts of its type string), plus the launch options, the debug and
instrumentation settings, the active driver and the current device. Two calls with the same
key therefore get the same compiled kernel from Triton, so the cached one is the one Triton
would launch. Values that are not specialized on (an int's value, a tensor's address, a
descriptor's shape and strides) are passed through on every call (the launcher encodes a
descriptor's TMA map from them).

Global values: Triton compares every module-level value a kernel reads (Gluon kernels read their
module's constants and layouts) with its value at compile time on each launch, and raises when
one changed. The first launch of a key goes through that check; the cached entry then records
which object each of those names was bound to, and a later launch takes the cached path only
while every name is still bound to the same object (a rebound name sends the call through
Triton, which checks it by value). A value changed in place would not show as a rebinding, so
the values must be hashable, as immutable ones are: a kernel reading an unhashable global is
never cached.

Limits (each one sends the call through ``kernel[grid](...)``, so nothing changes but the cost):

* Triton versions other than those in :data:`VERIFIED_VERSIONS`, whose ``JITFunction.run`` this
  module mirrors (an older launcher took only the non-constexpr arguments), and any installed
  Triton lacking the attributes used here (checked once per kernel);
* the interpreter (``TRITON_INTERPRET=1``: the kernel is not a ``JITFunction``);
* kernels with pre-run hooks or an unhashable global value, launch enter/exit hooks set in
  ``triton.knobs`` (profilers), arguments of other types (numpy scalars, tuples, host-side
  ``triton.tools`` descriptors), unhashable constexprs or options, a grid that is not a tuple
  of 1-3 sizes;
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
    if not hasattr(knobs.compilation, "instrumentation_mode") or not isinstance(
        getattr(knobs, "HookChain", None), type
    ):
        return None
    if not hasattr(driver, "_active"):
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


def _descriptor_types() -> tuple[type, ...]:
    """The Gluon ``TensorDescriptor`` class of the installed Triton (none when it has no Gluon)."""
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415 (optional)
    except ImportError:
        return ()
    return (TensorDescriptor,)


_DESCRIPTOR_TYPES = _descriptor_types()


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
    this module does not key. (The generated launch inlines the tensor and int cases.)"""
    if kind == _CONSTEXPR:
        return (type(value), value)
    if type(value) is int:
        width = int_width(value)
        return width if kind == _PLAIN else (width, value == 1, value % 16 == 0)
    if isinstance(value, torch.Tensor):
        return (value.dtype, align and value.data_ptr() % 16 == 0)
    if type(value) in (float, bool) or value is None:
        return type(value).__name__
    if type(value) in _DESCRIPTOR_TYPES:
        desc: Any = value
        return (type(value), desc.base.dtype, tuple(desc.block_shape), desc.layout)
    raise UnkeyedArgumentError(f"no launch key for a {type(value).__name__} argument")


GlobalBindings = tuple[tuple[dict[str, Any], str, object], ...]
"""``(globals dict, name, bound object)`` per global value a kernel reads."""


def global_bindings(fn: Any) -> GlobalBindings | None:
    """What each global value ``fn`` reads is bound to now, as ``(globals dict, name, object)``;
    ``None`` when one is unhashable (mutable: a change in place would not show as a rebinding)
    or missing."""
    bindings = []
    for (name, _), (_, globals_dict) in fn.used_global_vals.items():
        bound = globals_dict.get(name, _MISSING)
        try:
            hash(bound)
        except TypeError:
            return None
        if bound is _MISSING:
            return None
        bindings.append((globals_dict, name, bound))
    return tuple(bindings)


def _arg_expr(name: str, kind: int, align: bool) -> str:
    """Python expression of :func:`arg_key` for one parameter, with the common tensor and int
    cases inline (no call); a constexpr's ``(type, value)`` as two elements of the key (a
    constexpr's position in the key is fixed)."""
    if kind == _CONSTEXPR:
        return f"type({name}), {name}"
    aligned = f"{name}.data_ptr() & 15 == 0" if align else "False"
    width = f"(0 if {_I32_MIN} <= {name} <= {_I32_MAX} else _lc_width({name}))"
    int_part = width if kind == _PLAIN else f"({width}, {name} == 1, {name} & 15 == 0)"
    return (
        f"({name}.dtype, {aligned}) if type({name}) is _lc_Tensor else "
        f"({int_part} if type({name}) is int else _lc_key({name}, {kind}, {align}))"
    )


def make_launcher(
    plan: tuple[tuple[str, int, bool, object], ...],
    cache: LaunchCache,
    runtime: tuple[Any, Any, Any],
) -> Callable[..., None]:
    """The fast launch of ``cache``'s kernel: a function taking ``(grid, *args, **kwargs)`` as
    ``kernel[grid](...)`` does (the kernel's parameters positionally or by name, defaults
    applied, launch options as extra keywords) that launches through the cached compiled kernel
    of the call's key, or hands the call to ``cache``'s Triton path (:meth:`LaunchCache._slow_bound`)
    when a limit of the module docstring applies or the key is new.

    Generated once per kernel (as Triton generates its own binder): binding is Python's own,
    every argument's key part (:func:`arg_key`, with the tensor and int cases inline) and the
    launch are one frame, and the key is one flat tuple ``(driver, device, part per parameter...,
    (option, value) pairs..., fn.debug, runtime debug, instrumentation mode)`` (a constexpr's
    part is two elements, its type and value; the active driver by identity, so a kernel compiled
    under another driver, such as a test's stand-in, is never launched through this one). A
    missing or repeated argument raises ``TypeError`` naming it, as Triton does. A cached entry
    whose kernel reads global values is taken only while each of them is bound to the object
    recorded with it (see the module docstring)."""
    _, driver, knobs = runtime
    namespace: dict[str, Any] = {
        "_lc_Tensor": torch.Tensor,
        "_lc_width": int_width,
        "_lc_key": arg_key,
        "_lc_Unkeyed": UnkeyedArgumentError,
        "_lc_HookChain": knobs.HookChain,
        "_lc_cache": cache,
        "_lc_entries": cache._entries,
        "_lc_fn": cache.fn,
        "_lc_driver": driver,
        "_lc_rt": knobs.runtime,
        "_lc_compilation": knobs.compilation,
    }
    params = []
    for i, (name, _, _, default) in enumerate(plan):
        if default is _MISSING:
            params.append(name)
        else:
            namespace[f"_lc_default_{i}"] = default
            params.append(f"{name}=_lc_default_{i}")
    keys = "".join(f"{_arg_expr(name, kind, align)}, " for name, kind, align, _ in plan)
    values = "".join(f"{name}, " for name, _, _, _ in plan)
    source = f"""\
def _lc_launch({", ".join(["_lc_grid", *params, "**_lc_options"])}):
    _lc_enter, _lc_exit = _lc_rt.launch_enter_hook, _lc_rt.launch_exit_hook
    if (
        type(_lc_grid) is not tuple
        or not 0 < len(_lc_grid) <= 3
        or _lc_fn.pre_run_hooks
        or not (_lc_enter is None or (type(_lc_enter) is _lc_HookChain and not _lc_enter.calls))
        or not (_lc_exit is None or (type(_lc_exit) is _lc_HookChain and not _lc_exit.calls))
    ):
        return _lc_cache._slow_bound(_lc_grid, ({values}), _lc_options, None)
    _lc_active = _lc_driver._active
    if _lc_active is None:
        _lc_active = _lc_driver.active
    _lc_device = _lc_active.get_current_device()
    try:
        _lc_k = (
            _lc_active, _lc_device, {keys}*_lc_options.items(),
            _lc_fn.debug, _lc_rt.debug, _lc_compilation.instrumentation_mode,
        )
        _lc_entry = _lc_entries.get(_lc_k)
    except (TypeError, _lc_Unkeyed):
        return _lc_cache._slow_bound(_lc_grid, ({values}), _lc_options, None)
    if _lc_entry is None:
        return _lc_cache._slow_bound(_lc_grid, ({values}), _lc_options, _lc_k)
    for _lc_globals, _lc_name, _lc_bound in _lc_entry[3]:
        if _lc_globals.get(_lc_name, _lc_cache) is not _lc_bound:
            return _lc_cache._slow_bound(_lc_grid, ({values}), _lc_options, _lc_k)
    if len(_lc_grid) == 1:
        _lc_g0, _lc_g1, _lc_g2 = _lc_grid[0], 1, 1
    elif len(_lc_grid) == 2:
        _lc_g0, _lc_g1, _lc_g2 = _lc_grid[0], _lc_grid[1], 1
    else:
        _lc_g0, _lc_g1, _lc_g2 = _lc_grid
    _lc_entry[0](
        _lc_g0, _lc_g1, _lc_g2, _lc_active.get_current_stream(_lc_device),
        _lc_entry[1], _lc_entry[2], None, None, None, {values}
    )
    _lc_cache.fast_launches += 1
"""
    exec(compile(source, f"<cached launch of {len(plan)} parameters>", "exec"), namespace)
    launcher: Callable[..., None] = namespace["_lc_launch"]
    return launcher


class LaunchCache:
    """Launches one ``@triton.jit`` kernel, through its compiled kernel once one is known for
    the call's specialization (see the module docstring for the contract and the limits).

    :attr:`launch` is ``fn[grid](*args, **kwargs)``: the generated fast launch
    (:func:`make_launcher`) when the installed Triton and the kernel allow it (:attr:`active`),
    else a plain call through Triton. ``fast_launches`` and ``slow_launches`` count the launches
    of each kind (for tests and benchmarks)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        runtime = _runtime() if ENABLED else None
        plan = None if runtime is None else _param_plan(fn, runtime[0])
        self._entries: dict[tuple[Hashable, ...], tuple[Any, Any, Any, GlobalBindings]] = {}
        self.fast_launches = 0
        self.slow_launches = 0
        self._names = () if plan is None else tuple(name for name, _, _, _ in plan)
        self.active = plan is not None and runtime is not None
        """Whether launches can take the cached path (version, runtime and kernel checks passed)."""
        self.launch: Callable[..., None] = (
            self._through_triton if plan is None or runtime is None else make_launcher(plan, self, runtime)
        )
        """``launch(grid, *args, **kwargs)``: ``fn[grid](*args, **kwargs)``, through the cached
        compiled kernel when possible."""

    def clear(self) -> None:
        """Forget every cached compiled kernel (the next launch of each key goes through Triton)."""
        self._entries.clear()

    def _through_triton(self, grid: Any, *args: Any, **kwargs: Any) -> None:
        self._slow(grid, args, kwargs, None)

    def _slow_bound(
        self,
        grid: Any,
        values: tuple[Any, ...],
        options: dict[str, Any],
        key: tuple[Hashable, ...] | None,
    ) -> None:
        """:meth:`_slow` for the generated launch, which has bound every parameter (``values``, in
        order): each passed by name, as a caller may pass them, so that a parameter named like a
        launch option (a kernel reading ``num_warps``) reaches both the kernel and the options."""
        self._slow(grid, (), {**dict(zip(self._names, values, strict=True)), **options}, key)

    def _slow(
        self,
        grid: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Hashable, ...] | None,
    ) -> None:
        """``fn[grid](...)``; with a ``key``, store the compiled kernel it returns with the
        objects its global values are bound to now (Triton has just checked them), when it has
        the launcher attributes this module calls and every global value is hashable."""
        self.slow_launches += 1
        compiled = self.fn[grid](*args, **kwargs)
        if key is None:
            return
        bindings = global_bindings(self.fn)
        if bindings is None:
            return
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata, bindings)
        except AttributeError:
            return
        if callable(entry[0]) and entry[1] is not None:
            self._entries[key] = entry
