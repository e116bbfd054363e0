"""Compile the Gluon decode kernel for sm_90 without a GPU and print its resource report.

    python -m probes.gluon_compile [--fp8] [--block-n 64] [--stages 2] [--sass]
        [--rows 16|32|64 [--fold SPLITS]] [--pingpong] [--dual]

Prints registers, spills, shared memory and counts of the key SASS instructions (HGMMA,
LDGSTS, LDL/STL) so a variant can be judged before it costs device time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from mla.providers.gluon.dual import LAT_BOX_LAYOUT, ROPE_BOX_LAYOUT, mla_decode_dual_kernel
from mla.providers.gluon.kernels import mla_decode_kernel
from mla.providers.gluon.pingpong import mla_decode_pingpong_kernel
from mla.providers.gluon.transposed import mla_decode_rows_kernel


def compile_variant(
    *,
    fp8: bool,
    block_n: int,
    stages: int,
    heads: int = 16,
    mode: int = 0,
    overlap: bool = False,
    rows: int = 0,
    pingpong: bool = False,
    dual: bool = False,
    e5m2: bool = False,
    fold: int = 0,
    page_size: int = 0,
    lengths: bool = False,
):
    """The decode kernel these options pick compiled for sm_90: flat per-token ids unless
    ``page_size`` (a block table of that page size), per-request key counts with ``lengths``."""
    kv = ("*fp8e5" if e5m2 else "*fp8e4nv") if fp8 else "*bf16"
    kernel = (
        mla_decode_dual_kernel
        if dual
        else mla_decode_pingpong_kernel
        if pingpong
        else mla_decode_rows_kernel
        if rows
        else mla_decode_kernel
    )
    ptrs = {
        "q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "kv_ptr": kv, "kv_indptr_ptr": "*i32",
        "kv_indices_ptr": "*i32", "qo_indptr_ptr": "*i32", "work_info_ptr": "*i32",
        "split_indptr_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "kv_scale_ptr": "*fp32",
        # the few-rows kernel's fold barrier words; the dual-chain kernel's merge buffer
        "barrier_ptr": "*i32", "merge_ptr": "*fp32",
        # the key operands (after the scalars): the verify rows' request map, the key counts
        "row_request_ptr": "*i32", "lengths_ptr": "*i32",
    }  # fmt: skip
    ints = [
        "num_splits", "stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h", "stride_kv",
        "stride_o_t", "stride_o_h", "stride_lse_t", "stride_lse_h", "stride_po_w", "stride_po_q",
        "stride_po_h", "stride_pl_w", "stride_pl_q", "num_kv_rows", "stride_bt",
    ]  # fmt: skip
    kv_type = kv[1:]
    types = {
        **ptrs,
        **dict.fromkeys(ints, "i32"),
        "sm_scale_log2": "fp32",
        "lat_desc": f"tensordesc<{kv_type}[64, 128],{LAT_BOX_LAYOUT!r}>",
        "rope_desc": f"tensordesc<{kv_type}[64, 64],{ROPE_BOX_LAYOUT!r}>",
    }
    warps = 4 if pingpong or dual or (rows and rows < 64) else 8
    constexprs = {
        "H": heads, "L": 512, "R": 64, "NR": rows or 16, "BLOCK_N": block_n, "NUM_STAGES": stages,
        "ROW_BLOCKS": 1, "MODE": mode, "UNIT_QLEN": False, "WRITE_LSE": True, "KV_FP8": fp8,
        "KV_DS_MLA": False, "PAGE_SIZE": page_size, "ROW_MAP": False, "HAS_LENGTHS": lengths,
        "OVERLAP": overlap, "FOLD_SPLITS": fold, "num_warps": warps,
    }  # fmt: skip
    # the signature in the kernel's own parameter order (a parameter this does not know raises)
    names = list(kernel.arg_names)
    sig = {k: "constexpr" if k in constexprs else types[k] for k in names}
    attrs = {
        (names.index(k),): [["tt.divisibility", 16]] for k in names if k in ptrs or k.startswith("stride")
    }
    src = GluonASTSource(
        kernel,
        signature=sig,
        constexprs={(names.index(k),): constexprs[k] for k in names if k in constexprs},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def sass_of(compiled: triton.compiler.CompiledKernel) -> str:
    """The sm_90 SASS of a kernel compiled by :func:`triton.compile` (:func:`sass_of_cubin` of
    its cubin)."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return sass_of_cubin(cubin)


def sass_of_cubin(cubin: str | os.PathLike[str]) -> str:
    """``cuobjdump -sass`` of a cubin file, with the tools Triton ships."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return subprocess.run(
        [os.path.join(bindir, "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def instruction_counts(sass: str, names: Sequence[str]) -> dict[str, int]:
    """How many of each SASS instruction in ``names`` (by opcode, any modifiers) ``sass`` holds."""
    return {name: len(re.findall(r"\b" + re.escape(name) + r"[ .]", sass)) for name in names}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument(
        "--rows", type=int, default=0, help="compile the transposed kernel for NR rows (64: on 8 warps)"
    )
    ap.add_argument("--pingpong", action="store_true", help="the 64-row ping-pong kernel (16-bit caches)")
    ap.add_argument("--dual", action="store_true", help="the dual-chain kernel (16 rows, fp8; implies --fp8)")
    ap.add_argument(
        "--fold",
        type=int,
        default=0,
        help="with --rows: fold the split reduce of this many splits into the kernel",
    )
    args = ap.parse_args()
    k = compile_variant(
        fp8=args.fp8 or args.dual,
        block_n=args.block_n,
        stages=args.stages,
        overlap=args.overlap,
        rows=args.rows,
        pingpong=args.pingpong,
        dual=args.dual,
        fold=args.fold,
    )
    md = k.metadata
    print(f"shared={md.shared} B  num_warps={md.num_warps}")
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run(
            [os.path.join(bindir, "ptxas"), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(d, "k.o")],
            capture_output=True,
            text=True,
            check=False,
        )
        print(
            "\n".join(
                line
                for line in r.stderr.splitlines()
                if "registers" in line or "spill" in line or "error" in line
            )
        )
    sass = sass_of(k)
    names = ("HGMMA", "LDGSTS", "LDL", "STL", "BAR.SYNC", "F2FP", "LDG", "STG", "LDSM", "STS", "LDS")
    for name, count in instruction_counts(sass, names).items():
        print(f"{name:9s} {count}")
    if args.sass:
        print(sass)


if __name__ == "__main__":
    main()
