"""Fresh random Q8_0 weights and their float64 values (the Triton and tensor-core Q8_0 kernel tests)."""

import numpy as np
import torch

# (N, K, groups): a row count that leaves a partial row tile, K that leaves a partial 8-block step, groups
Q8_SMALL = [(50, 320, 1), (64, 256, 2), (24, 1056, 1), (40, 4096, 1)]   # the last: T = 1 splits K 16 ways
# Flash projections: attn_q_a, attn_q_b, attn_kv, attn_output_a (8 groups), attn_output_b, shared down
Q8_FLASH = [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (8192, 4096, 8), (4096, 8192, 1), (4096, 2048, 1)]


def random_q8_0(rng, N, K, std):
    """uint8 [N, K/32*34]: f16 scales d ~ std/73 * U(0.75, 1.25) (never zero), int8 quants U[-127, 127]."""
    nb = N * K // 32
    d = (std / 73.3 * rng.uniform(0.75, 1.25, (nb, 1))).astype(np.float16).view(np.uint8)
    q = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, q], axis=1).reshape(N, K // 32 * 34)


def q8_float64(wb: torch.Tensor, K: int) -> torch.Tensor:
    """Q8_0 bytes [N, K/32*34] on the device -> float64 [N, K]: d * q, the block formula, computed on the
    device (gguf.quants would take seconds for the LM head; the checks compare the two on a slice)."""
    blocks = wb.view(wb.shape[0], K // 32, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).double()
    q = blocks[..., 2:].contiguous().view(torch.int8).double()
    return (d * q).reshape(wb.shape[0], K)
