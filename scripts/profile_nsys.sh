#!/usr/bin/env bash
# Profile a ds4-run with Nsight Systems: CUDA kernels, NVTX phase ranges (prefill, decode, draft, verify,
# accept, commit from ds4trt/runtime/profile.py), CUDA API calls and graph launches.
# Usage: scripts/profile_nsys.sh OUT_NAME ds4-run-arguments...
#   e.g. scripts/profile_nsys.sh demo --raw -p 'def main():' --glm-mtp --mtp-margin 0 -n 64
# Then: nsys stats OUT_NAME.nsys-rep   (or open it in the Nsight Systems GUI)
set -euo pipefail
out=${1:?usage: $0 OUT_NAME ds4-run-arguments...}
shift
exec nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node --sample=none --force-overwrite=true \
    --output="$out" ds4-run "$@"
