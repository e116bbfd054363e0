"""The functional API under ``torch.compile``: ``mla.write_kv``, ``mla.mla_decode`` and
``mla.mla_prefill`` in a compiled function are one custom op each (``mla::functional_*``).

Toy layers (projection -> write_kv -> decode, projection -> prefill) compiled with
``fullgraph=True`` must match eager, have no graph break and compile once over calls whose
tensors hold other values (``seq_lens``, ``cu_seqlens``, block tables, slots). Eager calls do not
go through the ops, and a bad argument still raises the eager call's ``InvalidInputError``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import mla
from mla.core.platform import resolve_platform
from mla.providers import resolve_provider
from mla.tools.reference import reference_decode

RANK, ROPE, HEADS, HIDDEN = 64, 16, 4, 32
NOPE, VDIM = 24, 32
BLOCK, NUM_BLOCKS = 16, 12
SCALE = 0.125
FP8_SCALE = 0.05
FUNCTIONAL_OPS = {
    "mla.functional_decode.default",
    "mla.functional_prefill.default",
    "mla.functional_write_kv.default",
}


class DecodeLayer(nn.Module):
    """q/kv projection -> ``mla.write_kv`` -> ``mla.mla_decode`` -> output projection."""

    def __init__(self, *, kv_scale: float | torch.Tensor | None = None, **options: Any) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * (RANK + ROPE))
        self.kv_proj = nn.Linear(HIDDEN, RANK + ROPE)
        self.o_proj = nn.Linear(HEADS * RANK, HIDDEN)
        self.kv_scale = kv_scale
        self.options = {"softmax_scale": SCALE, "kv_lora_rank": RANK, "provider": "torch", **options}

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, HEADS, RANK + ROPE)
        kv = self.kv_proj(x)
        mla.write_kv(
            kv[:, :RANK],
            kv[:, RANK:],
            kv_cache,
            slots,
            kv_scale=self.kv_scale,
            provider=self.options["provider"],
        )
        result = mla.mla_decode(
            q, kv_cache, block_table, seq_lens, query_start_loc=query_start_loc, kv_scale=self.kv_scale,
            out=out, lse=lse, **self.options,
        )  # fmt: skip
        attention, lse_out = result if isinstance(result, tuple) else (result, None)
        return self.o_proj(attention.reshape(tokens, HEADS * RANK)), lse_out


class PrefillLayer(nn.Module):
    """q/k/v projection -> ``mla.mla_prefill`` -> output projection."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE))
        self.k_proj = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE))
        self.v_proj = nn.Linear(HIDDEN, HEADS * VDIM)
        self.o_proj = nn.Linear(HEADS * VDIM, HIDDEN)
        self.options = {"softmax_scale": SCALE, "provider": "torch", **options}

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, HEADS, NOPE + ROPE)
        k = self.k_proj(x).view(tokens, HEADS, NOPE + ROPE)
        v = self.v_proj(x).view(tokens, HEADS, VDIM)
        result = mla.mla_prefill(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, out=out, **self.options
        )
        attention, lse = result if isinstance(result, tuple) else (result, None)
        return self.o_proj(attention.reshape(tokens, HEADS * VDIM)), lse


