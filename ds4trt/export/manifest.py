"""The engine directory's manifest.json: schema, writing, and validation on load.

An engine directory (what `ds4-build` writes, what `ds4-run --engines` reads):

    manifest.json     this schema (FORMAT, FORMAT_VERSION)
    target.onnx       the target step graph          \\  weights as external data in weights.bin,
    mtp.onnx          the MTP step graph (optional)  /   tensors the two share stored once
    weights.bin
    tokenizer.json    Hugging Face tokenizers format (tokenizer.py Tokenizer.save)

manifest.json keys:
    format, format_version      "ds4trt-engine", 1
    backend                     "onnxruntime" | "tensorrt"
    created                     UTC time of the build
    tools                       versions that built it: ds4trt, python, torch, onnx, onnxruntime, gguf, ...
    tensorrt                    {"version": null, "compute_capability": null}: filled by TensorRT builds
                                (backend "tensorrt"; checked by tensorrt_info, not by load):
                                {"version": trt.__version__, "compute_capability": "major.minor" of the build GPU,
                                 "version_compatible": bool, "engines": {role: file name listed in files},
                                 "profiles": [{"name", "min", "opt", "max"}: T range of engine profile i], ...}
    sources                     [{"role": "target"|"mtp", "file": name, "size": bytes, "sha256": hex}]
    model                       ModelConfig fields (model/config.py)
    numerics                    "ds4" | "float" (baked into the graphs)
    ctx                         the context size the cache inputs are shaped for (the maximum context)
    opset                       ONNX default-domain op set;  custom_ops: [{"domain", "op_type", "version"}]
    dims                        symbolic dimensions: {"T": {"min": 1, "max": ctx}}
    graphs                      {"target": G, "mtp": G}: G = {"file", "inputs": [IO], "outputs": [IO]},
                                IO = {"name", "dtype", "shape": [int or "T"]}
    files                       {file name: {"size", "sha256"}} for every file above but manifest.json
    tokenizer                   {"file": "tokenizer.json", "n_vocab"}
    chat                        {"template": "ds4", special token ids: bos, eos, user, assistant, think, end_think}

`load(dir)` checks everything a loader relies on and raises one-line Ds4Errors: a missing manifest or file, an
unreadable or malformed manifest, an unknown format version, a file whose size or sha256 differs from the
manifest. Whether a backend can load it is the runtime's check (runtime/backends/); the TensorRT fields are
checked by tensorrt_info(manifest) when a TensorRT runtime or build reads them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ds4trt.errors import Ds4Error

FORMAT, FORMAT_VERSION = "ds4trt-engine", 1
MANIFEST = "manifest.json"
BACKENDS = ("onnxruntime", "tensorrt")
GRAPHS = ("target", "mtp")
HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class IOSpec:
    """A graph input or output: name, dtype ("float32" | "int64"), shape (ints, "T" for the token count)."""
    name: str
    dtype: str
    shape: tuple

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def row_fields(outputs) -> list[list[str]]:
    """Per layer, the LayerRows fields of the graph outputs named 'rows.{layer}.{field}', in output order."""
    fields: list[list[str]] = []
    for s in outputs:
        if s.name.startswith("rows."):
            layer, field = s.name.split(".")[1:]
            while len(fields) <= int(layer):
                fields.append([])
            fields[int(layer)].append(field)
    return fields


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def file_entry(path: Path, sha256: str | None = None) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256 or sha256_file(path)}


def write(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST
    path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return path


# ---- validation ----

class _Check:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, key: str, expected: str, got) -> None:
        raise Ds4Error(f"{self.path}: {key}: expected {expected}, got {_show(got)}")

    def get(self, d: dict, key: str, kind, where: str = ""):
        full = f"{where}.{key}" if where else key
        if not isinstance(d, dict) or key not in d:
            raise Ds4Error(f"{self.path}: key {full} is missing")
        v = d[key]
        ok = isinstance(v, kind) and not (kind in (int, (int, float)) and isinstance(v, bool))
        if not ok:
            self.fail(full, _KIND_NAMES.get(kind, str(kind)), v)
        return v


_KIND_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "an array", (int, float): "a number",
               bool: "true or false"}


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def _io(check: _Check, items, where: str) -> list[IOSpec]:
    if not isinstance(items, list) or not items:
        check.fail(where, "a non-empty array of tensors", items)
    out = []
    for i, d in enumerate(items):
        w = f"{where}[{i}]"
        name, dtype, shape = check.get(d, "name", str, w), check.get(d, "dtype", str, w), check.get(d, "shape", list, w)
        if dtype not in ("float32", "int64"):
            check.fail(f"{w}.dtype", "float32 or int64", dtype)
        if not all((isinstance(s, int) and not isinstance(s, bool) and s >= 0) or s == "T" for s in shape):
            check.fail(f"{w}.shape", 'sizes >= 0 or "T"', shape)
        out.append(IOSpec(name, dtype, tuple(shape)))
    return out


@dataclass
class Manifest:
    directory: Path
    data: dict
    backend: str
    ctx: int
    numerics: str
    graphs: dict[str, dict]             # role -> {"file": Path, "inputs": [IOSpec], "outputs": [IOSpec]}

    @property
    def model(self) -> dict:
        return self.data["model"]

    def config(self):
        """The model's ModelConfig (model/config.py) from the `model` key."""
        from ds4trt.model.config import ModelConfig

        try:
            return ModelConfig(**(self.model | {"compress_ratios": tuple(self.model["compress_ratios"])}))
        except (TypeError, KeyError) as e:
            raise Ds4Error(f"{self.directory / MANIFEST}: model: not a ModelConfig ({e})") from e


