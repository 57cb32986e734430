"""Fresh random inputs of one ds4::MoE call (the kernel and TensorRT-plugin tests)."""

import numpy as np

from ds4trt.testing.tiny_gguf import random_quant


def random_moe_inputs(types, T: int, seed: int, E: int, F: int, D: int, k: int):
    """-> v [T, D] ~ 3 N(0, 1) (the SwiGLU clamps bite), ids [T, k] distinct per token, weights [T, k] ~ U(0.1, 1),
    (gate, up, down) blocks of the (gate, up, down) ggml `types` with dequantized std 1/sqrt(fan-in)."""
    rng = np.random.default_rng(seed)
    gate = random_quant(rng, types[0], (E, F, D), 1 / D ** 0.5)
    up = random_quant(rng, types[1], (E, F, D), 1 / D ** 0.5)
    down = random_quant(rng, types[2], (E, D, F), 1 / F ** 0.5)
    v = rng.standard_normal((T, D)).astype(np.float32) * 3
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return v, ids, w, (gate, up, down)
