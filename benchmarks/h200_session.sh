#!/usr/bin/env bash
# One device session on the H200, in parts that each fit one device call (10 minutes), run from
# the repository root through the device tool:
#
#   bash benchmarks/h200_session.sh tests1      # GPU tests: tests/gluon and tests/triton (~4 min)
#   bash benchmarks/h200_session.sh tests2      # GPU tests: everything else (~4 min)
#   bash benchmarks/h200_session.sh bench       # demo, decode (plot), host overhead (~4 min)
#   bash benchmarks/h200_session.sh prefill     # prefill benchmark, checked, three rounds (plot) (~5 min)
#   bash benchmarks/h200_session.sh sparse      # sparse MLA: GPU tests, demo --sparse, benchmark (~7 min)
#   bash benchmarks/h200_session.sh sanitizer   # compute-sanitizer memcheck/racecheck subsets (~3 min)
#   bash benchmarks/h200_session.sh sanitizer-sparse-prefill  # memcheck: sparse and prefill subsets (~3 min)
#   bash benchmarks/h200_session.sh breakdown   # per-kernel Gluon decode times (~8 min)
#   bash benchmarks/h200_session.sh pingpong    # racecheck of the ping-pong kernel and the probes (~4 min)
#   bash benchmarks/h200_session.sh dual        # the dual-chain fp8 kernel: tests, sanitizers, timing (~3 min)
#   bash benchmarks/h200_session.sh profile     # Nsight Compute: the dual-chain kernel's stalls, per instruction (~1 min)
#   bash benchmarks/h200_session.sh whatif      # the dual-chain kernel with pieces of work taken out, and candidates (~8 min)
#   bash benchmarks/h200_session.sh whatif-other  # the same for the ping-pong and few-rows kernels (~5 min)
#   bash benchmarks/h200_session.sh power       # which decode cases run into the 700 W power cap (~8 min)
#   bash benchmarks/h200_session.sh fold        # the split reduce folded into the few-rows kernel: tests, sanitizers, timing (~4 min)
#   bash benchmarks/h200_session.sh prefill-race  # the Gluon prefill's layouts under Triton's concurrency sanitizer (~8 min)
#   bash benchmarks/h200_session.sh bounds      # the sparse decode kernels with one piece of work taken out, the row gather (~4 min)
#   bash benchmarks/h200_session.sh profile-kernels  # Nsight Compute: the sparse 16-row and 64-row kernels, the persistent prefill (~3 min)
#
# The bench part runs the user-facing benchmarks (python3 -m benchmarks NAME); the breakdown,
# pingpong, dual, profile, whatif, whatif-other, power, fold, prefill-race, bounds and profile-kernels parts run
# kernel-research probes (python3 -m probes.NAME, probes/README.md).
# Logs go to $OUT (or /tmp/mla-h200); the decode and prefill plots to $OUT/decode-h200.png and
# $OUT/prefill-h200.png (copy them to docs/img/). Each part has its own time limits so one slow
# step cannot starve the others.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# The GPU machine installs nothing from a registry: the test extra's pure-Python wheels the image
# lacks (allpairspy) travel in .whl/ (pip download --no-deps -d .whl allpairspy) and go on the path.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH="$PWD:/tmp/site"
fi
OUT="${OUT:-/tmp/mla-h200}"
mkdir -p "$OUT"
part() { echo; echo "=== $1 ($(date -u +%H:%M:%S) UTC) ==="; }
summary() { grep -E "^E  |^FAILED|^ERROR|passed|failed" | head -30; }
# sanitize NAME TOOLS TEST...: each compute-sanitizer tool over the given pytest ids, its log in
# $OUT/sanitizer_NAME_TOOL.log, the summaries (counted) on the console.
sanitize() {
  local name=$1 tools=$2
  shift 2
  for tool in $tools; do
    part "compute-sanitizer $tool: $name"
    timeout "${SANITIZE_TIMEOUT:-100}" compute-sanitizer --tool "$tool" python3 -m pytest -q -p no:cacheprovider "$@" \
      2>&1 | tee "$OUT/sanitizer_${name}_$tool.log" | grep -v "^=========     at " \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race reported|passed|failed" | sort | uniq -c | head -20
  done
}

part "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1 2>/dev/null

case "${1:-}" in
tests1)
  part "GPU tests: tests/gluon tests/triton"
  timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/gluon tests/triton \
    2>&1 | tee "$OUT/gpu_tests1.log" | summary
  ;;
