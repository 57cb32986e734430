"""Export at the real DeepSeek V4 Flash widths with bounded memory, and the TensorRT op check on those graphs.

The model: ModelConfig.flash() cut to 4 layers (ratios 0, 0, 4, 128: both sliding layers, an indexer layer
and a ratio-128 layer; 3 hash-routed layers and one with biased top-k routing) plus the MTP head, at the real
widths (hidden 4096, 64 heads x 512, 256 experts x 2048, vocab 129280, IQ2_XXS/Q2_K experts, Q4_K MTP
experts). The GGUFs are sparse: full-size tensor directories whose data is a hole (zeros), ~13 GB that cost no
disk; their float32 export is ~14 GB of weights.bin, which the writer keeps sparse too.

Bound: the build, in a subprocess, must peak below PEAK_RSS_BOUND = 1.5 GiB resident (ru_maxrss; measured
0.73 GiB). Holding the model's float weights even once would take ~10.5 GB (the token embedding and LM head
alone are 4.2 GB in float32), so the bound shows the export streams the weights tensor by tensor, and that the
mapped GGUF pages it has read are let go (they would otherwise count: 13 GB). About 50 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import onnx
from gguf import GGUFValue, GGUFValueType

from ds4trt.export.trt_ops import check_tensorrt_ops
from ds4trt.gguf_io import names as N
from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import mtp_layout, target_layout
from ds4trt.testing.flash_sparse import write_sparse_gguf
from ds4trt.testing.tiny_gguf import build_tokenizer, model_metadata, tokenizer_metadata

PEAK_RSS_BOUND = int(1.5 * 2**30)
CTX = 4096
CFG = dataclasses.replace(ModelConfig.flash(), n_layer=4, compress_ratios=(0, 0, 4, 128), n_hash_layer=3,
                          name="flash-4-layers")


def _write_sparse(path: Path, specs, metadata: dict[str, GGUFValue], experts: tuple[int, int, int]) -> Path:
    """A GGUF with the full tensor directory of `specs`, exactly `metadata`, and a data region that is a hole."""
    def add(w):
        w.kv_data[0].clear()
        for key, val in metadata.items():
            w.add_key_value(key, val.value, val.type, val.sub_type)
    return write_sparse_gguf(path, specs, experts, add)


BUILD = """
import json, resource, sys
from ds4trt.export.package import build
r = build(sys.argv[1], sys.argv[2], mtp=sys.argv[3], ctx=int(sys.argv[4]))
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "files": r.files,
                  "trt": r.trt_problems, "graphs": {k: v["nodes"] for k, v in r.graphs.items()}}))
"""


def test_flash_width_export_bounded_memory(tmp_path):
    target = _write_sparse(tmp_path / "flash.gguf", target_layout(CFG),
                           model_metadata(CFG) | tokenizer_metadata(*build_tokenizer(CFG.n_vocab)),
                           (N.IQ2_XXS, N.IQ2_XXS, N.Q2_K))
    mtp = _write_sparse(tmp_path / "flash-mtp.gguf", mtp_layout(CFG),
                        {N.KEY_ARCHITECTURE: GGUFValue(N.ARCH, GGUFValueType.STRING)}, (N.Q4_K, N.Q4_K, N.Q4_K))
    out = tmp_path / "engine"
    proc = subprocess.run([sys.executable, "-c", BUILD, str(target), str(out), str(mtp), str(CTX)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    float_bytes = 2 * CFG.n_vocab * CFG.n_embd * 4                # token_embd + output in float32
    assert r["files"]["weights.bin"] > 2 * float_bytes            # the float model is far larger than ...
    assert r["peak_rss"] < PEAK_RSS_BOUND, f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB"   # ... what was held
    assert r["trt"] == []
    for role in ("target", "mtp"):
        path = out / f"{role}.onnx"
        onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
        assert check_tensorrt_ops(model) == []
        assert path.stat().st_size < 2**31                        # a graph protobuf, not the weights
    # the MTP graph shares the target's embedding and LM head: the same bytes of weights.bin
    ext = {role: {t.name: [(e.key, e.value) for e in t.external_data]
                  for t in onnx.load(str(out / f"{role}.onnx"), load_external_data=False).graph.initializer}
           for role in ("target", "mtp")}
    for name in ("token_embd.weight", "output.weight"):
        assert ext["mtp"][name] == ext["target"][name]
