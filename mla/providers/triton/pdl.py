# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Programmatic dependent launch (PDL): a kernel's launch overlaps the end of the kernel before
it in the stream, and the kernel waits for that one in-kernel.

On Hopper a launch with ``launch_pdl=True`` is set up while the previous kernel completes, and
its programs start as soon as that kernel's programs have exited; ``griddepcontrol.wait``
(:func:`wait_for_previous`, the first thing a kernel of this package that takes part does) then
blocks until the previous kernel's writes are visible. Nothing a kernel reads or writes can race
with the kernel before it; what a chain of such kernels saves is each launch's start-up. A CUDA
graph captured from the stream keeps the dependencies as programmatic edges.

The kernels never call ``griddepcontrol.launch_dependents``: releasing the next kernel at a
kernel's start lets every later kernel of a chain park its programs on the SMs while the first
one still runs, and the DSA decode step (8 kernels) then ran 7% slower on an H200 instead of
2.4% faster (``docs/performance.md``).

:func:`use_pdl` says whether launches on a device take part: a CUDA (not ROCm) device of compute
capability 9.0 or newer, a Triton with ``triton.language.extra.cuda.gdc_wait``, not in the
Triton interpreter, and ``MLA_PDL`` not ``0`` in the environment when this module is imported.
A kernel's ``PDL`` constexpr and its launch's ``launch_pdl`` option are both set from it
(:func:`pdl_options`), so with PDL off the kernel holds no ``griddepcontrol`` instruction.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from mla.providers.triton.interpreter import interpreting

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = None

ENABLED = os.environ.get("MLA_PDL", "1") not in ("0", "")
"""``MLA_PDL=0`` turns programmatic dependent launch off for every kernel that takes part."""


@functools.cache
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (see the module)."""
    if not ENABLED or gdc_wait is None or device.type != "cuda" or interpreting():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that takes part, for ``device``: its ``PDL`` constexpr and
    the ``launch_pdl`` option, both :func:`use_pdl` (``kernel[grid](..., **pdl_options(dev))``)."""
    on = use_pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one in the stream has completed and its
    writes are visible. Call it before the kernel's first memory access."""
    if PDL:
        gdc_wait()


__all__ = ["ENABLED", "pdl_options", "use_pdl", "wait_for_previous"]
