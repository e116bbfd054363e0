"""Can a Gluon kernel (Triton 3.6) on sm_90 hand data to the other CTA of a 2-CTA cluster?

    python -m probes.cluster_dsmem

FlashMLA's sparse ``fp8_ds_mla`` decode at 128 heads runs the two 64-row halves as a 2-CTA
cluster: each CTA dequantizes half of every key tile and writes it into both CTAs' shared memory
(distributed shared memory), so an SM dequantizes half the keys its rows attend. The 64-row
Gluon kernel instead runs the halves as independent programs that each dequantize every key.
This compiles, for sm_90 on the CPU, three small kernels launched with ``num_ctas=2`` and prints
what each becomes:

* ``plain``: a tensor split across the two CTAs (``cga_layout=[[1, 0]]``), loaded and stored;
* ``convert``: that tensor converted to a layout replicated on both CTAs (``[[0, 0]]``) and back:
  the exchange through the peer's shared memory;
* ``store``: the split tensor stored into a shared buffer replicated on both CTAs, read back.

Triton 3.6 (2026-12-05): ``plain`` compiles to a cluster launch (``.reqnctapercluster 2``);
``convert`` fails in the LLVM lowering (``nvvm.mapa`` built with a shared-window pointer where
NVVM wants the cluster window); ``store`` is not legalized (``ttg.local_store``). Gluon's Hopper
``mbarrier``, ``tma`` and shared-memory operations name no peer CTA either. The frontend also
compares a layout it rebuilt from the IR with the kernel's own by value and fails on
``cga_layout`` bases still wrapped as constexprs; the probe compares layouts by their printed
form to get past that to the lowering.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource


def _printed(layout: object) -> str:
    text = repr(layout).replace("(", "[").replace(")", "]")
    return re.sub(r"constexpr\[(-?\d+)\]", r"\1", text).replace(" ", "").replace(",]", "]")


gl.BlockedLayout.__eq__ = lambda a, b: type(a) is type(b) and _printed(a) == _printed(b)  # type: ignore[method-assign]
gl.BlockedLayout.__hash__ = lambda a: hash(_printed(a))  # type: ignore[method-assign]


@gluon.jit
def _probe(x_ptr, out_ptr, MODE: gl.constexpr):
    split: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=((1, 0),))
    both: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=((0, 0),))
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, split))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, split))
    x = gl.load(x_ptr + r[:, None] * 64 + c[None, :])
    if MODE == "plain":
        y = x
    elif MODE == "convert":
        y = gl.convert_layout(gl.convert_layout(x, both), split)
    else:
        shared: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=((0, 0),)
        )
        buffer = gl.allocate_shared_memory(gl.bfloat16, [128, 64], shared)
        buffer.store(x)
        y = gl.convert_layout(buffer.load(both), split)
    gl.store(out_ptr + r[:, None] * 64 + c[None, :], y)


def compile_mode(mode: str) -> str:
    """What ``_probe`` in ``mode`` compiles to for sm_90 with ``num_ctas=2``: the PTX's cluster
    directives and DSMEM instructions (an exception here is the compiler's failure)."""
    src = GluonASTSource(
        _probe,
        signature={"x_ptr": "*bf16", "out_ptr": "*bf16", "MODE": "constexpr"},
        constexprs={(2,): mode},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": 2})
    ptx = kernel.asm["ptx"]
    names = (".reqnctapercluster 2", "mapa", "shared::cluster", "barrier.cluster")
    return "compiles: " + ", ".join(f"{name} x{len(re.findall(re.escape(name), ptx))}" for name in names)


def outcome(mode: str) -> str:
    """``compile_mode(mode)`` in a process of its own (MLIR prints its errors to stderr): its
    line, or the compiler's first specific error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "probes.cluster_dsmem", mode],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode == 0:
        return done.stdout.strip()
    errors = [
        line.split("error:", 1)[1].strip()
        for line in done.stderr.splitlines()
        if "error:" in line and "Failures have been detected" not in line
    ]
    return "fails: " + (errors[0] if errors else done.stderr.strip().splitlines()[-1])[:220]


def main() -> None:
    if len(sys.argv) > 1:
        print(compile_mode(sys.argv[1]))
        return
    print(f"triton {triton.__version__}, sm_90, num_ctas=2")
    for mode in ("plain", "convert", "store"):
        print(f"{mode:8s} {outcome(mode)}")


if __name__ == "__main__":
    main()