tests2)
  part "GPU tests: the rest"
  timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests \
    --ignore=tests/gluon --ignore=tests/triton 2>&1 | tee "$OUT/gpu_tests2.log" | summary
  ;;
bench)
  part "mla demo (auto provider)"
  timeout 60 python3 -m mla demo --steps 32 2>&1 | tee "$OUT/demo.log" | tail -3
  part "decode benchmark"
  vllm=()
  if [ -f .peers/vllm_triton_decode_attention.py ]; then vllm=(--vllm-decode .peers/vllm_triton_decode_attention.py); fi
  timeout 240 python3 -m benchmarks decode --no-torch --json "$OUT/decode.json" --plot "$OUT/decode-h200.png" \
    "${vllm[@]}" 2>&1 | tee "$OUT/decode.log" | grep -v "^{" | tail -50
  part "host overhead (mla_decode, builder.build)"
  timeout 100 python3 -m benchmarks overhead 2>&1 | tee "$OUT/overhead.log" | grep -E "^\||launch cache" | tail -9
  ;;
prefill)
  part "prefill benchmark (three rounds; the chunked-context section last)"
  timeout 480 python3 -m benchmarks prefill --check --out "$OUT/prefill.json" --plot "$OUT/prefill-h200.png" \
    2>&1 | tee "$OUT/prefill.log" | tail -48
  ;;
sparse)
  part "sparse GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/triton/test_sparse_triton.py \
    tests/test_sparse_gpu.py tests/test_sparse_kit.py tests/test_sparse_lengths_gpu.py 2>&1 \
    | tee "$OUT/gpu_sparse.log" | summary
  part "mla demo --sparse"
  timeout 60 python3 -m mla demo --sparse --kv-dtype fp8_ds_mla --index-dtype fp8 --steps 24 --quiet \
    2>&1 | tee "$OUT/demo_sparse.log" | tail -3
  sanitize sparse memcheck -m gpu tests/triton/test_sparse_triton.py \
    -k "(test_gpu_sparse_attention and triton and h16) or (test_gpu_index_topk and triton) or test_gpu_writes"
  part "sparse benchmark"
  timeout 240 python3 -m benchmarks sparse --json "$OUT/sparse.json" --plot "$OUT/sparse-h200.png" \
    2>&1 | tee "$OUT/sparse.log" | tail -45
  ;;
sanitizer)
  sanitize decode "memcheck racecheck" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-auto-fp8]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q2-bs16-splits3-fp8]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h12-q3-bs16-auto-fp8]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-auto-bf16]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h12-q3-bs16-auto-bf16]" \
    "tests/triton/test_gpu_decode.py::test_strategy_on_gpu[asm-non-persistent-h8-q2-bs1-bf16-triton]"
  ;;
sanitizer-sparse-prefill)
  sanitize sparse memcheck \
    "tests/gluon/test_gpu_sparse_ds_mla.py::test_ds_mla_kernel_matches_the_reference[b1-q1-h16-auto]" \
    "tests/gluon/test_gpu_sparse_ds_mla.py::test_ds_mla_kernel_matches_the_reference[b4-q2-h8-overlap-splits3]" \
    "tests/test_sparse_gpu.py::test_gpu_engine_step_matches_the_reference[gluon-fp8_ds_mla-h8]" \
    "tests/test_sparse_gpu.py::test_gpu_engine_step_matches_the_reference[triton-bf16-h64]" \
    "tests/test_sparse_gpu.py::test_gpu_indexer_matches_the_reference[gluon-bf16-keys]"
  sanitize prefill memcheck \
    "tests/gluon/test_gpu_gluon_prefill.py::test_prefill_matches_reference[True-mixed-16-split]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_prefill_matches_reference[False-sk-lt-sq-1-split]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_nan_key_stays_in_the_rows_that_see_it[provider-True]" \
    "tests/gluon/test_gpu_gluon_fp8_prefill.py::test_fp8_prefill_matches_reference[True-mixed-16-split]" \
    "tests/gluon/test_gpu_gluon_fp8_prefill.py::test_default_provider_plans_and_runs_the_gluon_kernel[True]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_prefill_matches_reference[True-mixed-16-overlap]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_prefill_matches_reference[False-sk-lt-sq-1-overlap]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_every_launch_variant_matches_reference[True-long-split-fp16]" \
    "tests/gluon/test_gpu_gluon_prefill.py::test_nan_key_stays_in_the_rows_that_see_it[PRODUCER-False]" \
    "tests/triton/test_gpu_prefill.py::test_varlen_matches_reference[dtype0-True-long]" \
    "tests/triton/test_gpu_prefill.py::test_fp8_prefill_matches_reference[128-True-long]"
  ;;