def load(directory, verify_hashes: bool = True) -> Manifest:
    """Read and validate DIR/manifest.json and the files it lists (size, and sha256 unless verify_hashes=False)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise Ds4Error(f"{directory}: not a directory (expected an engine directory written by ds4-build)")
    if not path.is_file():
        raise Ds4Error(f"{path} is missing (expected an engine directory written by ds4-build)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Ds4Error(f"{path}: not readable JSON: {e}") from e
    check = _Check(path)
    if not isinstance(data, dict):
        check.fail("top level", "an object", data)
    fmt = check.get(data, "format", str)
    if fmt != FORMAT:
        check.fail("format", repr(FORMAT), fmt)
    version = check.get(data, "format_version", int)
    if version != FORMAT_VERSION:
        raise Ds4Error(f"{path}: format_version {version} is not supported (this ds4trt reads version "
                       f"{FORMAT_VERSION}); rebuild the engines with this ds4trt's ds4-build")
    backend = check.get(data, "backend", str)
    if backend not in BACKENDS:
        check.fail("backend", " or ".join(BACKENDS), backend)
    ctx = check.get(data, "ctx", int)
    if ctx < 1:
        check.fail("ctx", "a context size >= 1", ctx)
    numerics = check.get(data, "numerics", str)
    check.get(data, "model", dict)
    check.get(data, "opset", int)
    files = check.get(data, "files", dict)
    graphs_json = check.get(data, "graphs", dict)
    if "target" not in graphs_json:
        raise Ds4Error(f"{path}: key graphs.target is missing")
    graphs = {}
    for role, g in graphs_json.items():
        if role not in GRAPHS:
            check.fail("graphs", " / ".join(GRAPHS) + " graphs", role)
        where = f"graphs.{role}"
        name = check.get(g, "file", str, where)
        if name not in files:
            raise Ds4Error(f"{path}: {where}.file {name} is not listed in files")
        graphs[role] = {"file": directory / name, "inputs": _io(check, g.get("inputs"), f"{where}.inputs"),
                        "outputs": _io(check, g.get("outputs"), f"{where}.outputs")}
    tok = check.get(data, "tokenizer", dict)
    if check.get(tok, "file", str, "tokenizer") not in files:
        raise Ds4Error(f"{path}: tokenizer.file {tok['file']} is not listed in files")
    for name, entry in files.items():
        where = f"files.{name}"
        size, digest = check.get(entry, "size", int, where), check.get(entry, "sha256", str, where)
        f = directory / name
        if Path(name).name != name:
            check.fail(where, "a file name inside the engine directory", name)
        if not f.is_file():
            raise Ds4Error(f"{f} is missing (listed in {path})")
        if f.stat().st_size != size:
            raise Ds4Error(f"{f}: size {f.stat().st_size} bytes differs from the manifest's {size}: "
                           "the file changed after the build; rebuild with ds4-build")
        if verify_hashes and sha256_file(f) != digest:
            raise Ds4Error(f"{f}: sha256 differs from the manifest's {digest[:12]}...: "
                           "the file changed after the build; rebuild with ds4-build")
    return Manifest(directory, data, backend, ctx, numerics, graphs)


# ---- TensorRT fields (backend "tensorrt": export/tensorrt.py writes them, runtime/backends/tensorrt.py reads them)

@dataclass(frozen=True)
class TensorRTInfo:
    version: str                        # trt.__version__ of the build
    compute_capability: str             # "major.minor" of the build GPU
    version_compatible: bool            # built with BuilderFlag.VERSION_COMPATIBLE (lean runtime embedded)
    engines: dict[str, Path]            # role -> engine file
    profiles: list[dict]                # engine profile i: {"name", "min", "opt", "max"} (T range)

    def profile_for(self, T: int) -> int:
        """The profile a step of T tokens runs on: the narrowest T range holding T (decode before prefill for
        T = 1). Past the largest profile: a one-line Ds4Error."""
        fits = [i for i, p in enumerate(self.profiles) if p["min"] <= T <= p["max"]]
        if not fits:
            top = max(self.profiles, key=lambda p: p["max"])
            raise Ds4Error(f"a step of {T} tokens is outside the TensorRT profiles (the largest, {top['name']}, "
                           f"takes T <= {top['max']}): prefill in chunks of at most {top['max']} tokens, or rebuild "
                           "with ds4-build --from-onnx DIR --backend tensorrt --prefill-chunk N / --mtp-draft-max N")
        return min(fits, key=lambda i: (self.profiles[i]["max"] - self.profiles[i]["min"], i))


def tensorrt_info(m: Manifest) -> TensorRTInfo:
    """The `tensorrt` key of a backend "tensorrt" manifest, checked: one-line Ds4Errors as load()'s."""
    check = _Check(m.directory / MANIFEST)
    if m.backend != "tensorrt":
        raise Ds4Error(f"{check.path}: backend {m.backend!r} has no TensorRT engines "
                       f"(build them with ds4-build --from-onnx {m.directory} --backend tensorrt)")
    t = check.get(m.data, "tensorrt", dict)
    version = check.get(t, "version", str, "tensorrt")
    cc = check.get(t, "compute_capability", str, "tensorrt")
    parts = cc.split(".")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        check.fail("tensorrt.compute_capability", 'a "major.minor" string', cc)
    if not version or not version.split(".")[0].isdigit():
        check.fail("tensorrt.version", "a TensorRT version string", version)
    vc = check.get(t, "version_compatible", bool, "tensorrt")
    engines = check.get(t, "engines", dict, "tensorrt")
    if set(engines) != set(m.graphs):
        check.fail("tensorrt.engines", f"one engine per graph ({', '.join(m.graphs)})", sorted(engines))
    for role, name in engines.items():
        if not isinstance(name, str) or name not in m.data["files"]:
            raise Ds4Error(f"{check.path}: tensorrt.engines.{role} {_show(name)} is not listed in files")
    profiles = check.get(t, "profiles", list, "tensorrt")
    if not profiles:
        check.fail("tensorrt.profiles", "a non-empty array", profiles)
    names = set()
    for i, p in enumerate(profiles):
        w = f"tensorrt.profiles[{i}]"
        name = check.get(p, "name", str, w)
        lo, opt, hi = (check.get(p, k, int, w) for k in ("min", "opt", "max"))
        if not 1 <= lo <= opt <= hi <= m.ctx:
            check.fail(w, f"1 <= min <= opt <= max <= ctx {m.ctx}", p)
        if name in names:
            check.fail(f"{w}.name", "a name used once", name)
        names.add(name)
    return TensorRTInfo(version, cc, vc, {r: m.directory / n for r, n in engines.items()},
                        [{k: p[k] for k in ("name", "min", "opt", "max")} for p in profiles])


def backend_of(directory) -> str | None:
    """The `backend` of DIR/manifest.json without validating anything (None if unreadable): which runtime to
    hand the directory to; that runtime's load() then checks everything."""
    try:
        backend = json.loads((Path(directory) / MANIFEST).read_text()).get("backend")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None
