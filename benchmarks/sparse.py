"""Sparse MLA (DeepSeek Sparse Attention) on the GPU: sparse decode and prefill, the indexer and
the whole DSA decode step, beside the dense Gluon decode and a torch gather-then-dense peer.

``python -m benchmarks.sparse [--only NAME ...] [--json PATH] [--plot PATH]``

Every case is checked before it is timed: each implementation's output against the torch
provider's float32 gather-then-dense math on the same inputs (relative error in the table).
Times are medians of CUDA-graph replays (``bench_graph_us``). Metrics, as the issue states them:

* sparse attention FLOPs ``2 · rows · H · K · (576 + 512)`` (``K`` = keys a row attends);
* bytes ``rows · K · row_bytes`` gathered (656 for ``fp8_ds_mla``, 1152 for bf16) plus q read and
  out written;
* indexer logits FLOPs ``2 · Hi · D · (visible (row, position) pairs)``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

import mla
from benchmarks._common import bench_graph_us, gpu_name, print_table, rel_error, tbps, tflops
from mla.core.config import DS_MLA_DTYPE, ds_mla_row_bytes
from mla.providers import get_provider
from mla.providers.calls import IndexTopkCall, SparseAttentionCall
from mla.providers.formats import pack_ds_mla, quantize_index_keys, quantize_index_queries
from mla.providers.sparse_slots import slot_lengths

L, R = 512, 64
TOPK = 2048


@attrs.frozen
class AttentionCase:
    name: str
    kv: str
    """``bf16``, ``fp8`` (per-tensor e4m3) or ``fp8_ds_mla``."""
    heads: int
    batch: int
    qlen: int
    context: int
    """Cached tokens per request the selection draws from."""
    prefill: bool = False


ATTENTION_CASES = (
    AttentionCase("decode-dsmla-h128-b128-q2", "fp8_ds_mla", 128, 128, 2, 32768),
    AttentionCase("decode-dsmla-h16-b128-q2", "fp8_ds_mla", 16, 128, 2, 32768),
    AttentionCase("decode-bf16-h16-b64-q1", "bf16", 16, 64, 1, 32768),
    AttentionCase("decode-fp8-h16-b64-q1", "fp8", 16, 64, 1, 32768),
    AttentionCase("prefill-bf16-h128-4x8192", "bf16", 128, 4, 8192, 8192, prefill=True),
)


def _cache(kv: str, blocks: int, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, float | None]:
    rows = torch.randn(blocks * block_size, L + R, generator=gen, device="cuda") * 0.5
    if kv == "fp8_ds_mla":
        return pack_ds_mla(rows[:, :L], rows[:, L:]).view(blocks, block_size, -1), None
    if kv == "fp8":
        return (rows * 8).to(torch.float8_e4m3fn).view(blocks, block_size, -1), 1 / 8
    return rows.to(torch.bfloat16).view(blocks, block_size, -1), None


def _slots(case: AttentionCase, gen: torch.Generator) -> torch.Tensor:
    """``[rows, TOPK]`` distinct cache slots per row (a shuffled cache, so rows land anywhere);
    a prefill row ``i`` picks among its ``i + 1`` visible tokens (fewer than ``TOPK`` early on)."""
    rows = case.batch * case.qlen
    keys = torch.rand(rows, case.context, generator=gen, device="cuda")
    if case.prefill:
        position = torch.arange(case.qlen, device="cuda").repeat(case.batch)
        keys = keys.masked_fill(torch.arange(case.context, device="cuda")[None] > position[:, None], -1.0)
    values, picked = torch.topk(keys, TOPK, dim=1)
    request = torch.arange(rows, device="cuda") // case.qlen
    slots = request[:, None] * case.context + picked
    return torch.where(values >= 0, slots, -1).to(torch.int32)


def attention_rows(case: AttentionCase, providers: Sequence[str]) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    block_size = 64
    blocks = case.batch * case.context // block_size
    cache, kv_scale = _cache(case.kv, blocks, block_size, gen)
    width = cache.shape[-1]
    flat = cache.view(-1, width)
    rows = case.batch * case.qlen
    q = torch.randn(rows, case.heads, L + R, generator=gen, device="cuda", dtype=torch.bfloat16)
    slots = _slots(case, gen)
    attended = int((slots >= 0).sum())
    scale = None if kv_scale is None else torch.tensor([kv_scale], device="cuda")
    row_bytes = ds_mla_row_bytes(L, R) if cache.dtype == DS_MLA_DTYPE else (L + R) * cache.element_size()
    nbytes = attended * row_bytes + q.numel() * 2 + rows * case.heads * L * 2
    flops = 2.0 * attended * case.heads * (L + R + L)

    # As the sparse strategies pass them (the slot conversion writes them): 1 + each row's last
    # valid column, so a causal prefill's early rows skip their -1 tails.
    lengths = slot_lengths(slots)

    def call_for(out: torch.Tensor, *, every_column: bool = False) -> SparseAttentionCall:
        return SparseAttentionCall(
            q=q,
            kv_cache=flat,
            slots=slots,
            out=out,
            lse=None,
            kv_lora_rank=L,
            rope_dim=R,
            softmax_scale=192**-0.5,
            kv_scale=scale,
            lengths=None if every_column else lengths,
        )

    # The check: the torch provider's float32 math on (a sample of) the rows.
    check = torch.arange(rows, device="cuda")
    if rows > 1024:
        check = torch.cat([check[:512], check[-512:]])
    reference = torch.empty(check.numel(), case.heads, L, device="cuda", dtype=torch.bfloat16)
    get_provider("torch").sparse_attention(
        attrs.evolve(
            call_for(reference),
            q=q[check].contiguous(),
            slots=slots[check].contiguous(),
            lengths=lengths[check],
        )
    )
    table = []
    # A prefill's early rows end in -1: timed with the lengths and, on gluon, over all K columns.
    runs = [(name, False) for name in providers] + ([("gluon", True)] if case.prefill else [])
    for name, every_column in runs:
        provider = get_provider(name)
        out = torch.full((rows, case.heads, L), math.nan, device="cuda", dtype=torch.bfloat16)
        call = call_for(out, every_column=every_column)
        provider.sparse_attention(call)
        error = rel_error(out[check].float(), reference.float())
        if name == "torch" and case.prefill:
            continue  # the peer's chunked loop is the check here, too slow to replay
        us = bench_graph_us(lambda p=provider, c=call: p.sparse_attention(c))
        table.append(
            {
                "case": case.name,
                "impl": f"{name}, all K columns" if every_column else name,
                "us": us,
                "TB/s": tbps(nbytes, us),
                "TFLOP/s": tflops(flops, us),
                "rel err": error,
            }
        )
    if not case.prefill:
        table.append(
            dense_decode_row(
                case.name, batch=case.batch, qlen=case.qlen, context=case.context, heads=case.heads
            )
        )
    return table


def dense_decode_row(label: str, *, batch: int, qlen: int, context: int, heads: int) -> dict[str, Any]:
    """The dense bf16 Gluon decode of the same batch over every cached token (the peer sparse
    attention is measured against)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    block_size = 64
    blocks_per = (context + qlen + block_size - 1) // block_size
    blocks = batch * blocks_per
    limits = mla.EngineLimits(
        max_num_seqs=batch,
        max_model_len=blocks_per * block_size,
        max_num_batched_tokens=batch * qlen,
        max_decode_qlen=qlen,
        graph_mode="full",
    )
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, blocks_per)
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32) * qlen
    step = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.cuda(),
        seq_lens=seq,
        block_table=table,
        num_decodes=batch,
        num_decode_tokens=batch * qlen,
        seq_lens_cpu=seq.cpu(),
    )
    dense = mla.MLABackend(
        mla.MLADims(num_heads=heads, softmax_scale=192**-0.5),
        mla.KVCacheSpec(block_size, "bf16", num_blocks=blocks),
        limits,
        provider="gluon",
    )
    cache, _ = _cache("bf16", blocks, block_size, gen)
    q = torch.randn(batch * qlen, heads, L + R, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch * qlen, heads, L, device="cuda", dtype=torch.bfloat16)
    meta = dense.builder.build(step)
    us = bench_graph_us(lambda: dense.impl.forward_decode(meta, q, cache, out=out))
    nbytes = batch * context * (L + R) * 2 + q.numel() * 2 + out.numel() * 2
    flops = 2.0 * batch * qlen * context * heads * (L + R + L)
    return {
        "case": label,
        "impl": "dense gluon bf16",
        "us": us,
        "TB/s": tbps(nbytes, us),
        "TFLOP/s": tflops(flops, us),
    }


