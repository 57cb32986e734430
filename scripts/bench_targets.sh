#!/usr/bin/env bash
# Issue 5's targets in one GPU call, at Flash width: decode and verify of 2 and 3 rows (`--compile`, CUDA graphs), a
# 2048-token prompt prefilled in one chunk as sessions do (the chunk's CUDA graph), eagerly (DS4_GRAPH_PREFILL=0: the
# host's pace shows in host_ms) and with DS4_COMPILE_PREFILL=1 (whole chunks through the compiled blocks), with the
# device memory of each; over 43 layers, or 28 on a card under 100 GiB (43 do not fit there).
#
#   bash scripts/bench_targets.sh [TREE]      # TREE: a tree staged by scripts/bench_revs.sh (default: this checkout)
#
# Each command gets the time left of LIMIT seconds (default 570, one device call), so the call returns what ran; the
# lines printed are the card (its power limit and SM clocks) and bench_decode.py's results, whose first line of each
# run gives the card's copy bandwidth and bfloat16 product rate: the prefill is compute-bound, and two H100s with the
# same limit and clocks at rest prefilled 1.49x apart (BENCHMARKS.md, the sixtieth session), which only the product
# rate shows. Carried wheels (.whl, ../shared/tools/gpu_wheels.sh) are installed into /tmp/site first where present.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
START=$(date +%s)
LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - ($(date +%s) - START))); }
command -v nvidia-smi >/dev/null || { echo "bench_targets.sh: needs a CUDA GPU (nvidia-smi not found)"; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cd "${1:-.}" || exit 2
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm,clocks.sm --format=csv
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=43
[ "$mem" -lt 100000 ] && layers=28
echo "layers $layers, tree $PWD"
run() {
    local t=$(($(left) - 10))
    [ $t -gt 30 ] || { echo "skipped (no time left): $*"; return; }
    echo "== $* (at most $t s)"
    timeout $t "$@" 2>&1 | grep -E '^\[.*(decode|verify|prefill|memory|bandwidth)|Error' | tail -n 12
}
run python3 scripts/bench_decode.py --layers $layers --prefill 256 --chunk 256 --repeats 100 --compile --ctx 4096 \
    --verify 2,3
run python3 scripts/bench_decode.py --layers $layers --prefill 2048 --chunk 2048 --repeats 5 --verify ''
run env DS4_GRAPH_PREFILL=0 python3 scripts/bench_decode.py --layers $layers --prefill 2048 --chunk 2048 --repeats 5 \
    --verify ''
run env DS4_COMPILE_PREFILL=1 python3 scripts/bench_decode.py --layers $layers --prefill 2048 --chunk 2048 \
    --repeats 5 --verify '' --compile
echo "total $(($(date +%s) - START)) s"
