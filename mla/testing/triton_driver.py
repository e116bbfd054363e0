"""A stand-in Triton driver: Triton's launch path on a machine without a GPU.

With :func:`stand_in_driver` active, ``kernel[grid](...)`` on a ``JITFunction`` runs Triton's
own host code (binding, specialization, the in-memory kernel cache, compiling for sm_90 on the
first call of a specialization) and ends in :class:`RecordingLauncher`, which records the launch
instead of making it. Tests use it to check what a launch path hands the launcher (grid,
stream, compiled function, arguments); benchmarks use it to time the host side of a launch.
Nothing runs on a device: the arguments' memory is never read.

``compile_kernels=False`` replaces compilation by :class:`StandInKernel` (one per Triton cache
key, each with its own function handle), for processes that cannot compile: one that imported
Triton with ``TRITON_INTERPRET=1`` (the test suite on a CPU machine) has interpreted
``triton.language`` helpers.

Works with the Triton versions whose launch sequence :mod:`mla.providers.triton.launch_cache`
mirrors (it replaces ``triton.runtime.driver.driver``'s active driver for the duration).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs


@attrs.frozen
class Launch:
    """One recorded launch."""

    grid: tuple[int, int, int]
    stream: int
    function: object
    """The compiled kernel's function handle (the stand-in's: ``("function", name, device)``)."""
    args: tuple[Any, ...]
    """The kernel's arguments as the launcher got them (every parameter, constexprs included)."""


class RecordingLauncher:
    """Called like Triton's launcher; appends a :class:`Launch` to the driver's list (when the
    driver's ``record`` is true)."""

    def __init__(self, driver: StandInDriver) -> None:
        self.driver = driver

    def __call__(
        self,
        grid_0: int,
        grid_1: int,
        grid_2: int,
        stream: int,
        function: object,
        packed_metadata: object,
        launch_metadata: object,
        enter_hook: object,
        exit_hook: object,
        *args: Any,
    ) -> None:
        if self.driver.record:
            self.driver.launches.append(Launch((grid_0, grid_1, grid_2), stream, function, args))


class _Utils:
    """The driver utilities ``CompiledKernel`` calls when it loads a binary."""

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def load_binary(
        self, name: str, kernel: bytes, shared: int, device: int
    ) -> tuple[object, object, int, int, int]:
        return object(), ("function", name, device, next(_HANDLES)), 32, 0, 1024


_HANDLES = itertools.count()
"""Function handles are unique per loaded kernel, so a test can tell compiled kernels apart."""


class StandInKernel:
    """What ``JITFunction.run`` uses of a ``CompiledKernel``, without compiling."""

    def __init__(self, driver: StandInDriver, name: str, key: object, options: object = None) -> None:
        self.run = RecordingLauncher(driver)
        self.function = ("function", name, next(_HANDLES))
        self.packed_metadata = ("packed metadata", name)
        self.key = key
        """Triton's cache key this kernel was made for."""
        self.options = options
        """The compile options Triton handed the compiler (its backend's options record)."""

    def launch_metadata(self, grid: object, stream: object, *args: Any) -> None:
        return None


class StandInDriver:
    """An sm_90 CUDA driver as far as Triton's host code can tell; launches are recorded in
    :attr:`launches`. ``device`` is the current device; the current stream is ``1000 + device``."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.record = True
        """``False``: launches are not recorded (a benchmark's loop)."""
        self.device = 0
        self.utils = _Utils()

    def launcher_cls(self, src: object, metadata: object) -> RecordingLauncher:
        return RecordingLauncher(self)

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 1000 + device

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415 (triton is optional)

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> Any:
        import torch  # noqa: PLC0415

        return torch.device("cpu")


@contextmanager
def stand_in_driver(*, compile_kernels: bool = True) -> Iterator[StandInDriver]:
    """Make a :class:`StandInDriver` Triton's active driver inside the ``with`` block; with
    ``compile_kernels=False`` a cache miss of ``JITFunction.run`` makes a :class:`StandInKernel`
    instead of compiling."""
    from triton.runtime.driver import driver  # noqa: PLC0415 (triton is optional)
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    stand_in = StandInDriver()

    def stand_in_compile(
        fn: Any,
        key: object,
        signature: object,
        device: int,
        constexprs: object,
        options: object,
        attrs: object,
        warmup: bool,
    ) -> StandInKernel:
        kernel = StandInKernel(stand_in, fn.fn.__name__, key, options)
        fn.device_caches[device][0][key] = kernel
        return kernel

    previous = driver._active
    compile_method = JITFunction._do_compile
    driver._active = stand_in
    if not compile_kernels:
        JITFunction._do_compile = stand_in_compile
    try:
        yield stand_in
    finally:
        driver._active = previous
        JITFunction._do_compile = compile_method