def _decode_call(
    seq_lens: list[int], qlens: list[int] | None, seed: int, *, outputs: bool = False
) -> dict[str, Any]:
    """One decode call's inputs: each request's new tokens are its last ``qlen`` positions."""
    gen = torch.Generator().manual_seed(seed)
    lens = qlens or [1] * len(seq_lens)
    tokens = sum(lens)
    width = 4
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: len(seq_lens) * width].view(-1, width).to(torch.int32)
    slots = [
        int(table[b, pos // BLOCK]) * BLOCK + pos % BLOCK
        for b, (seq, qlen) in enumerate(zip(seq_lens, lens, strict=True))
        for pos in range(seq - qlen, seq)
    ]
    call: dict[str, Any] = {
        "x": torch.randn(tokens, HIDDEN, generator=gen),
        "block_table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "slots": torch.tensor(slots),
    }
    if qlens is not None:
        call["query_start_loc"] = torch.tensor(
            [0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32
        )
    if outputs:
        call["out"] = torch.full((tokens, HEADS, RANK), math.nan)
        call["lse"] = torch.full((tokens, HEADS), math.nan)
    return call


def _cache(kv_dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(NUM_BLOCKS, BLOCK, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    return (values / FP8_SCALE).clamp(-448, 448).to(kv_dtype) if kv_dtype.itemsize == 1 else values


def _op_names(graph_module: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"]


def _assert_one_graph(layer: nn.Module, args: dict[str, Any], ops: list[str]) -> None:
    """Compiled once with no recompile; no graph break; the graph calls the functional ops
    ``ops`` (``"decode"``, ...) once each and no other."""
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    explanation = torch._dynamo.explain(layer)(**args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    (graph,) = explanation.graphs
    functional = sorted(name for name in _op_names(graph) if name in FUNCTIONAL_OPS)
    assert functional == sorted(f"mla.functional_{name}.default" for name in ops), _op_names(graph)


DECODE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # id: (layer options, call options)
    "fresh-outputs": ({}, {}),
    "out-only": ({"return_lse": False}, {}),
    "given-outputs-multi-token": ({}, {"qlens": [2, 1, 3], "outputs": True}),
    "fp8-float-scale": ({"kv_scale": FP8_SCALE, "kv_dtype": torch.float8_e4m3fn}, {}),
    "fp8-tensor-scale": ({"kv_scale": torch.tensor(FP8_SCALE), "kv_dtype": torch.float8_e4m3fn}, {}),
    "full-validation": ({"validate": "full"}, {}),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_compiled_write_kv_and_decode_match_eager_in_one_graph(case: str) -> None:
    layer_options, call_options = DECODE_CASES[case]
    layer_options = dict(layer_options)
    kv_dtype = layer_options.pop("kv_dtype", torch.float32)
    torch.manual_seed(0)
    layer = DecodeLayer(**layer_options)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager_cache, compiled_cache = _cache(kv_dtype), _cache(kv_dtype)
    qlens = call_options.get("qlens")
    outputs = bool(call_options.get("outputs"))
    # The same shapes, other values: the compiled layer must not recompile.
    for index, lens in enumerate(([20, 37, 5], [33, 9, 48])):
        expected_args = _decode_call(lens, qlens, seed=index, outputs=outputs)
        got_args = _decode_call(lens, qlens, seed=index, outputs=outputs)
        with torch.no_grad():
            expected, expected_lse = layer(kv_cache=eager_cache, **expected_args)
            got, got_lse = compiled(kv_cache=compiled_cache, **got_args)
        torch.testing.assert_close(got, expected, msg=f"call {index}")
        assert (got_lse is None) == (expected_lse is None) == (layer.options.get("return_lse") is False)
        if got_lse is not None:
            torch.testing.assert_close(got_lse, expected_lse, msg=f"lse of call {index}")
        if outputs:
            torch.testing.assert_close(got_args["out"], expected_args["out"])
            assert got_lse is not None
            assert got_lse.data_ptr() == got_args["lse"].data_ptr()  # written in place
        torch.testing.assert_close(
            compiled_cache.float(), eager_cache.float(), msg=f"cache after call {index}"
        )
    args = _decode_call([20, 37, 5], qlens, seed=0, outputs=outputs)
    with torch.no_grad():
        _assert_one_graph(layer, {"kv_cache": compiled_cache.clone(), **args}, ["decode", "write_kv"])


def test_compiled_decode_computes_the_reference() -> None:
    """The compiled call's outputs are the attention itself, not only what eager computes."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, HEADS, RANK + ROPE, generator=gen)
    cache = _cache(torch.float32)
    table = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32)

    def decode(q: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mla.mla_decode(
            q, cache, table, seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK, provider="torch"
        )

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    for lens in ([20, 37], [48, 1]):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        out, lse = compiled(q, seq_lens)
        ref_out, ref_lse = reference_decode(q, cache, table, seq_lens, softmax_scale=SCALE, kv_lora_rank=RANK)
        torch.testing.assert_close(out, ref_out.to(out.dtype), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse, ref_lse.to(lse.dtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", [{}, {"return_lse": False}, {"out": True}, {"causal": False}], ids=str)
def test_compiled_prefill_matches_eager_in_one_graph(options: dict[str, Any]) -> None:
    options = dict(options)
    give_out = options.pop("out", False)
    torch.manual_seed(0)
    layer = PrefillLayer(**options)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(2)
    tokens, max_seqlen = 10, 8
    for index, cu in enumerate(([0, 4, 10], [0, 7, 10], [0, 2, 10])):
        args: dict[str, Any] = {
            "x": torch.randn(tokens, HIDDEN, generator=gen),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "max_seqlen": max_seqlen,
        }
        expected_out = torch.full((tokens, HEADS, VDIM), math.nan) if give_out else None
        got_out = torch.full((tokens, HEADS, VDIM), math.nan) if give_out else None
        with torch.no_grad():
            expected, expected_lse = layer(out=expected_out, **args)
            got, got_lse = compiled(out=got_out, **args)
        torch.testing.assert_close(got, expected, msg=f"call {index}")
        if got_out is not None:
            torch.testing.assert_close(got_out, expected_out)
        assert (got_lse is None) == (expected_lse is None) == (options.get("return_lse") is False)
        if got_lse is not None:
            torch.testing.assert_close(got_lse, expected_lse, msg=f"lse of call {index}")
    with torch.no_grad():
        _assert_one_graph(layer, {**args, "out": got_out}, ["prefill"])


def test_compiled_decode_with_provider_and_platform_objects() -> None:
    """Options that are objects cross the op as one handle: the graph is the same op."""
    platform = resolve_platform("cpu", "cpu")
    layer = DecodeLayer(provider=resolve_provider("torch", platform), platform=platform)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    cache = _cache(torch.float32)
    for index, lens in enumerate(([20, 37, 5], [33, 9, 48])):
        args = _decode_call(lens, None, seed=index)
        with torch.no_grad():
            expected, _ = layer(kv_cache=cache.clone(), **args)
            got, _ = compiled(kv_cache=cache.clone(), **args)
        torch.testing.assert_close(got, expected)
    with torch.no_grad():
        _assert_one_graph(layer, {"kv_cache": cache.clone(), **args}, ["decode", "write_kv"])


def test_compiled_decode_layer_with_inductor() -> None:
    """Inductor (what a GPU engine compiles with) reinplaces the ops' mutations of the cache."""
    torch.manual_seed(0)
    layer = DecodeLayer()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    eager_cache, compiled_cache = _cache(torch.float32), _cache(torch.float32)
    for index, lens in enumerate(([20, 37, 5], [33, 9, 48])):
        args = _decode_call(lens, None, seed=index)
        with torch.no_grad():
            expected, expected_lse = layer(kv_cache=eager_cache, **args)
            got, got_lse = compiled(kv_cache=compiled_cache, **args)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_lse, expected_lse)
        torch.testing.assert_close(compiled_cache, eager_cache)


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_do_not_go_through_the_functional_ops() -> None:
    args = _decode_call([20, 37, 5], None, seed=0)
    layer = DecodeLayer()
    with _OpRecorder() as recorder, torch.no_grad():
        layer(kv_cache=_cache(torch.float32), **args)
        PrefillLayer()(args["x"], torch.tensor([0, 1, 3], dtype=torch.int32), 2)
    assert "mla.write_kv.default" in recorder.names  # the engine op the eager call runs
    assert not recorder.names & FUNCTIONAL_OPS


@pytest.mark.parametrize(
    ("argument", "change"),
    [
        ("q", {"seq_lens": torch.tensor([20, 37], dtype=torch.int32)}),
        ("block_table", {"block_table": torch.zeros(3, 4)}),
        ("slot_mapping", {"slots": torch.tensor([1, 2])}),
    ],
)
def test_a_compiled_call_raises_the_eager_error(argument: str, change: dict[str, Any]) -> None:
    """The op's body is the eager call: bad values and shapes raise its typed error."""
    torch._dynamo.reset()
    compiled = torch.compile(DecodeLayer(), fullgraph=True, backend="aot_eager")
    args = {**_decode_call([20, 37, 5], None, seed=0), **change}
    with pytest.raises(mla.InvalidInputError) as info, torch.no_grad():
        compiled(kv_cache=_cache(torch.float32), **args)
    assert info.value.argument == argument


@pytest.mark.parametrize(
    ("argument", "options"), [("softmax_scale", {"softmax_scale": -1.0}), ("graph", {"graph": "on"})]
)
def test_a_compiled_call_checks_its_options(argument: str, options: dict[str, Any]) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(DecodeLayer(**options), fullgraph=True, backend="aot_eager")
    with pytest.raises(mla.InvalidInputError) as info, torch.no_grad():
        compiled(kv_cache=_cache(torch.float32), **_decode_call([20, 37, 5], None, seed=0))
    assert info.value.argument == argument


def test_an_argument_the_op_cannot_take_is_left_to_the_eager_call() -> None:
    """A wrong kind (here a str softmax_scale) is not traced: without ``fullgraph`` the eager
    call runs at a graph break and names it."""
    torch._dynamo.reset()
    compiled = torch.compile(DecodeLayer(softmax_scale="0.1"), backend="aot_eager")
    with pytest.raises(mla.InvalidInputError) as info, torch.no_grad():
        compiled(kv_cache=_cache(torch.float32), **_decode_call([20, 37, 5], None, seed=0))
    assert info.value.argument == "softmax_scale"


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["triton", "gluon"])
def test_compiled_functional_calls_on_the_gpu(provider: str) -> None:
    """DeepSeek's shapes on the GPU kernels (512/64 latent in 64-token blocks, 192/128 prefill):
    ``write_kv`` + ``mla_decode`` and ``mla_prefill`` compiled with ``fullgraph=True`` (inductor)
    give the eager outputs with no graph break and one graph over calls with other lengths."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not mla.get_provider(provider).availability():
        pytest.skip(f"{provider} is unavailable here")
    rank, rope, heads, block, blocks = 512, 64, 16, 64, 40
    gen = torch.Generator(device="cuda").manual_seed(0)

    def decode_step(
        q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        mla.write_kv(kv[:, :rank], kv[:, rank:], cache, slots, provider=provider)
        return mla.mla_decode(
            q, cache, table, lens, softmax_scale=0.07, kv_lora_rank=rank, provider=provider, return_lse=False
        )

    def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        return mla.mla_prefill(
            q, k, v, cu, cu, 1024, 1024, softmax_scale=192**-0.5, provider=provider, return_lse=False
        )

    torch._dynamo.reset()
    counters.clear()
    compiled_decode = torch.compile(decode_step, fullgraph=True)
    compiled_prefill = torch.compile(prefill, fullgraph=True)
    table = torch.randperm(blocks, generator=gen, device="cuda")[:32].view(4, 8).to(torch.int32)
    eager_cache = torch.randn(blocks, block, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
    compiled_cache = eager_cache.clone()
    for lens_list in ([300, 17, 512, 64], [40, 500, 129, 1]):
        lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
        last = [n - 1 for n in lens_list]  # each request's new token is its last position
        slots = torch.stack([table[b, p // block].long() * block + p % block for b, p in enumerate(last)])
        q = torch.randn(4, heads, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
        kv = torch.randn(4, rank + rope, generator=gen, device="cuda").to(torch.bfloat16)
        expected = decode_step(q, kv, eager_cache, table, lens, slots)
        got = compiled_decode(q, kv, compiled_cache, table, lens, slots)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(compiled_cache, eager_cache)
        tokens = 812  # two requests, split differently per call
        cu = torch.tensor([0, lens_list[0], tokens], dtype=torch.int32, device="cuda")
        pq = torch.randn(tokens, heads, 192, generator=gen, device="cuda").to(torch.bfloat16)
        pk = torch.randn(tokens, heads, 192, generator=gen, device="cuda").to(torch.bfloat16)
        pv = torch.randn(tokens, heads, 128, generator=gen, device="cuda").to(torch.bfloat16)
        torch.testing.assert_close(compiled_prefill(pq, pk, pv, cu), prefill(pq, pk, pv, cu))
    assert not counters["recompiles"], dict(counters["recompiles"])
    explained = torch._dynamo.explain(decode_step)(q, kv, compiled_cache, table, lens, slots)
    assert explained.graph_break_count == 0, explained.break_reasons
    explained = torch._dynamo.explain(prefill)(pq, pk, pv, cu)
    assert explained.graph_break_count == 0, explained.break_reasons
