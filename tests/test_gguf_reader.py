"""ds4trt.gguf_io.reader: good files round-trip; hostile files fail fast with one line naming the thing."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import tensor_nbytes
from ds4trt.gguf_io.reader import ARRAY, BOOL, FLOAT32, STRING, UINT32, UINT64, GGUFFile


# ---- hand-built GGUF bytes ----
def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + u32(vtype) + payload


def ti(name, ggml_shape, ggml_type, offset):
    return gstr(name) + u32(len(ggml_shape)) + b"".join(u64(d) for d in ggml_shape) + u32(ggml_type) + u64(offset)


def gguf(kvs=(), tensors=(), data=b"", *, magic=b"GGUF", version=3, n_tensors=None, n_kv=None, align=32):
    head = magic + u32(version) + u64(len(tensors) if n_tensors is None else n_tensors) \
        + u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + bytes(-len(body) % align) + data


ARCH_KV = kv("general.architecture", STRING, gstr("deepseek4"))
NAME_KV = kv("general.name", STRING, gstr("tiny"))
LAYERS_KV = kv(N.KEY_BLOCK_COUNT, UINT32, u32(2))
GOOD_KVS = [ARCH_KV, NAME_KV, LAYERS_KV]
# a: F32 [8] (32 bytes) at 0; b: Q8_0 [32, 2] (68 bytes) at 32
GOOD_TIS = [ti("a.weight", (8,), N.F32, 0), ti("b.weight", (32, 2), N.Q8_0, 32)]
GOOD_DATA = bytes(range(100)) + bytes(28)


def good():
    return gguf(GOOD_KVS, GOOD_TIS, GOOD_DATA)


def cut(data: bytes, marker: bytes, extra: int) -> bytes:
    """`data` truncated `extra` bytes after the start of `marker`."""
    return data[:data.index(marker) + extra]


# Each row: (id, file bytes or a callable(tmp_path) -> path, substrings the one-line message must contain).
BAD = [
    # the path does not exist
    ("missing", lambda d: d / "nope.gguf", ["no such file"]),
    # the path is a directory
    ("directory", lambda d: d, ["is a directory"]),
    # zero bytes
    ("empty", b"", ["file is empty"]),
    # a zip file, not a GGUF
    ("not_gguf", b"PK\x03\x04" + bytes(60), ["not a GGUF file", "magic b'PK\\x03\\x04'", "expected b'GGUF'"]),
    # three bytes: too short even for the magic
    ("tiny", b"GGU", ["not a GGUF file"]),
    # GGUF v2 (64-bit counts but older string rules): ds4 accepts only v3
    ("version_2", gguf(version=2), ["GGUF version 2, expected 3"]),
    # a big-endian file reads its version byte-swapped
    ("big_endian", gguf(version=3 << 24), ["expected 3", "big-endian"]),
    # the header stops inside the tensor count
    ("truncated_header", gguf()[:12], ["truncated at byte 16 while reading the header", "file is 12 bytes"]),
    # the file ends in the middle of the string value of general.name
    ("truncated_in_string", cut(gguf(GOOD_KVS), b"tiny", 2), ["metadata key 'general.name'", "truncated"]),
    # the file ends in the middle of the u32 value of block_count
    ("truncated_in_u32", cut(good(), N.KEY_BLOCK_COUNT.encode(), len(N.KEY_BLOCK_COUNT) + 4 + 2),
     [f"truncated at byte", f"while reading metadata key '{N.KEY_BLOCK_COUNT}'"]),
    # the file ends inside the tensor directory
    ("truncated_in_directory", cut(good(), b"b.weight", 4), ["tensor #1 name", "truncated"]),
    # a string value claiming 2**62 bytes
    ("absurd_string", gguf([kv("general.name", STRING, u64(2 ** 62) + b"x" * 64)]),
     ["metadata key 'general.name'", "string length 4611686018427387904"]),
    # a key name claiming 2**64-1 bytes
    ("absurd_key_length", gguf([u64(2 ** 64 - 1) + b"x" * 64]), ["metadata key #0 name", "string length 18446744073709551615"]),
    # a u32 array claiming 2**62 elements
    ("absurd_array", gguf([kv("x.list", ARRAY, u32(UINT32) + u64(2 ** 62) + bytes(64))]),
     ["metadata key 'x.list'", "array length 4611686018427387904 of u32"]),
    # a string array claiming 2**40 elements
    ("absurd_string_array", gguf([kv(N.KEY_TOKENS, ARRAY, u32(STRING) + u64(2 ** 40) + bytes(64))]),
     [f"metadata key '{N.KEY_TOKENS}'", "array length 1099511627776 of string"]),
    # element 1 of a string array claims 2**62 bytes
    ("absurd_array_element", gguf([kv(N.KEY_TOKENS, ARRAY, u32(STRING) + u64(3) + gstr("a") + u64(2 ** 62) + bytes(40))]),
     [f"metadata key '{N.KEY_TOKENS}' element 1", "string length 4611686018427387904"]),
    # 2**40 tensors in a file of a few hundred bytes
    ("absurd_tensor_count", gguf(GOOD_KVS, n_tensors=2 ** 40), ["tensor count 1099511627776"]),
    # 2**60 metadata keys
    ("absurd_kv_count", gguf(GOOD_KVS, n_kv=2 ** 60), ["metadata key count 1152921504606846976"]),
    # value type 13 does not exist
    ("unknown_value_type", gguf([kv("x.y", 13, bytes(16))]), ["metadata key 'x.y'", "unknown value type 13"]),
    # array of element type 99
    ("unknown_array_type", gguf([kv("x.y", ARRAY, u32(99) + u64(1) + bytes(16))]),
     ["metadata key 'x.y'", "array of unknown value type 99"]),
    # a BOOL holding 2
    ("bad_bool", gguf([kv(N.KEY_EXPERT_WEIGHTS_NORM, BOOL, b"\x02")]),
     [f"metadata key '{N.KEY_EXPERT_WEIGHTS_NORM}'", "bool value 2", "expected 0 or 1"]),
    # the same key twice
    ("duplicate_key", gguf([NAME_KV, ARCH_KV, NAME_KV]), ["duplicate metadata key 'general.name'"]),
    # a key that is the empty string
    ("empty_key", gguf([kv("", UINT32, u32(1))]), ["metadata key #0", "empty name"]),
    # a key that is not UTF-8
    ("invalid_utf8_key", gguf([ARCH_KV, kv(b"bad\xff.key", UINT32, u32(1))]), ["metadata key #1 name", "not valid UTF-8"]),
    # a string value that is not UTF-8
    ("invalid_utf8_value", gguf([kv("general.name", STRING, gstr(b"\xc3\x28"))]),
     ["metadata key 'general.name'", "not valid UTF-8"]),
    # a token that is not UTF-8
    ("invalid_utf8_token", gguf([kv(N.KEY_TOKENS, ARRAY, u32(STRING) + u64(3) + gstr("a") + gstr(b"\xe2\x82") + gstr("c"))]),
     [f"metadata key '{N.KEY_TOKENS}' element 1", "not valid UTF-8"]),
    # general.alignment 0
    ("alignment_zero", gguf([kv(N.KEY_ALIGNMENT, UINT32, u32(0))]), [f"'{N.KEY_ALIGNMENT}' is 0", "power of two"]),
    # general.alignment 48 (not a power of two)
    ("alignment_48", gguf([kv(N.KEY_ALIGNMENT, UINT32, u32(48))], align=48), [f"'{N.KEY_ALIGNMENT}' is 48"]),
    # general.alignment stored as u64
    ("alignment_u64", gguf([kv(N.KEY_ALIGNMENT, UINT64, u64(32))]), [f"'{N.KEY_ALIGNMENT}' has type u64, expected u32"]),
    # ggml type 99 does not exist
    ("unknown_ggml_type", gguf(GOOD_KVS, [ti("a.weight", (8,), 99, 0)], bytes(32)), ["tensor a.weight", "unknown ggml type 99"]),
    # a tensor with no dimensions
    ("n_dims_0", gguf(GOOD_KVS, [gstr("a.weight") + u32(0) + u32(N.F32) + u64(0)], bytes(32)),
     ["tensor a.weight", "n_dims 0, expected 1..4"]),
    # nine dimensions (ggml has at most four)
    ("n_dims_9", gguf(GOOD_KVS, [ti("a.weight", (1,) * 9, N.F32, 0)], bytes(32)), ["tensor a.weight", "n_dims 9"]),
    # a zero dimension
    ("zero_dim", gguf(GOOD_KVS, [ti("a.weight", (8, 0), N.F32, 0)], bytes(32)), ["tensor a.weight", "zero dimension"]),
    # 2**32 x 2**32 elements overflow int64
    ("element_overflow", gguf(GOOD_KVS, [ti("a.weight", (2 ** 32, 2 ** 32), N.F32, 0)], bytes(32)),
     ["tensor a.weight", "overflows"]),
    # a Q8_0 row of 33 values (blocks hold 32)
    ("partial_block", gguf(GOOD_KVS, [ti("b.weight", (33, 2), N.Q8_0, 0)], bytes(128)),
     ["tensor b.weight", "ne0 = 33 is not a multiple of the Q8_0 block size 32"]),
    # a relative offset of 8 with alignment 32
    ("misaligned_offset", gguf(GOOD_KVS, [ti("a.weight", (8,), N.F32, 8)], bytes(64)),
     ["tensor a.weight", "offset 8 is not a multiple of the alignment 32"]),
    # the data region is cut: b.weight needs 68 bytes at +32, only 40 present
    ("truncated_data", gguf(GOOD_KVS, GOOD_TIS, GOOD_DATA[:72]), ["tensor b.weight", "extends past the end of the file"]),
    # a huge tensor in a small file
    ("tensor_past_end", gguf(GOOD_KVS, [ti("blk.0.attn_q_a.weight", (4096, 1024), N.Q8_0, 0)], bytes(64)),
     ["tensor blk.0.attn_q_a.weight", "data [", "extends past the end of the file (size"]),
    # b.weight starts inside a.weight
    ("overlap", gguf(GOOD_KVS, [ti("a.weight", (16,), N.F32, 0), ti("b.weight", (32, 2), N.Q8_0, 32)], GOOD_DATA),
     ["overlaps tensor a.weight", "tensor b.weight"]),
    # the same tensor name twice
    ("duplicate_tensor", gguf(GOOD_KVS, [ti("a.weight", (8,), N.F32, 0), ti("a.weight", (8,), N.F32, 32)], bytes(64)),
     ["duplicate tensor name a.weight"]),
    # a tensor name that is not UTF-8
    ("invalid_utf8_tensor_name", gguf(GOOD_KVS, [ti(b"a\xff", (8,), N.F32, 0)], bytes(32)),
     ["tensor #0 name", "not valid UTF-8"]),
]


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging if the reader loops on a hostile file."""
    def boom(*_):
        raise TimeoutError(f"GGUFFile took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("make,expect", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_file(tmp_path, make, expect):
    if callable(make):
        path = make(tmp_path)
    else:
        path = tmp_path / "model.gguf"
        path.write_bytes(make)
    t0 = time.perf_counter()
    with deadline(5), pytest.raises(Ds4Error) as err:
        GGUFFile(path)
    assert time.perf_counter() - t0 < 1.0
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: "), msg
    for part in expect:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_bad_table_is_fast(tmp_path):
    """The whole table, one after another, well under a few seconds."""
    t0 = time.perf_counter()
    for i, (_, make, _) in enumerate(BAD):
        path = make(tmp_path) if callable(make) else tmp_path / f"{i}.gguf"
        if not callable(make):
            path.write_bytes(make)
        with deadline(5), pytest.raises(Ds4Error):
            GGUFFile(path)
    assert time.perf_counter() - t0 < 2.0


# ---- good files ----
def test_hand_built_good_file(tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(good())
    with GGUFFile(path) as f:
        assert (f.version, f.alignment) == (3, 32)
        assert f.metadata["general.name"].value == "tiny"
        a, b = f.tensors["a.weight"], f.tensors["b.weight"]
        assert f.data_offset % 32 == 0 and a.offset == f.data_offset and b.offset == f.data_offset + 32
        assert (b.ggml_shape, b.shape, b.nbytes) == ((32, 2), (2, 32), 68)
        assert bytes(f.raw("b.weight")) == GOOD_DATA[32:100]


def test_zero_tensors(tmp_path):
    path = tmp_path / "meta.gguf"
    path.write_bytes(gguf(GOOD_KVS)[:-1])  # no tensors: the data start may lie past the end
    with GGUFFile(path) as f:
        assert f.tensors == {} and len(f.metadata) == 3


def write_with_gguf_writer(path, alignment=None):
    """A GGUF written by the gguf package: every value type, nested arrays, five tensor types."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "deepseek4")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ｜DSML｜")
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 1e-300)
    w.add_key_value("t.arr_u32", [0, 0, 4, 128], GGUFValueType.ARRAY, GGUFValueType.UINT32)
    w.add_key_value("t.arr_f32", [10.0, 2.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    w.add_key_value("t.arr_bool", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    w.add_array("t.arr_str", ["Ġthe", "", "<｜User｜>"])
    w.add_array("t.nested", [[1, 2], [3]])
    x32 = rng.standard_normal((3, 5)).astype(np.float32)
    x16 = rng.standard_normal((4, 64)).astype(np.float16)
    q8 = quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    ids = rng.integers(0, 256, (7, 6)).astype(np.int32)
    w.add_tensor("x32", x32)
    w.add_tensor("x16", x16)
    w.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    # Q4_K: the gguf package cannot quantize it; random blocks are fine for a byte round trip
    q4 = rng.integers(0, 256, (2, 3, 144), dtype=np.uint8)
    w.add_tensor("q4", q4, raw_dtype=GGMLQuantizationType.Q4_K)
    w.add_tensor("ids", ids)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"x32": (N.F32, x32), "x16": (N.F16, x16), "q8": (N.Q8_0, q8), "q4": (N.Q4_K, q4), "ids": (N.I32, ids)}


@pytest.mark.parametrize("alignment", [None, 64])
def test_round_trip_gguf_writer(tmp_path, alignment):
    path = tmp_path / "rt.gguf"
    written = write_with_gguf_writer(path, alignment)
    with GGUFFile(path) as f:
        md = f.metadata
        assert f.alignment == (alignment or 32)
        scalars = {"t.u8": 200, "t.i8": -100, "t.u16": 60000, "t.i16": -30000, "t.u32": 4_000_000_000,
                   "t.i32": -2_000_000_000, "t.f32": 1.5, "t.bool": True, "t.str": "héllo ｜DSML｜",
                   "t.u64": 2 ** 63 + 5, "t.i64": -(2 ** 62), "t.f64": 1e-300, "general.architecture": "deepseek4"}
        for key, v in scalars.items():
            assert md[key].value == v and type(md[key].value) is type(v) and md[key].array_type is None, key
        assert md["t.u8"].type == 0 and md["t.f64"].type == 12 and md["t.str"].type == STRING
        assert md["t.arr_u32"].array_type == UINT32 and md["t.arr_u32"].value.tolist() == [0, 0, 4, 128]
        assert md["t.arr_f32"].array_type == FLOAT32 and md["t.arr_f32"].value.tolist() == [10.0, 2.5]
        assert md["t.arr_bool"].value.dtype == np.bool_ and md["t.arr_bool"].value.tolist() == [True, False, True]
        assert md["t.arr_str"].value == ["Ġthe", "", "<｜User｜>"] and md["t.arr_str"].array_type == STRING
        assert md["t.nested"].array_type == ARRAY and [v.tolist() for v in md["t.nested"].value] == [[1, 2], [3]]

        # offsets agree with the gguf package's own reader
        ref = {t.name: t for t in GGUFReader(path).tensors}
        assert set(f.tensors) == set(ref) == set(written)
        for name, (ggml_type, arr) in written.items():
            info = f.tensors[name]
            assert info.ggml_type == ggml_type == int(ref[name].tensor_type)
            assert info.offset == ref[name].data_offset and info.offset % f.alignment == 0
            assert info.ggml_shape == tuple(int(d) for d in ref[name].shape)
            assert info.nbytes == arr.nbytes == tensor_nbytes(ggml_type, info.ggml_shape)
            raw = f.raw(name)
            assert raw.dtype == np.uint8 and raw.ndim == 1 and not raw.flags.writeable
            assert raw.tobytes() == arr.tobytes()
        assert f.tensors["x32"].shape == (3, 5) and f.tensors["x32"].ggml_shape == (5, 3)
        assert f.tensors["q4"].shape == (2, 3, 256)
        with pytest.raises(Ds4Error, match=r"rt\.gguf: tensor nope is missing"):
            f.raw("nope")
        view = f.raw("x32")
    assert view.view(np.float32).tolist() == written["x32"][1].ravel().tolist()  # views outlive close()


# ---- the real scale: full Flash metadata and tensor directory, sparse data ----
def test_flash_scale_opens_fast(tmp_path):
    from ds4trt.model.config import ModelConfig
    from ds4trt.model.layout import target_layout
    from ds4trt.testing.flash_sparse import write_sparse_flash_gguf

    t0 = time.perf_counter()
    path = write_sparse_flash_gguf(tmp_path / "flash.gguf")
    t_write = time.perf_counter() - t0
    st = os.stat(path)
    assert st.st_size > 80e9 and st.st_blocks * 512 < 64e6  # ~87 GB apparent, a few MB on disk
    assert t_write < 5.0

    t0 = time.perf_counter()
    f = GGUFFile(path)
    t_open = time.perf_counter() - t0
    assert t_open < 1.0, f"open took {t_open:.2f} s"

    layout = target_layout(ModelConfig.flash())
    assert len(f.tensors) == len(layout) > 1300
    for spec in layout:
        info = f.tensors[spec.name]
        assert info.ggml_shape == spec.ggml_shape and info.ggml_type in spec.types
    assert len(f.metadata[N.KEY_TOKENS].value) == 129280 and len(f.metadata[N.KEY_MERGES].value) == 127741
    assert f.metadata[N.KEY_TOKENS].value[-7] == "<｜begin▁of▁sentence｜>"
    cfg = ModelConfig.from_gguf(f)
    assert (cfg.n_layer, cfg.n_expert, cfg.compress_ratios) == (43, 256, ModelConfig.flash().compress_ratios)
    last = max(f.tensors.values(), key=lambda t: t.offset)
    assert last.offset + last.nbytes <= st.st_size and not f.raw(last.name)[-64:].any()  # a hole reads zeros
    f.close()

    # peak RSS of a fresh process opening it (tensor data never touched)
    code = ("import resource, sys, time, json\n"
            "from ds4trt.gguf_io.reader import GGUFFile\n"
            "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "t = time.perf_counter(); f = GGUFFile(sys.argv[1]); t = time.perf_counter() - t\n"
            "print(json.dumps({'rss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0, 'open_s': t}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    assert res["rss_kb"] < 300_000, res
    assert res["open_s"] < 1.0, res
