"""The launch skeleton of the split-KV decode kernels, shared by the Triton and Gluon providers.

Every paged decode kernel of the two providers (the Triton kernel of :mod:`.decode`, the Gluon
kernels of :mod:`mla.providers.gluon.decode`) takes the same operands and writes the same
outputs: one program per (work item, row block) of ``rows = heads × qlen`` packed query rows,
the output written directly by a work item that covers its whole request, fp32 partials
otherwise, which the split reduce (:func:`~mla.providers.triton.merge.launch_merge`) combines.
:func:`launch_split_decode` is everything around the kernel launch, once for both providers:

1. an empty batch (no request, no head or no query row) launches nothing;
2. the work items and partial buffers (:func:`~mla.providers.triton.merge.split_work`):
   ``num_requests × num_splits`` items without a schedule, the planned schedule's items with
   one;
3. the kernel launch: the provider's function gets a :class:`DecodeLaunch` holding the operands
   every kernel takes, in their order (:meth:`DecodeLaunch.tensors`,
   :meth:`DecodeLaunch.scalars`, :meth:`DecodeLaunch.constexprs`), and adds its own;
4. the split reduce, unless every item wrote its request directly (one split, no schedule) or
   the kernel reduced its splits itself (it returns ``True``).

Contract of the operands (:class:`DecodeInputs`): q_nope ``[T, H, L]`` / q_pe ``[T, H, R]``
(strided views allowed, last dim contiguous), flat cache ``[N_tok, L+R]`` (16-bit, or fp8 with
``kv_scale``, a float32 ``[1]`` device tensor), int32 ``kv_indptr`` / ``kv_indices`` /
``qo_indptr`` on the device (``qo_indptr=None``: row ``b`` of q is request ``b`` with qlen 1),
out ``[T, H, L]``, lse ``[T, H]`` float32 or ``None`` (not written). ``kv_indices`` is the flat
per-token view, or, when :attr:`DecodeInputs.blocks` is set, the engine's block table
``[B, max_blocks]`` (only launch functions that read a block table take such inputs: the
Triton kernel; :meth:`DecodeInputs.paged` and :meth:`DecodeInputs.small_head` refuse them for
the others). :attr:`DecodeInputs.lengths` (int32 per request, optional) ends each request's
keys early: every kernel takes it (``HAS_LENGTHS``) and loads no tile past it. Everything is
graph-capturable: grids come from shapes and Python ints, never from tensor values.

The per-launch records are named tuples, not attrs records: a decode launch is on the engine's
per-step path, where their construction costs a fraction of a microsecond.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from mla.core.errors import InvalidInputError, PlanMismatchError
from mla.providers.calls import PagedDecodeCall, SmallHeadDecodeCall
from mla.providers.split_kv import SplitKVSchedule
from mla.providers.triton.merge import launch_merge, split_work

LOG2E = 1.4426950408889634
"""The kernels run the softmax in the exp2 domain: their score scale is ``softmax_scale·log2 e``."""
MODE_SPLIT = 0
"""``MODE`` constexpr, non-persistent: program ``work`` is (request ``work // num_splits``,
split ``work % num_splits``)."""
MODE_SCHEDULED = 1
"""``MODE`` constexpr, persistent: program ``work`` reads item ``work`` of the schedule."""


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of ``device``; 8 off a CUDA device (the CPU
    interpreter and the launch recorder of the tests)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


class BlockTableKeys(NamedTuple):
    """How a kernel finds keys in a block table (:attr:`DecodeInputs.kv_indices` is the table):
    position ``p`` of work request ``r`` is cache row ``table[row, p // page_size] * page_size
    + p % page_size`` with ``row = row_request[r]`` (``row = r`` without ``row_request``); a
    block id outside ``[0, N_tok // page_size)`` is masked."""

    page_size: int
    row_request: torch.Tensor | None
    """int32 ``[T]`` block-table row per query row (small-head verify rows), or ``None``."""


class DecodeInputs(NamedTuple):
    """The operands of one decode launch (see the module docstring for the contract), from
    either decode contract: :meth:`paged` or :meth:`small_head`."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor | None
    """``None``: every row of q is its own qlen-1 request (the small-head contract)."""
    num_requests: int
    max_qlen: int
    max_seqlen_k: int
    softmax_scale: float
    kv_scale: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None
    schedule: SplitKVSchedule | None
    """The planned split-KV schedule (persistent), or ``None`` (non-persistent)."""
    blocks: BlockTableKeys | None = None
    """``kv_indices`` is a block table read this way, or ``None``: flat per-token ids."""
    lengths: torch.Tensor | None = None
    """int32 ``[num_requests]`` or ``None``: request ``r`` reads only its first
    ``lengths[r]`` keys (clamped to ``[0, kv_indptr[r+1] - kv_indptr[r]]``), the tiles past them
    never loaded (sparse rows whose slot lists end in ``-1`` pads)."""

    @classmethod
    def paged(cls, call: PagedDecodeCall, *, provider: str, block_table: bool = False) -> DecodeInputs:
        """The ``paged-decode`` contract's operands; ``call.schedule`` must be a
        :class:`~mla.providers.split_kv.SplitKVSchedule` (:class:`PlanMismatchError` naming
        ``provider`` otherwise). ``block_table``: the caller's kernel reads a block table
        (a call with ``block_table`` raises :class:`PlanMismatchError` otherwise)."""
        schedule = call.schedule
        if schedule is not None and not isinstance(schedule, SplitKVSchedule):
            raise PlanMismatchError(
                f"the {provider} provider takes a SplitKVSchedule, got {type(schedule).__name__}"
            )
        indices, blocks = _key_operands(
            call.kv_indices, call.block_table, None, call.page_size, provider, block_table
        )
        q, rank = call.q, call.out.shape[-1]
        return cls(
            q[..., :rank], q[..., rank:], call.kv_cache, call.kv_indptr, indices, call.qo_indptr,
            call.qo_indptr.numel() - 1, call.max_qlen, call.max_seqlen_k, call.softmax_scale, call.kv_scale,
            call.out, call.lse, schedule, blocks,
        )  # fmt: skip

    @classmethod
    def small_head(
        cls, call: SmallHeadDecodeCall, *, provider: str = "calling", block_table: bool = False
    ) -> DecodeInputs:
        """The ``small-head-decode`` contract's operands: row ``t`` of q is a qlen-1 request
        over its ``seq_info[t+1] - seq_info[t]`` keys (``page_table[seq_info[t]:]``, or its
        block-table row when the caller's kernel reads one: ``block_table``)."""
        rows = call.q_nope.shape[0]
        indices, blocks = _key_operands(
            call.page_table, call.block_table, call.row_request, call.page_size, provider, block_table
        )
        return cls(
            _last_dim_contiguous(call.q_nope), _last_dim_contiguous(call.q_pe), call.kv_cache, call.seq_info,
            indices, None, rows, 1, call.max_seqlen_k, call.softmax_scale, call.kv_scale, call.out,
            call.lse, None, blocks,
        )  # fmt: skip

    @property
    def rows(self) -> int:
        """Packed query rows of one request: heads × max qlen."""
        return int(self.q_nope.shape[1]) * self.max_qlen

    @property
    def kv_fp8(self) -> bool:
        """Whether the cache is one of the fp8 formats the kernels widen (one byte per value)."""
        return self.kv_cache.element_size() == 1


def _key_operands(
    ids: torch.Tensor | None,
    table: torch.Tensor | None,
    row_request: torch.Tensor | None,
    page_size: int,
    provider: str,
    reads_table: bool,
) -> tuple[torch.Tensor, BlockTableKeys | None]:
    """The key-index operand of a call and how to read it: the flat ids, or the block table."""
    if table is None:
        if ids is None:
            raise PlanMismatchError(f"the {provider} provider got a decode call with no key indices")
        return ids, None
    if not reads_table:
        raise PlanMismatchError(
            f"the {provider} provider's decode kernels read flat per-token ids, not a block table "
            "(its capability record says decode_reads_block_table=False)"
        )
    if table.stride(-1) != 1:
        raise InvalidInputError("block_table", "last dim must be contiguous (stride 1)")
    return table, BlockTableKeys(page_size, row_request)


class DecodeLaunch(NamedTuple):
    """What the skeleton hands a kernel's launch function: the inputs, the grid and the
    operands every decode kernel takes, in the kernels' parameter order."""

    inputs: DecodeInputs
    grid: tuple[int]
    """One program per (work item, row block)."""
    row_blocks: int
    mode: int
    """:data:`MODE_SPLIT` or :data:`MODE_SCHEDULED`."""
    num_splits: int
    """Splits per request (non-persistent), 1 with a schedule."""
    qo: torch.Tensor
    """``qo_indptr``, or a stand-in pointer in unit-qlen mode (never read)."""
    work_info: torch.Tensor
    split_indptr: torch.Tensor
    lse: torch.Tensor
    """``lse``, or a one-element stand-in when it is not written."""
    kv_scale: torch.Tensor
    """``kv_scale``, or a stand-in pointer for a 16-bit cache (never read)."""
    part_o: torch.Tensor
    part_lse: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The leading pointer operands: q_nope, q_pe, kv cache, kv_indptr, kv_indices (the
        block table when :attr:`DecodeInputs.blocks` is set), qo_indptr, work_info,
        split_indptr, out, lse, part_o, part_lse."""
        x = self.inputs
        return (
            x.q_nope, x.q_pe, x.kv_cache, x.kv_indptr, x.kv_indices, self.qo, self.work_info,
            self.split_indptr, x.out, self.lse, self.part_o, self.part_lse,
        )  # fmt: skip

    def scalars(self) -> tuple[int | float, ...]:
        """The run-time scalars after the pointers: ``num_splits``, the strides of q_nope,
        q_pe (token, head), the cache row, out, lse (token, head), part_o (item, row, head),
        part_lse (item, row), then the exp2-domain score scale."""
        x, lse, part_o, part_lse = self.inputs, self.lse, self.part_o, self.part_lse
        return (
            self.num_splits, x.q_nope.stride(0), x.q_nope.stride(1), x.q_pe.stride(0), x.q_pe.stride(1),
            x.kv_cache.stride(0), x.out.stride(0), x.out.stride(1), lse.stride(0), lse.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            x.softmax_scale * LOG2E,
        )  # fmt: skip

    def constexprs(self) -> dict[str, int | bool]:
        """The compile-time parameters every decode kernel takes: heads ``H``, latent ``L``,
        rope ``R``, ``ROW_BLOCKS``, ``MODE``, ``UNIT_QLEN`` and ``WRITE_LSE``."""
        x = self.inputs
        return {
            "H": int(x.q_nope.shape[1]), "L": int(x.q_nope.shape[2]), "R": int(x.q_pe.shape[2]),
            "ROW_BLOCKS": self.row_blocks, "MODE": self.mode, "UNIT_QLEN": x.qo_indptr is None,
            "WRITE_LSE": x.lse is not None,
        }  # fmt: skip

    @property
    def num_rows(self) -> int:
        """Rows of the cache: the kernels mask a token id outside ``[0, num_rows)``."""
        return int(self.inputs.kv_cache.shape[0])

    def key_operands(self) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """The operands that say how the kernel finds its keys, after the scalars: the cache's
        row count (ids outside it are masked), the block table's row stride (0 for flat ids),
        the verify rows' request map and the requests' key counts (:attr:`DecodeInputs.lengths`;
        each a stand-in pointer without one, never read)."""
        x = self.inputs
        blocks = x.blocks
        stride_bt = x.kv_indices.stride(0) if blocks is not None else 0
        row_request = blocks.row_request if blocks is not None else None
        return (
            self.num_rows, stride_bt, row_request if row_request is not None else x.kv_indptr,
            x.lengths if x.lengths is not None else x.kv_indptr,
        )  # fmt: skip

    def key_constexprs(self) -> dict[str, int | bool]:
        """``PAGE_SIZE`` (0: flat per-token ids; else the block table's page size), ``ROW_MAP``
        (the block-table row of a work request is ``row_request[request]``) and ``HAS_LENGTHS``
        (a request reads only its first ``lengths[request]`` keys)."""
        x = self.inputs
        blocks = x.blocks
        return {
            "PAGE_SIZE": blocks.page_size if blocks is not None else 0,
            "ROW_MAP": blocks is not None and blocks.row_request is not None,
            "HAS_LENGTHS": x.lengths is not None,
        }


KernelLaunch = Callable[[DecodeLaunch], bool]
"""A provider's kernel launch: launches the decode kernel for a :class:`DecodeLaunch` and
returns whether it reduced the splits itself (the skeleton then launches no reduce)."""


def launch_split_decode(
    inputs: DecodeInputs, *, row_tile: int, num_splits: int, launch: KernelLaunch
) -> None:
    """Run one decode: work items, the kernel (``launch``), then the split reduce when needed.

    ``row_tile`` is the kernel's packed rows per program (``ceil(rows / row_tile)`` row
    blocks); ``num_splits`` the non-persistent split count (ignored with a schedule, whose
    partial buffers must fit the launch: :class:`PlanMismatchError` otherwise).
    """
    rows = inputs.rows
    if inputs.num_requests == 0 or rows == 0:
        return
    out, lse, schedule, num_requests, max_qlen = (
        inputs.out, inputs.lse, inputs.schedule, inputs.num_requests, inputs.max_qlen
    )  # fmt: skip
    mode, splits = (MODE_SPLIT, num_splits) if schedule is None else (MODE_SCHEDULED, 1)
    num_work, part_o, part_lse, work_info, split_indptr = split_work(
        schedule=schedule, num_splits=splits, num_requests=num_requests, max_qlen=max_qlen,
        heads=int(inputs.q_nope.shape[1]), rank=int(inputs.q_nope.shape[2]), kv_indptr=inputs.kv_indptr,
        out=out,
    )  # fmt: skip
    row_blocks = -(-rows // row_tile)
    lse_arg = lse if lse is not None else out.new_empty(1, 1, dtype=torch.float32)
    qo = inputs.kv_indptr if inputs.qo_indptr is None else inputs.qo_indptr
    scale_arg = inputs.kv_scale if inputs.kv_scale is not None else lse_arg
    decode = DecodeLaunch(
        inputs, (num_work * row_blocks,), row_blocks, mode, splits, qo, work_info, split_indptr, lse_arg,
        scale_arg, part_o, part_lse,
    )  # fmt: skip
    if launch(decode) or (mode == MODE_SPLIT and splits == 1):
        return
    launch_merge(
        part_o=part_o,
        part_lse=part_lse,
        out=out,
        lse=lse,
        qo_indptr=inputs.qo_indptr,
        split_indptr=split_indptr,
        num_requests=num_requests,
        max_qlen=max_qlen,
        num_splits=splits if mode == MODE_SPLIT else None,
        num_sms=num_sms(out.device),
    )


__all__ = [
    "LOG2E",
    "MODE_SCHEDULED",
    "MODE_SPLIT",
    "BlockTableKeys",
    "DecodeInputs",
    "DecodeLaunch",
    "KernelLaunch",
    "launch_split_decode",
    "num_sms",
]