def indexer_rows(tokens: int = 8192, heads: int = 64, dim: int = 128) -> list[dict[str, Any]]:
    """The indexer over one prefill of ``tokens`` new tokens (causal), fp8 keys: logits on bf16
    and on fp8 queries, top-k (``torch.topk`` and the Triton threshold top-k)."""
    from mla.providers.triton.indexer import index_scores
    from mla.providers.triton.topk import radix_topk

    gen = torch.Generator(device="cuda").manual_seed(1)
    block_size = 64
    blocks = tokens // block_size
    keys = torch.randn(tokens, dim, generator=gen, device="cuda")
    cache = torch.zeros(blocks, block_size, dim + 4, dtype=torch.uint8, device="cuda")
    values, key_scale = quantize_index_keys(keys)
    flat = cache.view(blocks, block_size * (dim + 4))
    flat[:, : block_size * dim] = values.view(torch.uint8).view(blocks, block_size * dim)
    flat[:, block_size * dim :] = key_scale.view(torch.uint8).view(blocks, block_size * 4)
    q = torch.randn(tokens, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    weights = torch.randn(tokens, heads, generator=gen, device="cuda")
    table_ = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
    indices = torch.empty(tokens, TOPK, dtype=torch.int32, device="cuda")
    call = IndexTopkCall(
        q=q,
        weights=weights,
        index_cache=cache,
        key_dtype=torch.float8_e4m3fn,
        block_table=table_,
        row_request=torch.zeros(tokens, dtype=torch.int32, device="cuda"),
        row_keys=torch.arange(1, tokens + 1, dtype=torch.int32, device="cuda"),
        max_keys=tokens,
        softmax_scale=dim**-0.5,
        topk=TOPK,
        indices=indices,
    )
    scores = torch.empty(tokens, tokens, dtype=torch.float32, device="cuda")
    flops = 2.0 * heads * dim * tokens * (tokens + 1) / 2
    logits_us = bench_graph_us(lambda: index_scores(call, scores))
    q8, w8 = quantize_index_queries(q, weights)
    fp8_call = attrs.evolve(call, q=q8, weights=w8)
    logits_fp8_us = bench_graph_us(lambda: index_scores(fp8_call, scores))
    topk_us = bench_graph_us(lambda: torch.topk(scores, TOPK, dim=1))
    radix_us = bench_graph_us(lambda: radix_topk(scores, indices, k=TOPK, lengths=call.row_keys))
    ref = torch.empty_like(indices)
    get_provider("torch").index_topk(attrs.evolve(call, indices=ref))
    get_provider("triton").index_topk(call)
    same = float(
        sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(indices[::512], ref[::512], strict=True))
        / sum(len({v for v in b.tolist() if v >= 0}) for b in ref[::512])
    )
    return [
        {
            "case": f"indexer-logits-fp8-{tokens}x{heads}",
            "impl": "triton, bf16 q",
            "us": logits_us,
            "TFLOP/s": tflops(flops, logits_us),
            "overlap": same,
        },
        {
            "case": f"indexer-logits-fp8-{tokens}x{heads}",
            "impl": "triton, fp8 q",
            "us": logits_fp8_us,
            "TFLOP/s": tflops(flops, logits_fp8_us),
        },
        {"case": f"indexer-topk-{tokens}", "impl": "torch.topk", "us": topk_us, "overlap": same},
        {"case": f"indexer-topk-{tokens}", "impl": "triton radix_topk", "us": radix_us},
    ]