pingpong)
  part "compute-sanitizer racecheck: the ping-pong kernel"
  timeout 150 compute-sanitizer --tool racecheck python3 -m pytest -q -p no:cacheprovider \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h12-q3-bs16-pingpong-bf16]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h128-q2-bs64-pingpong-bf16]" \
    2>&1 | tee "$OUT/sanitizer_pingpong.log" | grep -v "^=========     at " | grep -E "RACECHECK SUMMARY|Race reported|Access|passed|failed" | head -30
  part "racecheck probes of the warpgroup hand-off (handoff2*: the prefill split layout's flag hand-off)"
  # (each probe's whole output in $OUT/racecheck_probes.log; both access lines of a hazard here.
  # alternate and ring, whose results are recorded, last)
  : >"$OUT/racecheck_probes.log"
  for mode in "handoff 4" "handoff-ldst 4" "handoff2 4" "handoff2-ldst 4" "handoff2-fence 4" \
    "handoff2-replicated 4" "handoff2-tma 4" "handoff2-tma-apart 4" "alternate 6" "ring 6"; do
    timeout 60 compute-sanitizer --tool racecheck python3 -m probes.ws_mbarrier_probe $mode 2>&1 \
      | tee -a "$OUT/racecheck_probes.log" | grep -E "RACECHECK SUMMARY|Race reported|access at|probe"
  done
  ;;
dual)
  part "GPU tests: the dual-chain kernel's variants"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/gluon/test_gpu_kernels.py -k dual \
    2>&1 | tee "$OUT/dual_tests.log" | summary
  sanitize dual "memcheck racecheck" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-dual-fp8]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-dual-splits3-fp8]"
  part "fp8 timing (the dual-chain kernel, np auto, against the few-rows kernel, rows np)"
  timeout 200 python3 -m probes.gluon_dev --breakdown --only fp8 2>&1 | tee "$OUT/dual_breakdown.log" \
    | grep -v "^{" | tail -20
  ;;
whatif)
  part "the what-if edits still apply (CPU)"
  timeout 120 python3 -m pytest -q -p no:cacheprovider probes/test_probes.py -k "edit or shape" 2>&1 | summary
  part "what-if variants of the dual-chain kernel (probes/whatif.py)"
  timeout 540 python3 -m probes.whatif --kernel dual 2>&1 | tee "$OUT/whatif_dual.log" | grep -v "^{" | tail -44
  ;;
whatif-other)
  part "what-if variants of the ping-pong kernel"
  timeout 200 python3 -m probes.whatif --kernel pingpong 2>&1 | tee "$OUT/whatif_pingpong.log" \
    | grep -v "^{" | tail -18
  part "what-if variants of the few-rows kernel (bf16, B1 S65536 and B64 S4096)"
  timeout 120 python3 -m probes.whatif --kernel rows 2>&1 | tee "$OUT/whatif_rows.log" \
    | grep -v "^{" | tail -12
  ;;
profile)
  part "ncu: the dual-chain kernel at fp8 H16 q1 B128 S8192 (second launch)"
  ncu_args=(--kernel-name regex:mla_decode_dual --launch-skip 1 --launch-count 1)
  timeout 200 ncu "${ncu_args[@]}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section SourceCounters --print-details all \
    python3 -m probes.gluon_dev --once fp8 > "$OUT/ncu_dual.txt" 2>&1
  grep -E "Duration|Issued Warp Per Scheduler|Eligible Warps|Stall (Long|Short) Scoreboard|Stall Barrier" "$OUT/ncu_dual.txt" | head -12
  timeout 200 ncu "${ncu_args[@]}" --section SourceCounters --page source --print-source sass --csv \
    python3 -m probes.gluon_dev --once fp8 > "$OUT/ncu_dual_sass.csv" 2>/dev/null
  python3 -m probes.ncu_stalls "$OUT/ncu_dual_sass.csv" | tee "$OUT/ncu_dual_stalls.txt"
  ;;
