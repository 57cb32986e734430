"""The ONNX Runtime backend (runtime/backends/onnxruntime.py) behind the unchanged Session / speculative loop,
and the engine directory's validation (export/manifest.py).

Token streams: ORT and PyTorch engines (float32, the same tiny GGUFs, numerics ds4 and float) produce identical
greedy tokens, plain and speculative (draft 1..4 with the tiny MTP, margin 0 so it always drafts), and the
drafter proposes the same tokens in both (the MTP graph agrees with MTPHead)."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout

import pytest
import torch

from ds4trt import cli
from ds4trt.errors import Ds4Error
from ds4trt.runtime.backends.onnxruntime import open_engine
from ds4trt.runtime.session import Engine
from tiny_engines import CTX, N_NEW, PROMPT, tiny_engine, tiny_files
from tiny_engines import greedy as _greedy

torch.set_num_threads(1)



@pytest.fixture(scope="module", params=["ds4", "float"])
def engines(request):
    target, mtp = tiny_files()
    return open_engine(tiny_engine(request.param)), Engine.open(target, mtp, numerics=request.param)


def _speculative(engine, n_draft, n=N_NEW):
    s = engine.session(CTX)
    s.prefill(PROMPT, chunk=9)
    out, drafts = [s.argmax()], []
    log = drafts.append
    while len(out) < n:
        new = s.eval_speculative_argmax(out[-1], n - len(out), None, n_draft=n_draft, margin=0.0, log=log)
        out += new[1:] + [s.argmax()]
    return out[:n], [line.split(" margins=")[0] for line in drafts], s


def test_plain_greedy_matches_pytorch(engines):
    ort_engine, torch_engine = engines
    assert _greedy(ort_engine) == _greedy(torch_engine)


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_speculative_matches_pytorch(engines, n_draft):
    ort_engine, torch_engine = engines
    got, got_drafts, s = _speculative(ort_engine, n_draft)
    want, want_drafts, _ = _speculative(torch_engine, n_draft)
    assert got == want == _greedy(torch_engine)
    assert got_drafts == want_drafts                # the same drafts: the MTP graph agrees with MTPHead
    assert s.stats.drafted and s.stats.drafted[0] > 0


def test_ds4_run_engines_prints_the_same_text(tmp_path):
    target, mtp = tiny_files()
    outs = []
    for argv in (["--engines", str(tiny_engine("ds4"))], ["--gguf", str(target), "--ctx", str(CTX)]):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert cli.run(argv + ["-p", "Hello, world", "-n", "10", "--raw"]) == 0
        outs.append(buf.getvalue())
    assert outs[0] == outs[1] and outs[0].strip()


def _tamper(tmp_path, change):
    d = tmp_path / "engine"
    shutil.copytree(tiny_engine("ds4"), d)
    change(d)
    return d


def _edit_manifest(edit):
    def change(d):
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
    return change


def _flip_byte(name, at=100):
    def change(d):
        with open(d / name, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 1]))
    return change


def _truncate(name):
    def change(d):
        with open(d / name, "r+b") as f:
            f.truncate(f.seek(0, 2) - 1)
    return change


TAMPERED = [   # (case, change to a copy of a good engine directory, message)
    ("no manifest", lambda d: (d / "manifest.json").unlink(), r"manifest\.json is missing"),
    ("manifest not JSON", lambda d: (d / "manifest.json").write_text("{"), r"not readable JSON"),
    ("unknown format version", _edit_manifest(lambda m: m.update(format_version=2)),
     r"format_version 2 is not supported \(this ds4trt reads version 1\)"),
    ("backend ORT cannot load", _edit_manifest(lambda m: m.update(backend="tensorrt")),
     r"backend 'tensorrt' cannot be loaded by the onnxruntime runtime"),
    ("unknown backend", _edit_manifest(lambda m: m.update(backend="tvm")), r"backend: expected onnxruntime or tensorrt"),
    ("missing key", _edit_manifest(lambda m: m.pop("graphs")), r"key graphs is missing"),
    ("wrong type", _edit_manifest(lambda m: m.update(ctx="64")), r"ctx: expected an integer, got \"64\""),
    ("graph file not listed", _edit_manifest(lambda m: m["files"].pop("mtp.onnx")), r"mtp\.onnx is not listed"),
    ("weights missing", lambda d: (d / "weights.bin").unlink(), r"weights\.bin is missing"),
    ("tokenizer missing", lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json is missing"),
    ("weights truncated", _truncate("weights.bin"), r"weights\.bin: size \d+ bytes differs from the manifest's"),
    ("weights changed", _flip_byte("weights.bin", 5000), r"weights\.bin: sha256 differs from the manifest's"),
    ("graph changed", _flip_byte("target.onnx", 50), r"target\.onnx: sha256 differs"),
    ("graph inputs changed", _edit_manifest(lambda m: m["graphs"]["target"]["inputs"][2].update(shape=[5, 64])),
     r"input cache\.0\.raw is \[7, 64\], the manifest says \[5, 64\]"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in TAMPERED], ids=[c[0] for c in TAMPERED])
def test_tampered_engine_directory_is_refused(tmp_path, change, message):
    d = _tamper(tmp_path, change)
    with pytest.raises(Ds4Error, match=message) as err:
        open_engine(d)
    assert "\n" not in str(err.value)
    with pytest.raises(SystemExit) as code:                   # ds4-run prints it as one line and exits 1
        cli.run_main(["--engines", str(d), "-p", "hi"])
    assert code.value.code == 1


def test_session_with_another_context_is_refused():
    engine = open_engine(tiny_engine("ds4"))
    s = engine.session(CTX * 2)
    with pytest.raises(Ds4Error, match=rf"engine was built for .* \(ctx {CTX}\): open the session with ctx {CTX}"):
        s.prefill([1, 2, 3])