def dsa_step_rows(batch: int = 64, context: int = 32768, heads: int = 16) -> list[dict[str, Any]]:
    """A whole DSA decode step through the backend (index-key write, fp8 indexer over the
    context on fp8 index queries, top-k, fp8_ds_mla sparse decode) against the dense bf16
    decode of the same batch. The index queries are quantized outside the step (DeepSeek-V3.2's
    model quantizes them after its q projection)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    block_size = 64
    blocks_per = context // block_size
    blocks = batch * blocks_per
    limits = mla.EngineLimits(
        max_num_seqs=batch, max_model_len=context, max_num_batched_tokens=batch, graph_mode="full"
    )
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, blocks_per)
    seq = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    step = mla.StepInputs(
        query_start_loc_cpu=qsl,
        query_start_loc=qsl.cuda(),
        seq_lens=seq,
        block_table=table,
        num_decodes=batch,
        num_decode_tokens=batch,
        seq_lens_cpu=seq.cpu(),
    )
    slots = (table[:, -1].long() * block_size + block_size - 1).contiguous()
    q = torch.randn(batch, heads, L + R, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, L, device="cuda", dtype=torch.bfloat16)
    rows: list[dict[str, Any]] = []

    sparse_dims = mla.MLADims(num_heads=heads, softmax_scale=192**-0.5, index_topk=TOPK)
    spec = mla.IndexerSpec(num_heads=64, head_dim=128, key_dtype="fp8")
    sparse = mla.MLABackend(
        sparse_dims,
        mla.KVCacheSpec(block_size, "fp8_ds_mla", num_blocks=blocks),
        limits,
        indexer=spec,
        provider="gluon",
    )
    cache, _ = _cache("fp8_ds_mla", blocks, block_size, gen)
    index_cache = torch.zeros(blocks, block_size, spec.row_width, dtype=torch.uint8, device="cuda")
    index_cache.view(-1)[:] = torch.randint(0, 120, (index_cache.numel(),), generator=gen, device="cuda").to(
        torch.uint8
    )
    index_cache.view(blocks, -1)[:, block_size * 128 :].view(torch.float32).fill_(1.0 / 64)
    keys = torch.randn(batch, 128, generator=gen, device="cuda")
    index_q, weights = quantize_index_queries(
        torch.randn(batch, 64, 128, generator=gen, device="cuda", dtype=torch.bfloat16),
        torch.randn(batch, 64, generator=gen, device="cuda"),
    )
    topk = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
    meta = sparse.builder.build(step)

    def dsa_step() -> None:
        sparse.impl.write_index_keys(keys, index_cache, slots)
        sparse.impl.index_topk(meta, index_q, weights, index_cache, out=topk)
        sparse.impl.forward_sparse_decode(meta, q, cache, topk, out=out)

    dsa_step()
    dsa_us = bench_graph_us(dsa_step)
    rows.append({"case": f"dsa-step-dsmla-h{heads}-b{batch}-s{context}", "impl": "gluon", "us": dsa_us})
    # The step's parts, each replayed alone (their sum exceeds the step by the launch gaps saved).
    from mla.providers.triton.topk import radix_topk

    score_rows = torch.randn(batch, context, generator=gen, device="cuda")
    parts: dict[str, Callable[[], object]] = {
        "index-key write": lambda: sparse.impl.write_index_keys(keys, index_cache, slots),
        "indexer (scores + top-k)": lambda: sparse.impl.index_topk(
            meta, index_q, weights, index_cache, out=topk
        ),
        "top-k alone (torch.topk)": lambda: torch.topk(score_rows, TOPK, dim=1),
        "top-k alone (radix_topk)": lambda: radix_topk(score_rows, topk, k=TOPK),
        "sparse decode": lambda: sparse.impl.forward_sparse_decode(meta, q, cache, topk, out=out),
    }
    for part, fn in parts.items():
        rows.append({"case": f"dsa-step part: {part}", "impl": "gluon", "us": bench_graph_us(fn)})

    dense = dense_decode_row(
        f"dense-decode-bf16-h{heads}-b{batch}-s{context}", batch=batch, qlen=1, context=context, heads=heads
    )
    rows.append({**dense, "ratio": dsa_us / dense["us"]})
    return rows


SECTIONS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    **{
        case.name: (lambda c=case: attention_rows(c, ("gluon", "triton", "torch")))
        for case in ATTENTION_CASES
    },
    "indexer": indexer_rows,
    "dsa-step": dsa_step_rows,
}


def plot(rows: Sequence[dict[str, Any]], path: str, *, device: str | None = None) -> None:
    """Every timed row but the torch peer's as µs per call (log scale), one bar a row, coloured
    by implementation. ``device``: the title's device (default: this machine's GPU), for a plot
    drawn later from a run's ``--json`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "us" in r and r.get("impl") != "torch"]
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, max(4.0, 0.3 * len(timed) + 1.2)))
    for i, r in enumerate(timed):
        ax.barh(i, r["us"], color=colours(impls.index(r["impl"])), label=r["impl"])
    ax.set_yticks(range(len(timed)), [f"{r['case']} · {r['impl']}" for r in timed], fontsize=7)
    ax.invert_yaxis()
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("µs per call (CUDA-graph replay), lower is better")
    ax.set_title(f"mla sparse MLA on {device or gpu_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="run these sections")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--plot", help="write a bar chart to this PNG")
    parser.add_argument(
        "--from-json", help="draw --plot from the rows a run wrote with --json (no GPU needed)"
    )
    parser.add_argument("--device-name", help="the plot title's device (default: this machine's GPU)")
    args = parser.parse_args(argv)
    if args.from_json:
        if not args.plot:
            parser.error("--from-json draws a plot: give --plot PATH")
        with open(args.from_json) as handle:
            plot(json.load(handle), args.plot, device=args.device_name)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict[str, Any]] = []
    for name in args.only or SECTIONS:
        section = SECTIONS[name]()
        print_table(section, title=name)
        rows.extend(section)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    if args.plot:
        plot(rows, args.plot, device=args.device_name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
