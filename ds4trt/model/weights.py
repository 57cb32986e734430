"""Weights: the tensors of an opened GGUF, checked against a layout, dequantized to torch on demand.

    load_target(path)      -> (gguf_file, cfg, weights)   config from the metadata, target_layout(cfg)
    load_mtp(path, cfg)    -> (gguf_file, weights)        mtp_layout of the *target's* cfg

Construction validates every TensorSpec (presence, allowed ggml types, exact ggml shape, gate/up
experts sharing a type) and raises a one-line Ds4Error naming the file and the tensor. Nothing is
dequantized until asked: `get(name)` returns a float32 tensor in numpy order (int64 for I32), cached;
`expert(name, e)` dequantizes one expert of a 3-D expert tensor without touching the others.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import as_int32, dequantize, dequantize_rows, type_name
from ds4trt.gguf_io.reader import GGUFFile
from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import TensorSpec, mtp_layout, target_layout


def _types(types) -> str:
    names = [type_name(t) for t in types]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class Weights:
    def __init__(self, gguf_file: GGUFFile, layout: list[TensorSpec]):
        self.file = gguf_file
        self.specs = {s.name: s for s in layout}
        self._cache: dict[str, torch.Tensor] = {}
        self._validate()

    def _fail(self, name: str, msg: str):
        raise Ds4Error(f"{self.file.path}: tensor {name}: {msg}")

    def _validate(self) -> None:
        tensors = self.file.tensors
        for spec in self.specs.values():
            info = tensors.get(spec.name)
            if info is None:
                if spec.optional:
                    continue
                raise Ds4Error(f"{self.file.path}: tensor {spec.name} is missing")
            if info.ggml_type not in spec.types:
                self._fail(spec.name, f"expected type {_types(spec.types)}, got {type_name(info.ggml_type)}")
            if tuple(info.ggml_shape) != tuple(spec.ggml_shape):
                self._fail(spec.name, f"expected ggml shape {list(spec.ggml_shape)}, got {list(info.ggml_shape)}")
        for spec in self.specs.values():
            if spec.same_type_as and spec.name in tensors and spec.same_type_as in tensors:
                t, other = tensors[spec.name].ggml_type, tensors[spec.same_type_as].ggml_type
                if t != other:
                    self._fail(spec.name, f"type {type_name(t)} differs from {spec.same_type_as} ({type_name(other)}); "
                                          "gate and up experts must share a type")

    # ---- queries ----
    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def type_of(self, name: str) -> int:
        return self._info(name).ggml_type

    def shape_of(self, name: str) -> tuple[int, ...]:
        """Numpy / torch order."""
        return self._info(name).shape

    def nbytes(self, name: str) -> int:
        """The tensor's bytes in the file (its GGUF blocks)."""
        return self._info(name).nbytes

    def _info(self, name: str):
        info = self.file.tensors.get(name)
        if info is None:
            raise Ds4Error(f"{self.file.path}: tensor {name} is missing")
        return info

    # ---- values ----
    def get(self, name: str) -> torch.Tensor:
        """The whole tensor, numpy order: float32 (int64 for I32). Cached; treat as read-only."""
        t = self._cache.get(name)
        if t is None:
            info = self._info(name)
            raw = self.file.raw(name)
            if info.ggml_type == N.I32:
                t = torch.from_numpy(as_int32(raw, info.shape).astype(np.int64))
            else:
                t = torch.from_numpy(_writable(dequantize(raw, info.ggml_type, info.shape)))
            self._cache[name] = t
        return t

    def blocks(self, name: str) -> torch.Tensor:
        """The tensor's GGUF bytes as a 1-D uint8 tensor sharing the file mapping (read-only: never write it)."""
        self._info(name)                     # a one-line error for a missing tensor
        raw = self.file.raw(name)
        with warnings.catch_warnings():      # torch warns that the mapping is not writable; nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw)

    def expert(self, name: str, e: int) -> torch.Tensor:
        """Expert `e` of a 3-D expert tensor [E, rows, cols] as float32 [rows, cols], not dequantizing the rest."""
        if name in self._cache:
            return self._cache[name][e]
        info = self._info(name)
        if len(info.shape) != 3:
            raise ValueError(f"{name} is not a 3-D expert tensor (shape {info.shape})")
        if not 0 <= e < info.shape[0]:
            raise IndexError(f"expert {e} out of range for {name} with {info.shape[0]} experts")
        rows = dequantize_rows(self.file.raw(name), info.ggml_type, info.shape, e, e + 1)
        return torch.from_numpy(_writable(rows).reshape(info.shape[1:]))

    def close(self) -> None:
        self._cache.clear()
        self.file.close()


def _writable(a: np.ndarray) -> np.ndarray:
    """F32 dequantization returns a read-only view of the file mapping; torch wants its own copy."""
    return a if a.flags.writeable else a.copy()


def load_target(path: str | Path) -> tuple[GGUFFile, ModelConfig, Weights]:
    """Open a target GGUF: read the config from its metadata and check every tensor of target_layout(cfg)."""
    f = GGUFFile(path)
    try:
        cfg = ModelConfig.from_gguf(f)
        return f, cfg, Weights(f, target_layout(cfg))
    except BaseException:
        f.close()
        raise


def load_mtp(path: str | Path, cfg: ModelConfig) -> tuple[GGUFFile, Weights]:
    """Open an MTP GGUF for the target model `cfg`: shapes are checked against the target's config."""
    f = GGUFFile(path)
    try:
        if not any(name.startswith(N.MTP_PREFIX) for name in f.tensors):
            raise Ds4Error(f"{f.path}: not an MTP GGUF (no {N.MTP_PREFIX}* tensors)")
        return f, Weights(f, mtp_layout(cfg))
    except BaseException:
        f.close()
        raise
