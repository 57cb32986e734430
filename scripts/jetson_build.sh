#!/usr/bin/env bash
# Rebuild the TensorRT engines of an engine directory ON the machine that will run them (Jetson, DGX Spark, any
# NVIDIA GPU), from the ONNX graphs and weights.bin the directory carries.
#
#   scripts/jetson_build.sh DIR [ds4-build TensorRT options]
#   e.g. scripts/jetson_build.sh engines/flash --mtp-draft-max 2 --prefill-chunk 128
#
# Why: a TensorRT plan runs only under the TensorRT version and on the GPU architecture (compute capability)
# that built it; `ds4-run --engines DIR` refuses anything else with one line naming both. Build the ONNX
# directory anywhere (ds4-build --gguf ... --out DIR, CPU is enough), copy DIR to the device, run this there.
#
# What it runs: ds4-build --from-onnx DIR --backend tensorrt (in place; the manifest gets the TensorRT version
# and this GPU's compute capability). Our own build, not trtexec: ds4::MoE is a Python TensorRT plugin
# (tensorrt.plugin, plugins/moe_tensorrt.py) that ds4-build registers; trtexec cannot load a Python plugin.
# The timing cache DIR/timing.cache is reused and updated, so a second build is faster.
#
# Expected software (TensorRT's Python bindings, torch with CUDA, Triton, cuda-bindings in the same Python):
#   Jetson AGX Orin        sm_87  (8.7)   JetPack 6.x (L4T r36): TensorRT 10.x, CUDA 12.x
#                                         (JetPack 6.1: TensorRT 10.3, CUDA 12.6); TensorRT 11 on Orin needs
#                                         JetPack >= 7.2.2 (TensorRT 11.4.1)
#   Jetson Thor            sm_110 (11.0)  JetPack 7.x: CUDA 13.x and the TensorRT it ships (11.x from JetPack 7.2.2)
#   DGX Spark (GB10)       sm_121 (12.1)  DGX OS: CUDA 13.x, TensorRT from the NGC containers or pip
#   x86 + H100/H200        sm_90  (9.0)   pip install tensorrt (10.x or 11.x) with a matching CUDA
# TensorRT 10.1 or later is required (IExecutionContext.set_device_memory, device_memory_size_v2); the plugin's
# namespace attribute is written for 10.3's ONNX parser too. Install cuda-bindings matching the CUDA major
# version (12.x for JetPack 6, 13.x for JetPack 7 / DGX OS).
set -euo pipefail

if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
dir=$1
shift
if [ ! -f "$dir/manifest.json" ]; then
    echo "jetson_build.sh: $dir/manifest.json is missing (expected an engine directory written by ds4-build)" >&2
    exit 1
fi

root=$(cd "$(dirname "$0")/.." && pwd)
python=python3
[ -x "$root/.venv/bin/python" ] && python="$root/.venv/bin/python"

# what this machine has (ds4-build records it in the manifest; ds4-run checks it)
"$python" - <<'EOF' || exit 1
import sys
try:
    import tensorrt
except ImportError:
    sys.exit("jetson_build.sh: import tensorrt failed: install TensorRT's Python bindings (JetPack: python3-libnvinfer)")
import torch
if not torch.cuda.is_available():
    sys.exit("jetson_build.sh: torch sees no CUDA GPU (install the JetPack / CUDA build of torch)")
cc = "{}.{}".format(*torch.cuda.get_device_capability())
print(f"jetson_build.sh: TensorRT {tensorrt.__version__}, {torch.cuda.get_device_name()} (compute capability {cc})")
EOF

# the documented command: our ds4-build (the venv's console script, else the one on PATH, else the module)
if [ -x "$root/.venv/bin/ds4-build" ]; then
    build=("$root/.venv/bin/ds4-build")
elif command -v ds4-build >/dev/null 2>&1; then
    build=(ds4-build)
else
    build=("$python" -c 'import sys; from ds4trt.cli import build_main; build_main(sys.argv[1:])')
fi
"${build[@]}" --from-onnx "$dir" --backend tensorrt "$@"

echo "jetson_build.sh: done; run it with: ds4-run --engines $dir -p 'Hello'"
