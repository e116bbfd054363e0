#!/usr/bin/env bash
# One device session on the H200 (run through the device tool from the repository root):
# the GPU-marked tests, the demo on the auto provider, both benchmarks (decode: gluon, triton and
# vLLM side by side, plot to $OUT/decode-h200.png, copy it to docs/img/), and compute-sanitizer
# memcheck on decode and prefill subsets plus memcheck and racecheck on Gluon decode. Each part has its own time
# limit so one slow part cannot starve the others; logs go to $OUT (or /tmp/mla-h200).
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# The GPU machine installs nothing from a registry: the test extra's pure-Python wheels the image
# lacks (allpairspy) travel in .whl/ (pip download --no-deps -d .whl allpairspy) and go on the path.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
OUT="${OUT:-/tmp/mla-h200}"
mkdir -p "$OUT"
part() { echo; echo "=== $1 ==="; }

part "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

part "GPU tests"
timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4

part "mla demo (auto provider)"
timeout 60 python3 -m mla demo --steps 32 2>&1 | tee "$OUT/demo.log" | tail -14

part "decode benchmark"
timeout 240 python3 benchmarks/decode.py --no-torch --json "$OUT/decode.json" --plot "$OUT/decode-h200.png" \
  --vllm-decode .peers/vllm_triton_decode_attention.py 2>&1 | tee "$OUT/decode.log" | tail -44

part "host overhead (mla_decode, builder.build)"
timeout 60 python3 benchmarks/overhead.py 2>&1 | tee "$OUT/overhead.log" | tail -12

part "prefill benchmark"
timeout 75 python3 benchmarks/prefill.py --check 2>&1 | tee "$OUT/prefill.log" | tail -16

part "compute-sanitizer memcheck: decode"
timeout 50 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider \
  "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[asm-padded-persistent-h12-q3-bs16-bf16-triton]" \
  "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[gluon-verify-flatten-h12-q3-bs16-fp8-triton]" \
  "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[asm-non-persistent-h8-q2-bs1-bf16-triton]" \
  2>&1 | tee "$OUT/sanitizer_decode.log" | tail -4

part "compute-sanitizer memcheck + racecheck: Gluon decode"
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool python3 -m pytest -q -p no:cacheprovider \
    "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[asm-padded-persistent-h12-q3-bs16-bf16-gluon]" \
    "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[asm-non-persistent-h8-q2-bs1-bf16-gluon]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-auto-fp8]" \
    2>&1 | tee "$OUT/sanitizer_gluon_$tool.log" | tail -4
done

part "compute-sanitizer memcheck: prefill"
timeout 50 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider \
  tests/triton/test_gpu_prefill.py -k "mixed and (dtype0-True or 128-True)" \
  2>&1 | tee "$OUT/sanitizer_prefill.log" | tail -4