bounds)
  part "sparse decode bounds (probes/bounds/, wrong outputs timed on purpose)"
  trees=/tmp/mla-bounds
  python3 -m probes.tree_ab make "$trees" main no-widen=probes/bounds/rows-no-widen.patch \
    no-gather=probes/bounds/rows-no-gather.patch no-mma=probes/bounds/rows-no-mma.patch \
    no-dequant=probes/bounds/heads-no-dequant.patch
  timeout 240 python3 -m probes.tree_ab run sparse-rows "$trees"/{main,no-widen,no-gather,no-mma} --unchecked \
    2>&1 | tee "$OUT/bounds_rows.log" | tail -8
  timeout 150 python3 -m probes.tree_ab run sparse-heads "$trees"/{main,no-dequant} --unchecked \
    2>&1 | tee "$OUT/bounds_heads.log" | tail -9
  part "row gather: cp.async against TMA (probes/row_gather.py)"
  timeout 120 python3 -m probes.row_gather 2>&1 | tee "$OUT/row_gather.log" | tail -8
  ;;
profile-kernels)
  # name regex, then the Python that launches it at least twice (the second launch is profiled)
  profile_kernel() {
    local name=$1 regex=$2 code=$3
    part "ncu: $name (second launch)"
    timeout 120 ncu --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 --kill on \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 -c "$code" > "$OUT/ncu_$name.txt" 2>&1
    grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued" \
      "$OUT/ncu_$name.txt" | head -6
    timeout 120 ncu --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 --kill on \
      --section SourceCounters --page source --print-source sass --csv python3 -c "$code" \
      > "$OUT/ncu_${name}_sass.csv" 2>/dev/null
    python3 -m probes.ncu_stalls "$OUT/ncu_${name}_sass.csv" | tee "$OUT/ncu_${name}_stalls.txt" | head -12
  }
  sparse="from probes.tree_ab import CHILD; import sys; sys.argv = ['x', 'sparse-%s']; exec(CHILD)"
  profile_kernel sparse-rows-h16 mla_decode_ds_mla_kernel "${sparse/\%s/rows}"
  profile_kernel sparse-heads-h128 mla_decode_ds_mla_heads "${sparse/\%s/heads}"
  profile_kernel prefill-persistent-h16-16x1024 mla_prefill_persistent \
    "from benchmarks.prefill import Case; c = Case(16, 16, 1024); c.run_gluon('PERSISTENT'); c.run_gluon('PERSISTENT')"
  ;;
power)
  part "power cap: the Gluon decode (np) after idle and sustained, with SM clock and power"
  timeout 200 python3 -m probes.power 2>&1 | tee "$OUT/power.log" | grep -v "^{" | tail -20
  ;;
fold)
  part "GPU tests: the folded split reduce"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gluon/test_gpu_kernels.py -k fold \
    2>&1 | tee "$OUT/fold_tests.log" | summary
  sanitize fold "memcheck racecheck synccheck" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q1-bs64-fold-bf16]" \
    "tests/gluon/test_gpu_kernels.py::test_paged_decode_variants[h16-q2-bs16-fold-fp8]"
  part "timing: separate reduce against the folded one"
  timeout 240 python3 -m probes.fold --json "$OUT/fold.json" 2>&1 | tee "$OUT/fold.log" | grep -v "^{" | tail -24
  ;;
prefill-race)
  part "the Gluon prefill's layouts under Triton's concurrency sanitizer (probes/prefill_consan.py)"
  for args in "SPLIT 1" "SPLIT 0" "PRODUCER 1" "PERSISTENT 1"; do
    TRITON_INSTRUMENTATION_MODE=consan timeout 240 python3 -m probes.prefill_consan $args 2>&1 \
      | tee -a "$OUT/prefill_consan.log" | tail -4
  done
  ;;
breakdown)
  part "per-kernel breakdown"
  timeout 300 python3 -m probes.gluon_dev --breakdown 2>&1 | tee "$OUT/breakdown.log" | grep -v "^{" | tail -60
  ;;
*)
  echo "usage: bash benchmarks/h200_session.sh tests1|tests2|bench|sparse|sanitizer|sanitizer-sparse-prefill|breakdown|pingpong|dual|profile|whatif|whatif-other|power|fold|prefill-race" >&2
  exit 2
  ;;
esac
