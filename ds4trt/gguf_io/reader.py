"""A validated, lazy, memory-mapped GGUF v3 reader (spec ds4_architecture.md §1.3).

`GGUFFile(path)` maps the file read-only, parses the header, the metadata and the tensor directory,
and checks every length against the bytes left before reading it, so a hostile file fails fast with
one line naming the file, the key or tensor, the byte offset and what was expected. No tensor byte is
read: `raw(name)` returns a uint8 view of the mapping.

Layout (little endian):
    header     magic b"GGUF", u32 version (3), u64 n_tensors, u64 n_kv
    metadata   n_kv x (string key, u32 value type, value)
    directory  n_tensors x (string name, u32 n_dims, n_dims x u64 ne (ne0 first), u32 ggml type, u64 offset)
    data       starts at align_up(end of directory, general.alignment); offsets are relative to it
A string is u64 byte length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import tensor_nbytes, type_name

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 8

# GGUF value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
VALUE_TYPE_NAMES = {UINT8: "u8", INT8: "i8", UINT16: "u16", INT16: "i16", UINT32: "u32", INT32: "i32",
                    FLOAT32: "f32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "u64",
                    INT64: "i64", FLOAT64: "f64"}
_SCALARS = {t: struct.Struct("<" + c) for t, c in
            {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f",
             BOOL: "B", UINT64: "Q", INT64: "q", FLOAT64: "d"}.items()}
_DTYPES = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4", FLOAT32: "<f4",
           BOOL: "<u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
# The fewest bytes one value of each type can occupy (strings: the length; arrays: type + count).
_MIN_SIZE = {t: s.size for t, s in _SCALARS.items()} | {STRING: 8, ARRAY: 12}
_MIN_KV = 8 + 1 + 4 + 1            # non-empty key, value type, one-byte value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8  # non-empty name, n_dims, one dim, type, offset
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class Field:
    """One metadata entry. Arrays: `value` is a list[str] for strings, a numpy array for numbers
    (bool arrays as numpy bool), a list of such values for nested arrays; `array_type` is the element type."""
    key: str
    type: int
    value: object
    array_type: int | None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ggml_shape: tuple[int, ...]   # ne0 first, as in the file
    shape: tuple[int, ...]        # numpy / torch order = reversed(ggml_shape)
    offset: int                   # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An open GGUF file: `metadata` (key -> Field), `tensors` (name -> TensorInfo), `raw(name)` views."""

    path: Path
    file_size: int
    version: int
    alignment: int
    data_offset: int          # absolute offset of the data region (tensor offsets already include it)
    metadata: dict[str, Field]
    tensors: dict[str, TensorInfo]

    def __init__(self, path):
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._bytes: np.ndarray | None = None
        self.file_size = self._map()
        try:
            self._parse()
        except BaseException:
            self.close()
            raise
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)  # read-only: the map is ACCESS_READ

    # ---- public ----
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: a 1-D uint8 read-only view of the file mapping (no copy)."""
        info = self.tensors.get(name)
        if info is None:
            raise Ds4Error(f"{self.path}: tensor {name} is missing")
        if self._bytes is None:
            raise Ds4Error(f"{self.path}: file is closed (reading tensor {name})")
        return self._bytes[info.offset: info.offset + info.nbytes]

    def close(self) -> None:
        """Drop the mapping. Views from raw() keep it alive until they are garbage."""
        self._bytes = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # raw() views still exist; the map goes when they do
                pass
            self._mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors, data at {self.data_offset})")

    # ---- opening ----
    def _fail(self, msg: str):
        raise Ds4Error(f"{self.path}: {msg}")

    def _map(self) -> int:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    self._fail("file is empty, expected a GGUF file")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            self._fail("no such file")
        except IsADirectoryError:
            self._fail("is a directory, expected a GGUF file")
        except OSError as e:
            self._fail(f"cannot open ({e.strerror or e})")
        return size

    def _parse(self) -> None:
        mm, size = self._mm, self.file_size
        magic = mm[:4]
        if magic != MAGIC:
            self._fail(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        self._pos = 4
        version = self._u32("the header")
        if version != VERSION:
            hint = " (a big-endian GGUF?)" if version == VERSION << 24 else ""
            self._fail(f"GGUF version {version}, expected {VERSION}{hint}")
        self.version = version
        n_tensors, n_kv = self._u64("the header"), self._u64("the header")
        room = size - self._pos
        if n_kv * _MIN_KV > room:
            self._fail(f"metadata key count {n_kv} cannot fit in the {room} bytes after the header "
                       f"(each key needs at least {_MIN_KV})")
        if n_tensors * _MIN_TENSOR > room:
            self._fail(f"tensor count {n_tensors} cannot fit in the {room} bytes after the header "
                       f"(each tensor entry needs at least {_MIN_TENSOR})")
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR > room:
            self._fail(f"{n_kv} metadata keys and {n_tensors} tensors cannot fit in the {room} bytes after the header")

        self.metadata: dict[str, Field] = {}
        for i in range(n_kv):
            at = self._pos
            key = self._string(f"metadata key #{i} name")
            if not key:
                self._fail(f"metadata key #{i} at byte {at} has an empty name")
            if key in self.metadata:
                self._fail(f"duplicate metadata key '{key}' (at byte {at})")
            what = f"metadata key '{key}'"
            vtype = self._u32(what)
            if vtype not in VALUE_TYPE_NAMES:
                self._fail(f"{what} has unknown value type {vtype} at byte {self._pos - 4} (expected 0..12)")
            if vtype == ARRAY:
                etype, value = self._array(what, 0)
            else:
                etype, value = None, self._value(vtype, what)
            self.metadata[key] = Field(key, vtype, value, etype)

        self.alignment = self._alignment()
        self.tensors: dict[str, TensorInfo] = {}
        entries, seen = [], set()
        for i in range(n_tensors):
            at = self._pos
            name = self._string(f"tensor #{i} name")
            if not name:
                self._fail(f"tensor #{i} at byte {at} has an empty name")
            if name in seen:
                self._fail(f"duplicate tensor name {name} (at byte {at})")
            what = f"tensor {name}"
            n_dims = self._u32(what)
            if not 1 <= n_dims <= MAX_DIMS:
                self._fail(f"{what} has n_dims {n_dims}, expected 1..{MAX_DIMS}")
            ggml_shape = tuple(self._u64(what) for _ in range(n_dims))
            n = 1
            for d in ggml_shape:
                if d < 1:
                    self._fail(f"{what} has a zero dimension {list(ggml_shape)}")
                n *= d
            if n >= 1 << 63:
                self._fail(f"{what} element count of {list(ggml_shape)} overflows int64")
            ggml_type = self._u32(what)
            try:
                nbytes = tensor_nbytes(ggml_type, ggml_shape)
            except ValueError as e:
                self._fail(f"{what}: {e}")
            rel = self._u64(what)
            if rel % self.alignment:
                self._fail(f"{what} data offset {rel} is not a multiple of the alignment {self.alignment}")
            entries.append((name, ggml_type, ggml_shape, rel, nbytes))
            seen.add(name)

        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        for name, ggml_type, ggml_shape, rel, nbytes in entries:
            off = self.data_offset + rel
            if off + nbytes > size:
                self._fail(f"tensor {name} ({type_name(ggml_type)} {list(ggml_shape)}) data [{off}, {off + nbytes}) "
                           f"extends past the end of the file (size {size})")
            self.tensors[name] = TensorInfo(name, ggml_type, ggml_shape, tuple(reversed(ggml_shape)), off, nbytes)
        prev = None
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and info.offset < prev.offset + prev.nbytes:
                self._fail(f"tensor {info.name} data [{info.offset}, {info.offset + info.nbytes}) overlaps tensor "
                           f"{prev.name} [{prev.offset}, {prev.offset + prev.nbytes})")
            prev = info
        del self._pos

    def _alignment(self) -> int:
        f = self.metadata.get(N.KEY_ALIGNMENT)
        if f is None:
            return DEFAULT_ALIGNMENT
        if f.type != UINT32:
            self._fail(f"metadata key '{N.KEY_ALIGNMENT}' has type {VALUE_TYPE_NAMES[f.type]}, expected u32")
        if f.value == 0 or f.value & (f.value - 1):
            self._fail(f"metadata key '{N.KEY_ALIGNMENT}' is {f.value}, expected a non-zero power of two")
        return f.value

    # ---- primitive reads; each checks the bytes left first ----
    def _need(self, n: int, what: str) -> int:
        pos = self._pos
        if pos + n > self.file_size:
            self._fail(f"truncated at byte {pos + n} while reading {what} (file is {self.file_size} bytes)")
        self._pos = pos + n
        return pos

    def _u32(self, what: str) -> int:
        return _U32.unpack_from(self._mm, self._need(4, what))[0]

    def _u64(self, what: str) -> int:
        return _U64.unpack_from(self._mm, self._need(8, what))[0]

    def _string(self, what: str) -> str:
        at = self._pos
        n = self._u64(what)
        left = self.file_size - self._pos
        if n > left:
            self._fail(f"{what}: string length {n} at byte {at} runs past the end of the file "
                       f"({left} bytes left, file is {self.file_size} bytes: truncated or corrupt)")
        pos = self._need(n, what)
        try:
            return str(self._mm[pos: pos + n], "utf-8")
        except UnicodeDecodeError as e:
            self._fail(f"{what}: string at byte {at} is not valid UTF-8 ({e.reason} at byte {pos + e.start})")

    def _value(self, vtype: int, what: str):
        if vtype == STRING:
            return self._string(what)
        s = _SCALARS[vtype]
        pos = self._need(s.size, what)
        v = s.unpack_from(self._mm, pos)[0]
        if vtype == BOOL:
            if v > 1:
                self._fail(f"{what}: bool value {v} at byte {pos}, expected 0 or 1")
            return bool(v)
        return v

    def _array(self, what: str, depth: int):
        at = self._pos
        etype = self._u32(what)
        if etype not in VALUE_TYPE_NAMES:
            self._fail(f"{what} is an array of unknown value type {etype} at byte {at} (expected 0..12)")
        count = self._u64(what)
        left = self.file_size - self._pos
        if count * _MIN_SIZE[etype] > left:
            self._fail(f"{what}: array length {count} of {VALUE_TYPE_NAMES[etype]} at byte {at} needs at least "
                       f"{count * _MIN_SIZE[etype]} bytes, only {left} left (file is {self.file_size} bytes: "
                       f"truncated or corrupt)")
        if etype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self._fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            return etype, [self._array(f"{what}[{i}]", depth + 1)[1] for i in range(count)]
        if etype == STRING:
            return etype, self._string_array(count, what)
        pos = self._need(count * _MIN_SIZE[etype], what)
        arr = np.frombuffer(self._mm, dtype=_DTYPES[etype], count=count, offset=pos).copy()
        if etype == BOOL:
            if arr.size and arr.max() > 1:
                self._fail(f"{what}: bool array holds {arr.max()} at element {int(arr.argmax())}, expected 0 or 1")
            arr = arr.view(np.bool_)
        return etype, arr

    def _string_array(self, count: int, what: str) -> list[str]:
        """The hot loop (129k tokens, 128k merges): lengths checked inline, messages built only on failure."""
        mm, size, pos = self._mm, self.file_size, self._pos
        unpack = _U64.unpack_from
        out = [None] * count
        for i in range(count):
            if pos + 8 > size:
                self._pos = pos
                self._need(8, f"{what} element {i}")
            n = unpack(mm, pos)[0]
            pos += 8
            if n > size - pos:
                self._fail(f"{what} element {i}: string length {n} at byte {pos - 8} runs past the end of "
                           f"the file ({size - pos} bytes left, file is {size} bytes: truncated or corrupt)")
            out[i] = mm[pos: pos + n]
            pos += n
        self._pos = pos
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError:
            for i, b in enumerate(out):
                try:
                    b.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._fail(f"{what} element {i} is not valid UTF-8 ({e.reason}: {b[:40]!r})")
            raise
