#!/usr/bin/env bash
# Run one benchmark command on several commits in a single GPU call (A/B of kernel variants on branches).
#
#   here:    bash scripts/bench_revs.sh stage REV...     # revs/<REV>/: that commit's ds4trt/, scripts/, tests/ and
#                                                         # pyproject.toml (so that pytest run there takes the
#                                                         # commit's tree as its rootdir and imports its ds4trt)
#   device:  bash scripts/bench_revs.sh run 'python3 scripts/bench_kernels.py --cases moe --no-sweep'
#            (carry [".whl", "revs"]: both folders are ignored by git)
#
# `run` installs the carried wheels into /tmp/site, then runs the command in each revs/<REV>/ in turn with
# PYTHONPATH pointing at it, and writes one log per commit to $OUT/<REV>.log (the device tool brings back only a
# few files, so the command should not write more of its own) and the last lines of each to stdout.
# ROUNDS=N runs the commits N times, in reverse order every second round (A B, B A, ...: timings drift within a
# call by about as much as small changes gain), logs $OUT/<REV>.r<round>.log.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
case "$1" in
stage)
    shift
    [ $# -gt 0 ] || { echo "bench_revs.sh stage: name at least one commit"; exit 2; }
    rm -rf revs
    for rev in "$@"; do
        dir="revs/$(git rev-parse --short "$rev")" || exit 2
        mkdir -p "$dir" && git archive "$rev" ds4trt scripts tests pyproject.toml | tar -x -C "$dir" || exit 2
        echo "$rev -> $dir"
    done
    ;;
run)
    [ -n "$2" ] || { echo "bench_revs.sh run: give the command to run in each commit's tree"; exit 2; }
    ls -d revs/*/ >/dev/null 2>&1 || { echo "bench_revs.sh run: no revs/ (stage first, and carry it)"; exit 2; }
    OUT="${OUT:-/tmp/ds4trt_revs}"
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
    status=0
    rounds=${ROUNDS:-1}
    dirs=$(ls -d revs/*/)
    for round in $(seq 1 "$rounds"); do
        order=$dirs
        [ $((round % 2)) -eq 0 ] && order=$(echo "$dirs" | tac)
        for dir in $order; do
            rev=$(basename "$dir")
            log="$OUT/$rev.log" && [ "$rounds" -gt 1 ] && log="$OUT/$rev.r$round.log"
            (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" bash -c "$2") > "$log" 2>&1
            rc=$?
            [ $rc -eq 0 ] || status=1
            echo "== $rev (rc $rc)$([ "$rounds" -gt 1 ] && echo ", round $round")"
            tail -n "${TAIL:-12}" "$log"
        done
    done
    exit $status
    ;;
*)
    echo "usage: bash scripts/bench_revs.sh stage REV... | run 'COMMAND'"
    exit 2
    ;;
esac
