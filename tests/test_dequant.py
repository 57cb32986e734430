"""ds4trt.gguf_io.dequant against gguf.quants (the reference) and against the block formats of spec §2.8."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import (BLOCK_SIZES, as_int32, dequantize, dequantize_rows, raw_rows,
                                    tensor_nbytes)

QUANT = (N.Q8_0, N.Q2_K, N.Q4_K, N.IQ2_XXS)
# byte offsets of the f16 scales inside one block: Q8_0 d; Q2_K d, dmin; Q4_K d, dmin; IQ2_XXS d.
F16_FIELDS = {N.Q8_0: (0,), N.Q2_K: (80, 82), N.Q4_K: (0, 2), N.IQ2_XXS: (0,)}
SHAPES = [(256,), (3, 512), (2, 5, 256), (4, 2, 3, 256)]


def random_blocks(ggml_type: int, shape, seed=0) -> np.ndarray:
    """Random bytes for a tensor of numpy `shape`, with every f16 scale set to a finite value in [-1, 1]."""
    rng = np.random.default_rng(seed)
    block, size = BLOCK_SIZES[ggml_type]
    n_blocks = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS.get(ggml_type, ()):
        blocks[:, off:off + 2] = rng.uniform(-1, 1, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference(raw, ggml_type, shape):
    rows = raw.reshape(-1, tensor_nbytes(ggml_type, (shape[-1],)))
    return quants.dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(shape)


@pytest.mark.parametrize("ggml_type", QUANT, ids=lambda t: N.TYPE_NAMES[t])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quant_matches_gguf(ggml_type, shape):
    raw = random_blocks(ggml_type, shape, seed=len(shape))
    got = dequantize(raw, ggml_type, shape)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, reference(raw, ggml_type, shape))


# ---- independent references written from the block descriptions of spec §2.8 ----
def _f16(b):
    return b.copy().view(np.float16).astype(np.float32)[:, 0]


def spec_q8_0(blocks):  # (n, 34) -> (n, 32): x = d * q
    return _f16(blocks[:, 0:2])[:, None] * blocks[:, 2:].view(np.int8).astype(np.float32)


def spec_q2_k(blocks):  # (n, 84) -> (n, 256)
    sc, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    out = np.zeros((len(blocks), 256), np.float32)
    for half in range(2):
        for j in range(4):
            for l in range(32):
                q = (qs[:, 32 * half + l] >> (2 * j)) & 3
                s = sc[:, 8 * half + 2 * j + (l >= 16)]
                out[:, 128 * half + 32 * j + l] = d * (s & 15) * q - dmin * (s >> 4)
    return out


def spec_q4_k(blocks):  # (n, 144) -> (n, 256); 6-bit (scale, min) pairs as ggml's get_scale_min_k4
    d, dmin, s, qs = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16].astype(np.int32), blocks[:, 16:]
    out = np.zeros((len(blocks), 256), np.float32)
    for sub in range(8):
        if sub < 4:
            sc, m = s[:, sub] & 63, s[:, sub + 4] & 63
        else:
            sc = (s[:, sub + 4] & 15) | ((s[:, sub - 4] >> 6) << 4)
            m = (s[:, sub + 4] >> 4) | ((s[:, sub] >> 6) << 4)
        chunk = qs[:, 32 * (sub // 2): 32 * (sub // 2) + 32]
        q = (chunk & 15) if sub % 2 == 0 else (chunk >> 4)
        out[:, 32 * sub: 32 * sub + 32] = (d * sc)[:, None] * q - (dmin * m)[:, None]
    return out


@pytest.mark.parametrize("ggml_type,spec_fn", [(N.Q8_0, spec_q8_0), (N.Q2_K, spec_q2_k), (N.Q4_K, spec_q4_k)],
                         ids=["Q8_0", "Q2_K", "Q4_K"])
def test_quant_matches_spec_formula(ggml_type, spec_fn):
    shape = (4, 512)
    raw = random_blocks(ggml_type, shape, seed=7)
    block, size = BLOCK_SIZES[ggml_type]
    want = spec_fn(raw.reshape(-1, size)).reshape(shape)
    np.testing.assert_allclose(dequantize(raw, ggml_type, shape), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ggml_type", QUANT + (N.F16, N.F32), ids=lambda t: N.TYPE_NAMES[t])
def test_rows_equal_slice_of_full(ggml_type):
    shape = (5, 3, 256)  # an expert-major 3-D tensor: 5 experts
    raw = random_blocks(ggml_type, shape, seed=3) if ggml_type in QUANT else \
        np.random.default_rng(3).standard_normal(shape).astype(
            np.float16 if ggml_type == N.F16 else np.float32).view(np.uint8).reshape(-1)
    full = dequantize(raw, ggml_type, shape)
    for start, stop in [(0, 1), (2, 3), (4, 5), (1, 4), (0, 5), (3, 3)]:
        np.testing.assert_array_equal(dequantize_rows(raw, ggml_type, shape, start, stop), full[start:stop])
    assert raw_rows(raw, ggml_type, shape, 2, 3).base is not None  # a view, not a copy


def test_rows_of_1d_tensor_and_bad_ranges():
    raw = random_blocks(N.Q8_0, (128,), seed=1)
    full = dequantize(raw, N.Q8_0, (128,))
    np.testing.assert_array_equal(dequantize_rows(raw, N.Q8_0, (128,), 32, 96), full[32:96])
    with pytest.raises(ValueError, match="split a Q8_0 block"):
        dequantize_rows(raw, N.Q8_0, (128,), 1, 2)
    with pytest.raises(ValueError, match="outside dim 0"):
        dequantize_rows(raw, N.Q8_0, (128,), 0, 129)


def test_plain_views():
    x32 = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = dequantize(x32.view(np.uint8).reshape(-1), N.F32, (3, 4))
    np.testing.assert_array_equal(got, x32)
    assert got.dtype == np.float32 and np.shares_memory(got, x32)  # F32 is a view
    x16 = (np.arange(12, dtype=np.float16) / 3).reshape(4, 3)
    np.testing.assert_array_equal(dequantize(x16.view(np.uint8).reshape(-1), N.F16, (4, 3)), x16.astype(np.float32))
    ids = np.arange(-6, 6, dtype=np.int32).reshape(2, 6)
    got = as_int32(ids.view(np.uint8).reshape(-1), (2, 6))
    assert got.dtype == np.int32 and np.shares_memory(got, ids)
    np.testing.assert_array_equal(got, ids)


def test_errors():
    raw = random_blocks(N.Q8_0, (64,))
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        dequantize(raw[:-1], N.Q8_0, (64,))
    with pytest.raises(ValueError, match="use as_int32"):
        dequantize(np.zeros(8, np.uint8), N.I32, (2,))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(np.zeros(2, np.float32), N.F32, (2,))
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        tensor_nbytes(N.Q4_K, (128, 2))
    with pytest.raises(ValueError, match="unknown ggml type 99"):
        tensor_nbytes(99, (4,))


def test_tensor_nbytes_flash_shapes():
    assert tensor_nbytes(N.Q8_0, (4096, 1024)) == 4096 * 1024 // 32 * 34
    assert tensor_nbytes(N.IQ2_XXS, (4096, 2048, 256)) == 4096 * 2048 * 256 // 256 * 66
    assert tensor_nbytes(N.Q2_K, (2048, 4096, 256)) == 2048 * 4096 * 256 // 256 * 84
    assert tensor_nbytes(N.Q4_K, (4096, 2048, 256)) == 4096 * 2048 * 256 // 256 * 144
    assert tensor_nbytes(N.F16, (4096, 129280)) == 4096 * 129280 * 2
    assert tensor_nbytes(N.I32, (6, 129280)) == 6 * 129280 * 4
