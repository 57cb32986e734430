"""Triton kernels (plugins/kernels): ds4::MoE and the Q8_0 matmul against float64 references.

Where they run: on a CUDA GPU, all of them, Flash widths included (scripts/gpu_kernels.sh on the H200). Without
a GPU, a small-shape subset runs under Triton's interpreter on CPU when triton is installed and
DS4_TRITON_INTERPRET=1, plus a check that every kernel variant compiles for sm_90 (ptxas from the triton
wheel; no GPU needed). Otherwise (CI: no triton) every test skips and says why.

Inputs are fresh seeded random blocks, never zeros: expert blocks from testing.tiny_gguf.random_quant (std
1/sqrt(fan-in)), Q8_0 blocks with random int8 quants and f16 scales drawn around std/73 (never zero);
v ~ 3 N(0, 1) so that the SwiGLU clamps bite; routing weights ~ U(0.1, 1). Every output and scratch buffer is
filled with NaN before the call, so an element the kernels fail to write fails the check.

Tolerance: max |out - ref| / max |ref| <= 1e-5, the ds4::MoE contract's, against float64 (the dequantized
blocks from gguf.quants, upcast; float64 products). The kernels accumulate in float32 and their tensor-core
paths carry the weights exactly and the activations to ~2^-22 (see the modules' notes), so measured errors
sit near 1e-6; 1e-5 leaves room for float32 summation over K = 8192 without hiding a wrong value (one wrong
block changes the result by ~1e-2 or more).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from triton_env import DEVICE, GPU, HAVE_TRITON, INTERP  # noqa: I001 - first: it may set TRITON_INTERPRET
from ds4trt.plugins import moe as moe_op
from ds4trt.testing.tiny_gguf import random_quant
from moe_cases import random_moe_inputs
from q8_cases import Q8_FLASH, Q8_SMALL, q8_float64, random_q8_0

if GPU or INTERP:
    from ds4trt.plugins.kernels import attn_triton, f16_triton, hc_triton, index_triton, moe_mma, moe_triton, \
        q8_triton, route_triton, topk_triton

_WHY = ("needs a CUDA GPU; run on the H200 with scripts/gpu_kernels.sh"
        + ("" if HAVE_TRITON else " (triton is not installed here)")
        + ("; or set DS4_TRITON_INTERPRET=1 for the CPU-interpreter subset" if HAVE_TRITON else ""))
pytestmark = pytest.mark.skipif(not (GPU or INTERP), reason=_WHY)
gpu_only = pytest.mark.skipif(not GPU, reason="Flash widths: needs a CUDA GPU (scripts/gpu_kernels.sh)")

Q8_0, Q2_K, Q4_K, IQ2_XXS = 8, 10, 12, 16
# (gate, up, down) types: ds4's q2 and q4 mixes, all Q2_K, all IQ2_XXS (the only mix with an IQ2_XXS down, whose
# one-pair kernel is the float path: gate and up read IQ2_XXS on integer dot products, in one loop) and an IQ2_XXS
# gate with a Q2_K up (the one-pair kernel's loops for a gate and an up of different types)
MIXES = {"iq2_iq2_q2k": (IQ2_XXS, IQ2_XXS, Q2_K), "q4k": (Q4_K, Q4_K, Q4_K), "q2k": (Q2_K, Q2_K, Q2_K),
         "iq2x3": (IQ2_XXS, IQ2_XXS, IQ2_XXS), "iq2_q2k_q2k": (IQ2_XXS, Q2_K, Q2_K)}
TOL = 1e-5
TOL_F16 = 1e-3              # kernels whose products take float16 inputs (the bound for fp16 / bf16)
CLAMP = 10.0
T_GPU = (1, 2, 3, 4, 8, 16)
T_INTERP = (1, 3, 5)


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    return float((got - ref).abs().max() / ref.abs().max())


def _deq(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf_quants.dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType(ggml_type))


def _nan(*shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)


def _in_wider(x: torch.Tensor, left: int = 3, right: int = 13) -> torch.Tensor:
    """x [T, W] on DEVICE as the column slice [:, left:left + W] of a NaN-filled [T, left + W + right] tensor (how a
    step's inputs come out of its projections' one output): a kernel reading it at the wrong row stride reads NaN."""
    wide = _nan(x.shape[0], left + x.shape[1] + right)
    wide[:, left:left + x.shape[1]] = x.to(DEVICE)
    return wide[:, left:left + x.shape[1]]


def _poisoned_workspace(T, k, D, F):
    ws = moe_triton.MoEWorkspace.create(T, k, D, F, DEVICE)
    ws.h.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    ws.order.fill_(-1)
    ws.cnt.fill_(-1)
    ws.xq.fill_(-1)
    return ws


def _moe_ref64(v, ids, w, deq, clamp):
    """float64 contract: deq[e] = (gate [F, D], up [F, D], down [D, F]) float64 tensors."""
    v, w = v.double(), w.double()
    out = torch.zeros_like(v)
    for t in range(v.shape[0]):
        for j in range(ids.shape[1]):
            gate, up, down = deq[int(ids[t, j])]
            g = torch.clamp(gate @ v[t], max=clamp)
            u = torch.clamp(up @ v[t], -clamp, clamp)
            out[t] += down @ (w[t, j] * g / (1 + torch.exp(-g)) * u)
    return out


def _deq_experts(blocks, types, experts) -> dict:
    """{e: (gate, up, down) float64 on DEVICE} of the given experts, dequantized by gguf-py (for _moe_ref64)."""
    return {int(e): tuple(torch.from_numpy(_deq(b[e], t)).double().to(DEVICE) for b, t in zip(blocks, types))
            for e in experts}


def _run_moe(v, ids, w, blocks, types, **kw):
    T, D = v.shape
    F = blocks[0].shape[1]
    out = _nan(T, D)
    got = moe_triton.moe_forward(v, ids, w, *blocks, *types, CLAMP, out=out,
                                 workspace=_poisoned_workspace(T, ids.shape[1], D, F), **kw)
    assert got.data_ptr() == out.data_ptr()
    return got


# ---------------------------------------------------------------------------------------------------
# Block decoding

@pytest.mark.parametrize("ggml_type", [Q2_K, Q4_K, IQ2_XXS], ids=["q2k", "q4k", "iq2xxs"])
def test_dequant_rows_bit_exact(ggml_type):
    rng = np.random.default_rng(100 + ggml_type)
    rows, cols = (96, 4096) if GPU else (5, 512)
    blocks = random_quant(rng, ggml_type, (rows, cols), 0.05)
    got = moe_triton.dequant_rows_triton(torch.from_numpy(blocks).to(DEVICE), ggml_type)
    assert torch.equal(got.cpu(), torch.from_numpy(_deq(blocks, ggml_type)))


# ---------------------------------------------------------------------------------------------------
# ds4::MoE

def _small_case(types, seed, T, E=8, F=256, D=512, k=3):
    return random_moe_inputs(types, T, seed, E, F, D, k)


@pytest.mark.parametrize("T", T_GPU if GPU else T_INTERP)
@pytest.mark.parametrize("mix", list(MIXES))
def test_moe_small_vs_float64_and_contract(mix, T):
    types = MIXES[mix]
    v, ids, w, blocks = _small_case(types, seed=_seed(mix, T), T=T)
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    got = _run_moe(*dev[:3], dev[3:], types)
    deq = _deq_experts(blocks, types, np.unique(ids))
    assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= TOL
    contract = moe_op.moe_reference(v, ids, w, *blocks, gate_type=types[0], up_type=types[1], down_type=types[2],
                                    n_expert=8, expert_ff=256, n_embd=512, clamp=CLAMP)
    assert _rel(got, torch.from_numpy(contract)) <= TOL


@pytest.mark.parametrize("T", [1, 3, 20])
def test_moe_per_slot_outputs_sum_to_the_output(T):
    """per_slot (what the CUDA backend calls): each slot's weighted expert output [T, k, D], summed by the caller;
    their sum is the summed call's result, and each slot alone matches float64 (short and long calls); an `out`
    with per_slot is refused."""
    types = MIXES["iq2_iq2_q2k"]
    v, ids, w, blocks = _small_case(types, seed=_seed("per slot", T), T=T)
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    slots = moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, per_slot=True)
    assert slots.shape == (T, ids.shape[1], v.shape[1])
    assert torch.equal(slots.sum(dim=1), _run_moe(*dev[:3], dev[3:], types))
    with pytest.raises(ValueError, match="per_slot returns the slots' outputs unsummed"):
        moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, per_slot=True, out=_nan(T, v.shape[1]))
    deq = _deq_experts(blocks, types, np.unique(ids))
    for j in range(ids.shape[1]):
        want = _moe_ref64(dev[0], dev[1][:, j:j + 1], dev[2][:, j:j + 1], deq, CLAMP)
        assert _rel(slots[:, j], want) <= (TOL if T <= moe_triton.CAP else TOL_F16), f"slot {j}"   # long: 1 part


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_moe_one_pair_kernel_with_and_without_prefetch(mix, prefetch):
    """Both forms of the one-pair inner loop (the default picks one per type and row count; the benchmark times
    both). An IQ2_XXS gate and up run together in one loop whose prefetch form reads pairs of blocks as words: with
    an odd block count per row (D = 768: rows of 3 blocks, misaligned pairs) it keeps the half-word loop, also
    checked here; iq2_q2k_q2k runs the IQ2_XXS loop alone in both."""
    types = MIXES[mix]
    for D in (512, 768) if types[:2] == (IQ2_XXS, IQ2_XXS) else (512,):
        v, ids, w, blocks = _small_case(types, seed=_seed(mix, prefetch, D), T=1, D=D)
        dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
        cfg = {t: (16, 4, None, prefetch) for t in set(types)}
        got = _run_moe(*dev[:3], dev[3:], types, single_config=cfg)
        deq = _deq_experts(blocks, types, np.unique(ids))
        assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= TOL, f"D = {D}"


def test_moe_iq2_activation_runs_of_zeros_and_of_extreme_scales():
    """The IQ2_XXS one-pair kernel reads the activations as per-run integers (_quant_runs): runs of 8 that are all zero,
    tiny (1e-30) or large (1e4) next to ordinary ones, and a single non-zero value in a run, still give the float64
    result (the error bound is relative to each run's own largest |x|)."""
    types = MIXES["iq2_iq2_q2k"]
    v, ids, w, blocks = _small_case(types, seed=_seed("iq2 runs"), T=2)
    v = v.copy()
    v[0, 0:8] = 0.0
    v[0, 8:16] *= 1e-30
    v[0, 16:24] *= 1e4
    v[1, 40:48] = 0.0
    v[1, 41] = -3.0
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    got = _run_moe(*dev[:3], dev[3:], types)
    deq = _deq_experts(blocks, types, np.unique(ids))
    assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= TOL


@pytest.mark.parametrize("T", [1, 9])
def test_moe_repeated_slots_and_items_over_16_pairs(T):
    """A token listing an expert twice counts it twice; 18 pairs of one expert split into items of 16 + 2."""
    types = MIXES["q4k"]
    v, _, w, blocks = _small_case(types, seed=7 + T, T=T)
    ids = np.tile(np.array([[5, 5, 2]], np.int64), (T, 1))
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    got = _run_moe(*dev[:3], dev[3:], types)
    deq = _deq_experts(blocks, types, (2, 5))
    assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= TOL


def test_moe_experts_below_multi_min_get_one_pair_items():
    """A 9-token call (verify of 8 drafts), 3 slots: expert 0 in every token and expert 2 in five (MULTI_MIN) form
    one multi-pair item each, expert 1's four pairs and experts 3..7's one or two go to one-pair items; the items
    (order, cnt) as planned and the output against float64."""
    types = MIXES["iq2_iq2_q2k"]
    T = 9
    assert moe_triton.MULTI_MIN == 5
    v, _, w, blocks = _small_case(types, seed=_seed("multi min"), T=T)
    ids = np.array([[0, 1 if t < 4 else 2, 3 + t % 5] for t in range(T)], np.int64)
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    ws = _poisoned_workspace(T, 3, v.shape[1], blocks[0].shape[1])
    got = moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, out=_nan(T, v.shape[1]), workspace=ws)
    pairs = ids.reshape(-1)
    order = np.argsort(pairs, kind="stable")                  # by expert, then pair index
    assert ws.order.cpu().tolist() == order.tolist()
    # experts 0..7 have 9, 4, 5, 2, 2, 2, 2, 1 pairs: an item of 9, four of 1, an item of 5, nine of 1
    assert ws.cnt.cpu().tolist() == [9] + [0] * 8 + [1] * 4 + [5] + [0] * 4 + [1] * 9
    deq = _deq_experts(blocks, types, np.unique(ids))
    assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= TOL


@pytest.mark.parametrize("cap, parts", [(16, 2), (64, 2), (16, 1)])
@pytest.mark.parametrize("mix", list(MIXES))
def test_moe_long_calls(mix, cap, parts):
    """T > 16 (prefill chunks): items listed on the host, up to `cap` pairs each. 40 tokens choose 3 of experts
    0..6 (~17 pairs each: at cap 16 some experts split into 16 + 1, the 1 going to the one-pair kernel), and
    token 0 alone chooses expert 7 (a one-pair item at either cap). parts 1: the activations in one float16 part,
    held to TOL_F16."""
    types = MIXES[mix]
    T = 40
    v, _, w, blocks = _small_case(types, seed=_seed(mix, cap, "long"), T=T)
    rng = np.random.default_rng(_seed(mix, cap))
    ids = np.stack([rng.permutation(7)[:3] for _ in range(T)]).astype(np.int64)
    ids[0, 0] = 7
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    got = _run_moe(*dev[:3], dev[3:], types, long_config=(cap, 32, 4, 1, parts))
    deq = _deq_experts(blocks, types, range(8))
    assert _rel(got, _moe_ref64(*dev[:3], deq, CLAMP)) <= (TOL if parts == 2 else TOL_F16)


def test_long_launch_picks_the_cheaper_items(monkeypatch):
    """A prefill chunk's CAP from its length alone (the routing stays on the device): 2048 tokens x 6 slots over 256
    experts (~48 pairs each) pack into items of 64 and 1024 tokens (~24) into items of 32. With a Q4_K matrix: two
    activation parts (LONG_CONFIGS_Q4). Where moe_mma's kernels take the gate/up (at both CAPs), by their own item
    costs: CAP 64 for 33..64 pairs an expert, 32 for 65..96 (3 items against 2 x 1.6), 64 again from 97."""
    q2, q4 = MIXES["iq2_iq2_q2k"], MIXES["q4k"]
    cpu = torch.device("cpu")                       # no moe_mma there (cuda_launch.runs_on)
    assert moe_triton.long_launch(6 * 2048, 256, q2, 2048, cpu) == moe_triton.LONG_CONFIGS[64]
    assert moe_triton.long_launch(6 * 1024, 256, q2, 2048, cpu) == moe_triton.LONG_CONFIGS[32]
    assert moe_triton.long_launch(6 * 2048, 256, q4, 2048, cpu) == moe_triton.LONG_CONFIGS_Q4[64]     # two parts
    assert moe_triton.long_launch(6 * 1024, 256, q4, 2048, cpu) == moe_triton.LONG_CONFIGS_Q4[32]
    asked = []
    monkeypatch.setattr(moe_mma, "use_gateup", lambda *a: asked.append(a) or True)
    for T, cap in ((17, 32), (1024, 32), (2048, 64), (4096, 32), (4500, 64)):
        assert moe_triton.long_launch(6 * T, 256, q2, 2048, cpu) == moe_triton.LONG_CONFIGS[cap], T
    assert asked[-2:] == [(*q2[:2], moe_triton.LONG_CONFIGS[cap][4], 2048, cap, cpu) for cap in (32, 64)]


@pytest.mark.parametrize("case", ["uniform", "skewed", "one expert", "all singles", "tiny"])
@pytest.mark.parametrize("cap", [32, 64])
def test_long_items_lists_every_item_on_the_device(case, cap):
    """_long_items against a plain listing: order is the stable sort by expert, cnt[s] the pairs (up to cap) of the
    item starting at sorted position s (0 elsewhere and at P), and the one-pair / multi-pair lists are those starts in
    order, padded with P to their fixed lengths (which must hold every item: no item lost in any routing); with apart
    False, no one-pair list and one list of every item."""
    rng = np.random.default_rng(_seed("long items " + case, cap))
    E = 256
    P = {"uniform": 2048 * 6, "skewed": 2048 * 6, "one expert": 300, "all singles": 200, "tiny": 17}[case]
    if case == "uniform":
        ids = np.concatenate([rng.permutation(E)[:6] for _ in range(P // 6)])
    elif case == "skewed":
        skew = 1.0 / np.arange(1, E + 1) ** 0.8
        ids = rng.choice(E, P, p=skew / skew.sum())
    elif case == "one expert":
        ids = np.full(P, 7)
    elif case == "all singles":
        ids = rng.permutation(E)[:P]
    else:
        ids = rng.integers(0, 3, P)
    order, cnt, singles, multis = moe_triton._long_items(torch.from_numpy(ids.astype(np.int64)), E, cap)
    assert np.array_equal(order.numpy(), np.argsort(ids, kind="stable"))
    want = np.zeros(P + 1, np.int64)
    s = 0
    for e in range(E):
        n = int((ids == e).sum())
        for first in range(0, n, cap):
            want[s + first] = min(cap, n - first)
        s += n
    assert np.array_equal(cnt.numpy(), want)
    _, cnt_together, none, every = moe_triton._long_items(torch.from_numpy(ids.astype(np.int64)), E, cap, apart=False)
    assert torch.equal(cnt_together, cnt) and none.numel() == 0 and none.dtype == torch.int32
    for got, mask, bound in ((singles, want[:P] == 1, min(E, P)),
                             (multis, want[:P] >= 2, min(P // 2, P // cap + min(E, P // 2))),
                             (every, want[:P] >= 1, min(P, P // cap + min(E, P)))):
        starts = np.flatnonzero(mask)
        assert got.dtype == torch.int32 and got.numel() == bound >= starts.size
        assert np.array_equal(got.numpy(), np.concatenate([starts, np.full(bound - starts.size, P)]))


def _flash_experts(types, seed, E=256, F=2048, D=4096, pool=8):
    """Flash-shaped expert tensors on the GPU: `pool` experts (0, 255 and random others) hold fresh
    random_quant blocks; every other expert holds random bytes (scales included: NaN or huge values poison
    any read of an expert no token chose). Returns (blocks, pool ids, float64 dequantized pool experts)."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([[0, E - 1], rng.choice(np.arange(1, E - 1), pool - 2, replace=False)])
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks, deq = [], {int(e): [] for e in ids}
    for t, (rows, cols) in zip(types, ((F, D), (F, D), (D, F))):
        full = torch.randint(0, 256, moe_op.blocks_shape(t, E, rows, cols), dtype=torch.uint8, device=DEVICE,
                             generator=gen)
        part = random_quant(rng, t, (pool, rows, cols), 1 / cols ** 0.5)
        full[torch.from_numpy(ids).to(DEVICE)] = torch.from_numpy(part).to(DEVICE)
        blocks.append(full)
        for n, e in enumerate(ids):
            deq[int(e)].append(torch.from_numpy(_deq(part[n], t)).to(DEVICE).double())
    return blocks, ids, deq


@gpu_only
@pytest.mark.parametrize("mix", list(MIXES))
def test_moe_flash_widths(mix):
    """D = 4096, F = 2048, E = 256, k = 6; T = 1..16 tokens choosing 6 of 8 experts (so T > 1 shares experts:
    experts of MULTI_MIN or more pairs in multi-pair items, the others in one-pair items; expert 255 exercises
    the largest offsets)."""
    types = MIXES[mix]
    blocks, pool, deq = _flash_experts(types, seed=len(mix))
    rng = np.random.default_rng(1000 + len(mix))
    for T in T_GPU:
        ids = np.stack([rng.permutation(pool)[:6] for _ in range(T)]).astype(np.int64)
        v = torch.from_numpy(rng.standard_normal((T, 4096)).astype(np.float32) * 3).to(DEVICE)
        w = torch.from_numpy(rng.uniform(0.1, 1.0, (T, 6)).astype(np.float32)).to(DEVICE)
        ids_t = torch.from_numpy(ids).to(DEVICE)
        err = _rel(_run_moe(v, ids_t, w, blocks, types), _moe_ref64(v, ids_t, w, deq, CLAMP))
        assert err <= TOL, f"T = {T}: relative error {err:.3g}"


@gpu_only
def test_moe_flash_widths_long_call():
    """A 300-token prefill chunk at Flash widths (q2 mix): 1800 pairs over 8 experts, items of up to 64 pairs
    (long_launch)."""
    types = MIXES["iq2_iq2_q2k"]
    blocks, pool, deq = _flash_experts(types, seed=31)
    rng = np.random.default_rng(31)
    T = 300
    ids = torch.from_numpy(np.stack([rng.permutation(pool)[:6] for _ in range(T)]).astype(np.int64)).to(DEVICE)
    v = torch.from_numpy(rng.standard_normal((T, 4096)).astype(np.float32) * 3).to(DEVICE)
    w = torch.from_numpy(rng.uniform(0.1, 1.0, (T, 6)).astype(np.float32)).to(DEVICE)
    ref = _moe_ref64(v, ids, w, deq, CLAMP)
    for parts in (1, 2):
        err = _rel(_run_moe(v, ids, w, blocks, types, long_config=(*moe_triton.LONG_CONFIGS[64][:4], parts)), ref)
        assert err <= (TOL if parts == 2 else TOL_F16), f"{parts} part(s): relative error {err:.3g}"


@gpu_only
def test_moe_graph_replay_and_determinism():
    """A CUDA graph of one call (static workspace) replays to the eager result, bit for bit, twice."""
    types = MIXES["iq2_iq2_q2k"]
    v, ids, w, blocks = _small_case(types, seed=11, T=4)
    v, ids, w, *blocks = (torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks))
    eager = moe_triton.moe_forward(v, ids, w, *blocks, *types, CLAMP).clone()
    assert torch.equal(moe_triton.moe_forward(v, ids, w, *blocks, *types, CLAMP), eager)
    ws = _poisoned_workspace(4, 3, 512, 256)
    out = _nan(4, 512)
    moe_triton.moe_forward(v, ids, w, *blocks, *types, CLAMP, out=out, workspace=ws)     # compile, warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_triton.moe_forward(v, ids, w, *blocks, *types, CLAMP, out=out, workspace=ws)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("mix", ["iq2_iq2_q2k", "q4k"])
def test_moe_with_the_shared_experts_down(mix):
    """moe_forward's `shared` (one token): a Q8_0 shared expert's SwiGLU and down product computed by extra
    programs of the routed experts' first and down launches, from its gate's and up's products gu. per_slot's last
    slot is the shared expert's output alone and the summed output the routed experts plus it (both against float64),
    the scratch poisoned first; the routed slots are bit for bit those of a call without it (Flash widths on the
    GPU). Refused: more than one token, arrays of another shape."""
    from ds4trt.model.moe import swiglu

    types = MIXES[mix]
    D, F, k = (4096, 2048, 6) if GPU else (512, 256, 3)
    v, ids, w, blocks = _small_case(types, seed=_seed("shared", mix), T=1, D=D, F=F, k=k)
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    rng = np.random.default_rng(_seed("shared q8", mix))
    wb = torch.from_numpy(random_q8_0(rng, D, F, 1 / F ** 0.5)).to(DEVICE)
    gu = torch.from_numpy(rng.standard_normal((1, 2 * F)).astype(np.float32) * 4).to(DEVICE)   # some clamped
    shared = (gu, *q8_triton.split_q8(wb, D, F))
    sh64 = swiglu(gu[:, :F].double(), gu[:, F:].double(), CLAMP) @ q8_float64(wb, F).T
    ws = moe_triton.MoEWorkspace.create(1, k, D, F, DEVICE, shared=True)
    ws.h.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    ws.sh.fill_(float("nan"))
    ws.xq.fill_(-1)
    slots = moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, per_slot=True, workspace=ws, shared=shared)
    assert slots.shape == (1, k + 1, D)
    assert _rel(slots[:, k], sh64) <= TOL
    assert torch.equal(slots[:, :k], moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, per_slot=True))
    out = moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, out=_nan(1, D), shared=shared)
    assert _rel(out, _moe_ref64(*dev[:3], _deq_experts(blocks, types, np.unique(ids)), CLAMP) + sh64) <= TOL
    with pytest.raises(ValueError, match="calls of one token, got T = 2"):
        moe_triton.moe_forward(dev[0].expand(2, D).contiguous(), dev[1].expand(2, k), dev[2].expand(2, k), *dev[3:],
                               *types, CLAMP, shared=shared)
    with pytest.raises(ValueError, match=r"split_q8 arrays of the down \[%d, %d\]" % (D, F)):
        moe_triton.moe_forward(*dev[:3], *dev[3:], *types, CLAMP, shared=(shared[0], *q8_triton.split_q8(
            torch.from_numpy(random_q8_0(rng, F, D, 0.1)).to(DEVICE), F, D)))


# ---------------------------------------------------------------------------------------------------
# Q8_0

def _q8_check(Ts, N, K, groups, seed, config=None):
    rng = np.random.default_rng(seed)
    wb = random_q8_0(rng, N, K, 1 / K ** 0.5)
    wb_dev = torch.from_numpy(wb).to(DEVICE)
    wd = q8_float64(wb_dev, K)
    assert torch.equal(wd[:64].cpu(), torch.from_numpy(_deq(wb[:64], Q8_0)).double())   # the formula is gguf's
    rpg = N // groups
    quants, scales = q8_triton.split_q8(wb_dev, N, K)
    for T in Ts:
        x = torch.from_numpy(rng.standard_normal((T, groups * K)).astype(np.float32)).to(DEVICE)
        ref = torch.cat([x[:, g * K:(g + 1) * K].double() @ wd[g * rpg:(g + 1) * rpg].T for g in range(groups)], 1)
        out = _nan(T, N)
        got = q8_triton.q8_matmul(x, quants, scales, K, groups=groups, out=out, config=config)
        assert got.data_ptr() == out.data_ptr()
        assert not q8_triton._counters(x.device).any(), "split row tiles left their arrival counters set"
        err = _rel(got, ref)
        assert err <= TOL, f"T = {T}, N = {N}, K = {K}, groups = {groups}: relative error {err:.3g}"


@pytest.mark.parametrize("shape", Q8_SMALL, ids=lambda s: "x".join(map(str, s)))
def test_q8_small(shape):
    _q8_check(T_GPU if GPU else (1, 2, 3, 6), *shape, seed=_seed(*shape))


@pytest.mark.parametrize("nb", [2, 4])
@pytest.mark.parametrize("pf", [False, True])
def test_q8_sub_tiles(nb, pf):
    """Steps of 8 blocks taken as 8 / nb sub-steps of [word, nb blocks, row] tiles (the fifth config entry), with and
    without the prefetch: the same products, on Q8_SMALL's partial row tiles and steps, groups and K splits (min
    programs 64) and on a shape whose rows span several per thread (64-row tiles)."""
    for N, K, groups in Q8_SMALL[:3]:
        _q8_check((1, 2, 3) if GPU else (1, 3), N, K, groups, seed=_seed("q8 sub", nb, pf, N, K),
                  config=(16, 4, 64, pf, nb))
    _q8_check((1, 2, 3, 4) if GPU else (2, 4), 128, 512, 1, seed=_seed("q8 sub rows", nb, pf),
              config=(64, 4, 8, pf, nb))
    with pytest.raises(ValueError, match="blocks per tile 3"):
        q8_triton.q8_matmul(torch.zeros(1, 256, device=DEVICE), *q8_triton.split_q8(
            torch.zeros(8, 272, dtype=torch.uint8, device=DEVICE), 8, 256), 256, config=(16, 4, 528, pf, 3))


def test_q8_reads_a_misaligned_x():
    """x whose storage starts 4 bytes past a 16-byte boundary (a view into a larger tensor): the same products as an
    aligned copy (_q8_rows reads x by 16-byte loads; q8_matmul copies such an x first)."""
    rng = np.random.default_rng(_seed("q8 misaligned"))
    N, K = 64, 512
    quants, scales = q8_triton.split_q8(torch.from_numpy(random_q8_0(rng, N, K, 1 / K ** 0.5)).to(DEVICE), N, K)
    flat = torch.from_numpy(rng.standard_normal(2 * K + 1).astype(np.float32)).to(DEVICE)
    x = flat[1:].view(2, K)
    assert x.data_ptr() % 16 == 4
    assert torch.equal(q8_triton.q8_matmul(x, quants, scales, K), q8_triton.q8_matmul(x.clone(), quants, scales, K))


def test_q8_split_k_by_min_programs():
    """A larger min programs (the third config entry) splits K further: attn_output_b's shape in 16 splits on the
    GPU, a small one in 8 under the interpreter; T = 1..4 (each row count of the split kernel)."""
    N, K = (4096, 8192) if GPU else (64, 2048)
    cfg = (16, 4, q8_triton.COUNTER_SLOTS if GPU else 64)
    assert q8_triton.row_launch(N, K, 16, cfg[2])[2] == (16 if GPU else 8)
    _q8_check((1, 2, 3, 4), N, K, 1, seed=_seed("q8 split"), config=cfg)


def test_q8_launch_by_weight_size():
    """SIZE_CONFIG's launch is the one taken for its row count and weight sizes (the attention projections at T = 2),
    ROWS_CONFIG's elsewhere, and it computes the same products (a small weight with that launch given explicitly;
    at Flash widths test_q8_flash_widths runs it through rows_config)."""
    T, lo, hi, config = q8_triton.SIZE_CONFIG[0]
    assert q8_triton.rows_config(T, lo // 1024, 1024) == config
    assert q8_triton.rows_config(T, hi // 1024, 1024) == q8_triton.ROWS_CONFIG[T]
    assert q8_triton.rows_config(T, 2048, 4096) == q8_triton.ROWS_CONFIG[T]            # the shared expert's
    assert q8_triton.rows_config(T + 1, lo // 1024, 1024) == q8_triton.ROWS_CONFIG[T + 1]
    _q8_check((T,), 64, 512, 1, seed=_seed("q8 size config"), config=config)


@gpu_only
@pytest.mark.parametrize("shape", Q8_FLASH, ids=lambda s: "x".join(map(str, s)))
def test_q8_flash_widths(shape):
    _q8_check(T_GPU, *shape, seed=_seed(*shape))


@gpu_only
def test_q8_lm_head():
    _q8_check((1, 4), 129280, 4096, 1, seed=5)


# ---------------------------------------------------------------------------------------------------
# Hyper-connections

@pytest.mark.parametrize("D", [96, 4096] if GPU else [96, 1056])
def test_hc_pre_vs_float64(D):
    """The fused hc_pre kernels (the sublayer's RMS norm included) against model/hc.py hc_pre in float64 on fresh
    random streams and norm weight: D = 4096 is Flash (32 programs of 128 dims per token, 8 of 512 outputs), D = 96
    leaves most programs without dims, 1056 a partial last step and a partial block of outputs."""
    from ds4trt.model.hc import hc_pre

    g = torch.Generator().manual_seed(_seed("hc_pre", D))
    S, M = 4, 24
    for T in (T_GPU if GPU else (1, 3)):
        X = torch.randn(T, S, D, generator=g) * 2
        fn = torch.randn(M, S * D, generator=g) / (S * D) ** 0.5
        scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(M, generator=g)
        norm = torch.rand(D, generator=g) + 0.5
        want = hc_pre(X.double(), fn.double(), scale.double(), base.double(), 1e-6, 1e-6, 20, norm.double())
        got = hc_triton.hc_pre_triton(X.to(DEVICE), fn.to(DEVICE), scale.to(DEVICE), base.to(DEVICE), 1e-6, 1e-6, 20,
                                      norm.to(DEVICE))
        for name, a, b in zip(("u", "post", "comb"), got, want):
            assert a.shape == b.shape, name
            assert _rel(a, b) <= TOL, f"T = {T}, {name}: relative error {_rel(a, b):.2e}"


def _parts_tol(config: tuple[int, ...]) -> float:
    """The bound of a prefill attention config (its last field the float16 parts): TOL for two, TOL_F16 for one."""
    return TOL if config[-1] == 2 else TOL_F16


def _output_rotation(g: torch.Generator, T: int, d: int, n_rot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [T, n_rot / 2] of random angles: the inverse RoPE the attention kernels apply to the last
    n_rot dims of each output (default d / 8, Flash's 64 of 512)."""
    ang = torch.rand(T, (n_rot or d // 8) // 2, generator=g, dtype=torch.float64) * 100
    return torch.cos(ang).float(), torch.sin(ang).float()


# (H, d, K): Flash (64 heads of 512, a window of 128 + 1 raw keys and 64 + 1 compressed ones: a partial last split),
# a tiny model's 4 heads of 64
ATTEND_SHAPES = [(64, 512, 194), (4, 64, 37)] if GPU else [(16, 512, 40), (4, 64, 37)]


@pytest.mark.parametrize("shape", ATTEND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_vs_float64(shape):
    """The attention kernel against model/attention.py attend_unrotate in float64: fresh random queries, keys,
    sinks and masks (about a third of the keys visible, a whole split of 32 keys masked for one row, one row seeing a
    single key), the output's tail (the last n_rot = d/8 dims) rotated back by random angles."""
    from ds4trt.model.attention import attend_unrotate

    H, d, K = shape
    g = torch.Generator().manual_seed(_seed("attend", *shape))
    for T in (T_GPU if GPU else (1, 3)):
        q, k = torch.randn(T, H, d, generator=g) * 2, torch.randn(K, d, generator=g)
        sinks = torch.randn(H, generator=g)
        mask = torch.rand(T, K, generator=g) < 0.35
        mask[0, :32] = False
        mask[-1] = False
        mask[-1, K // 2] = True
        cos, sin = _output_rotation(g, T, d)
        want = attend_unrotate(q.double(), k.double(), mask, sinks.double(), cos.double(), sin.double())
        # the default (for these few keys: SMALL_CONFIG), the one of longer calls, other chunks of keys per program
        for config in (None, attn_triton.CONFIG, (32, 1, 8), (32, 3, 8), (16, 2, 4)):
            got = attn_triton.attend_triton(q.to(DEVICE), k.to(DEVICE), mask.to(DEVICE), sinks.to(DEVICE),
                                            cos.to(DEVICE), sin.to(DEVICE), config)
            assert got.shape == want.shape
            assert _rel(got, want) <= TOL, f"T = {T}, config {config}: relative error {_rel(got, want):.2e}"


@pytest.mark.parametrize("shape", [(300, 64, 512, 64), (37, 3, 48, 12)] if GPU else [(19, 5, 64, 16), (7, 3, 48, 12)],
                         ids=lambda s: "x".join(map(str, s)))
def test_head_norm_rope_vs_float64(shape):
    """The prefill chunks' query norm + RoPE against model/attention.py head_norm_rope in float64: fresh random
    queries at magnitudes 1e-3 .. 1e3 and angles of positions up to 1e5; Flash's shape, and a head width and a
    rotated tail that are not powers of two (padded in the kernel)."""
    from ds4trt.model.attention import head_norm_rope
    from ds4trt.plugins.kernels.rope_triton import head_norm_rope_triton

    T, H, d, nr = shape
    g = torch.Generator().manual_seed(_seed("head_norm_rope", *shape))
    x = torch.randn(T, H, d, generator=g) * torch.logspace(-3, 3, T)[:, None, None]
    ang = torch.rand(T, 1, generator=g, dtype=torch.float64) * 1e5 * torch.logspace(-4, 0, nr // 2, dtype=torch.float64)
    cos, sin = torch.cos(ang), torch.sin(ang)
    want = head_norm_rope(x.double(), cos, sin, 1e-6)
    got = head_norm_rope_triton(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), 1e-6)
    assert got.shape == want.shape
    assert _rel(got, want) <= TOL, f"relative error {_rel(got, want):.2e}"
    # a prefill chunk's form: the rows given unscaled beside their power-of-two scales, the results in float16 are
    # the float16 of the plain call on the scaled rows, within one float16 step (on Triton's interpreter bit for bit;
    # compiled for an H100 the two forms' float32 arithmetic differs in the last bits, so a few values round the other
    # way), and against float64 within float16's rounding
    s = torch.ldexp(torch.ones(T), torch.randint(-20, 20, (T,), generator=g)).to(DEVICE)
    fused = head_norm_rope_triton((x.to(DEVICE) / s[:, None, None]), cos.to(DEVICE), sin.to(DEVICE), 1e-6,
                                  row_scale=s, out_dtype=torch.float16)
    assert fused.dtype == torch.float16
    ref = got.half().float().cpu()
    step = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - 11).clamp(min=2.0 ** -24)   # float16's
    far = (fused.float().cpu() - ref).abs() > step
    assert not far.any(), f"{far.sum()} values more than one float16 step from the float32 call's"
    assert _rel(fused.float(), want) <= TOL_F16, f"relative error {_rel(fused.float(), want):.2e}"


# (ratio, c, n_rot, n_nope, post): Flash's compressors (ratio 128 and 4 KV rows, the ratio-4 indexer's), the tiny
# model's (ratio 8; a head of 64 with a 48-dim FP8 part: a shorter last block) and float numerics' "none"
EMIT_CASES = [(128, 512, 64, 448, "fp8"), (4, 512, 64, 448, "fp8"), (4, 128, 64, 448, "fp4"), (8, 64, 16, 48, "fp8"),
              (4, 32, 16, 48, "fp4"), (4, 64, 16, 48, "none")]


@pytest.mark.parametrize("case", EMIT_CASES if GPU else EMIT_CASES[1:], ids=lambda c: "-".join(map(str, c)))
def test_compress_emit_vs_float64(case):
    """A compressor's rows (rows_triton) against model/attention.py emit_rows: unrounded rows against float64 within
    TOL; each rounding ("fp8", "fp4") bit for bit PyTorch's round_row of the kernel's own unrounded rows, and
    non-emitting tokens' rows zero. Fresh random rows and state at magnitudes 1e-3 .. 1e3, norm weights 1e-7 .. 10
    (blocks below FP8_MIN_AMAX, values in E4M3's subnormal range), steps of 1..16 tokens and a prefill chunk (300
    tokens on a GPU, 37 on the interpreter: several blocks, the first and last partial) starting where candidates lie
    before position 0, in the state, in the step, or both; this step's kv and score rows as column slices of wider
    NaN-filled tensors of two row strides (read in place)."""
    from ds4trt.model.attention import emit_rows, round_row
    from ds4trt.plugins.kernels.rows_triton import compress_emit_triton

    R, c, nr, n_nope, post = case
    coff = 2 if R == 4 else 1
    g = torch.Generator().manual_seed(_seed("compress_emit", *case))
    norm = torch.logspace(-7, 1, c)[torch.randperm(c, generator=g)]
    freq = torch.rand(nr // 2, generator=g, dtype=torch.float64) * torch.logspace(-4, 0, nr // 2, dtype=torch.float64)
    emitted = 0
    for T in (1, 2, 5, 16, 300) if GPU else (1, 5, 37):
        for start in (0, R - 1, 5 * R - 2, 1000 * R + 3):
            mag = torch.logspace(-3, 3, T + coff * R)[torch.randperm(T + coff * R, generator=g)][:, None]
            kv, skv = (torch.randn(T + coff * R, coff * c, generator=g) * mag).split((T, coff * R))
            sc, ssc = (torch.randn(T + coff * R, coff * c, generator=g) * 3).split((T, coff * R))
            st = torch.tensor(start)
            args = [_in_wider(kv), _in_wider(sc, 1, 6)] + [a.to(DEVICE) for a in (skv, ssc, st, norm, freq)]
            want = emit_rows(kv.double(), sc.double(), skv.double(), ssc.double(), st, norm.double(), freq, R,
                             "none", n_nope, 1e-6)
            got = compress_emit_triton(*args, R, "none", n_nope, 1e-6).cpu()
            emits = (start + torch.arange(T) + 1) % R == 0
            emitted += int(emits.sum())
            assert torch.equal(got[~emits], torch.zeros_like(got[~emits]))
            if emits.any():
                assert _rel(got, want) <= TOL, f"T = {T}, start {start}: relative error {_rel(got, want):.2e}"
            rounded = compress_emit_triton(*args, R, post, n_nope, 1e-6).cpu()
            expect = torch.where(emits[:, None], round_row(got, post, n_nope), 0.0)
            bad = (rounded != expect).sum().item()
            assert bad == 0, f"T = {T}, start {start}: {bad} of {expect.numel()} rounded values differ"
    assert emitted >= 3


@pytest.mark.parametrize("shape", [(512, 64, 448), (64, 16, 48)], ids=lambda s: "x".join(map(str, s)))
def test_kv_row_vs_float64(shape):
    """The raw KV row (rows_triton) against model/attention.py kv_row: unrounded rows against float64
    within TOL; the "fp8" rows bit for bit kv_row's rounding (FP8, then f16) of the kernel's own unrounded rows. Fresh
    rows at magnitudes 1e-3 .. 1e3, norm weights 1e-7 .. 10, angles of positions up to 1e5; Flash's row and the tiny
    model's (a 48-dim FP8 part: a shorter last block); steps of 1..16 tokens and a prefill chunk of 300; kva a column
    slice of a wider NaN-filled tensor (read in place)."""
    from ds4trt.model.attention import kv_row
    from ds4trt.model.numerics import fp8_kv_row, round_f16
    from ds4trt.plugins.kernels.rows_triton import kv_row_triton

    d, nr, n_nope = shape
    g = torch.Generator().manual_seed(_seed("kv_row", *shape))
    for T in (1, 5, 16, 300):
        kva = torch.randn(T, d, generator=g) * torch.logspace(-3, 3, T)[:, None]
        norm = torch.logspace(-7, 1, d)[torch.randperm(d, generator=g)]
        ang = torch.rand(T, 1, generator=g, dtype=torch.float64) * 1e5 * torch.logspace(-4, 0, nr // 2,
                                                                                         dtype=torch.float64)
        cos, sin = torch.cos(ang), torch.sin(ang)
        want = kv_row(kva.double(), norm.double(), cos, sin, 1e-6, "none", n_nope)
        args = [_in_wider(kva)] + [a.to(DEVICE) for a in (norm, cos, sin)]
        got = kv_row_triton(*args, 1e-6, "none", n_nope).cpu()
        assert _rel(got, want) <= TOL, f"T = {T}: relative error {_rel(got, want):.2e}"
        rounded = kv_row_triton(*args, 1e-6, "fp8", n_nope).cpu()
        bad = (rounded != round_f16(fp8_kv_row(got, n_nope))).sum().item()
        assert bad == 0, f"T = {T}: {bad} of {got.numel()} rounded values differ"


def test_compress_emit_refuses_a_width_not_its_norms():
    from ds4trt.plugins.kernels.rows_triton import compress_emit_triton

    kv = torch.zeros(5, 96, device=DEVICE)                  # neither 1 nor 2 rows of c = 64
    with pytest.raises(ValueError, match="compress_emit_triton: expected float32 kv"):
        compress_emit_triton(kv, kv, kv[:4], kv[:4], torch.tensor(0, device=DEVICE), torch.ones(64, device=DEVICE),
                             torch.ones(8, dtype=torch.float64, device=DEVICE), 4, "fp8", 48, 1e-6)


def test_indexer_qat_kernel_equals_numerics_bitwise():
    """The prefill chunks' indexer rounding against model/numerics.py indexer_qat (PyTorch, on the CPU), bit for
    bit: fresh random rows at magnitudes from 1e-30 to 1e30, a zero row (amax at its floor), the unit row (every
    rotated value equal), two rows whose values all land on an E2M1 tie (5 -> 4 and 3.5 -> 4, ties to even), rows
    past a whole program; n = 128 (Flash) and 64 with blocks of 32, and n = 16 with one block of 16 (min(32, n),
    as indexer_qat)."""
    from ds4trt.model.numerics import FP4_BLOCK, FP4_MIN_AMAX, indexer_qat
    from ds4trt.plugins.kernels.qat_triton import indexer_qat_triton

    def spike(v: float, n: int) -> float:
        """t such that t * n^-1/2 is exactly v in float32: the row t e_0 rotates to n values of magnitude v."""
        c, v = torch.tensor(n ** -0.5), torch.tensor(v)
        t = v / c
        for _ in range(8):
            if t * c == v:
                return float(t)
            t = torch.nextafter(t, torch.tensor(float("inf") if t * c < v else float("-inf")))
        raise AssertionError(f"no float32 t with t * {n}^-1/2 = {float(v)}")

    g = torch.Generator().manual_seed(_seed("indexer_qat"))
    for lead, n in (((300 if GPU else 37, 64), 128), ((45,), 64), ((9, 3), 16)):
        x = torch.randn(*lead, n, generator=g) * torch.logspace(-30, 30, lead[0])[(...,) + (None,) * len(lead)]
        rows = x.view(-1, n)
        rows[1:5] = 0.0
        rows[2, 0] = 1.0
        rows[3, 0] = spike(5 * 2.0 ** -8, n)          # every value 5 * 2^-8: scale 2^-8, y = 5, a tie
        rows[4, 0] = spike(7 * 2.0 ** -9, n)          # 3.5 * 2^-8: y = 3.5, a tie
        want = indexer_qat(x)
        got = indexer_qat_triton(x.to(DEVICE), min(FP4_BLOCK, n), FP4_MIN_AMAX).cpu()
        bad = (got != want).sum().item()
        assert bad == 0, f"n = {n}: {bad} of {want.numel()} values differ"


@pytest.mark.parametrize("D", [4096, 1056] if GPU else [128, 1056])
def test_hc_pre_long_vs_float64(D):
    """The prefill chunks' hc_pre against model/hc.py hc_pre in float64 on fresh random streams of several
    magnitudes (tf32x3 keeps float32's range): T past a whole number of token blocks, D = 1056 a partial
    block of outputs; at LONG_CONFIG and a smaller shape."""
    from ds4trt.model.hc import hc_sum_streams

    g = torch.Generator().manual_seed(_seed("hc_pre_long", D))
    S, M = 4, 24
    T = 300 if GPU else 19
    X = torch.randn(T, S, D, generator=g) * torch.logspace(-1, 3, T)[:, None, None]
    fn = torch.randn(M, S * D, generator=g) / (S * D) ** 0.5
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(M, generator=g)
    want = hc_sum_streams(X.double(), fn.double(), scale.double(), base.double(), 1e-6, 1e-6, 20)
    for config in (None, (16, 32, 2, 4)):
        got = hc_triton.hc_pre_long_triton(X.to(DEVICE), fn.to(DEVICE), scale.to(DEVICE), base.to(DEVICE), 1e-6,
                                           1e-6, 20, config)
        for name, a, b in zip(("y", "post", "comb"), got, want):
            assert a.shape == b.shape, name
            assert _rel(a, b) <= TOL, f"config {config}, {name}: relative error {_rel(a, b):.2e}"


@pytest.mark.parametrize("D", [4096, 300] if GPU else [64, 40])
def test_hc_post_vs_float64(D):
    """The prefill chunks' stream update against model/hc.py hc_post in float64 (fresh random f, X, post, comb;
    a D that is not a multiple of the kernel's block of dims)."""
    from ds4trt.model.hc import hc_post

    g = torch.Generator().manual_seed(_seed("hc_post", D))
    S = 4
    for T in ((1, 17, 300) if GPU else (1, 5)):
        f, X = torch.randn(T, D, generator=g), torch.randn(T, S, D, generator=g) * 2
        post, comb = torch.rand(T, S, generator=g) * 2, torch.rand(T, S, S, generator=g)
        want = hc_post(f.double(), X.double(), post.double(), comb.double())
        got = hc_triton.hc_post_triton(*(a.to(DEVICE) for a in (f, X, post, comb)))
        assert _rel(got, want) <= TOL, f"T = {T}: relative error {_rel(got, want):.2e}"


@pytest.mark.parametrize("D", [4096, 96] if GPU else [96, 1056])
def test_hc_post_pre_vs_float64(D):
    """A decode / verify step's stream update fused with the next reduction against model/hc.py hc_post_pre in
    float64 (fresh random f, X, post, comb; D = 96 leaves most programs without dims, 1056 a partial step of dims);
    f also as J = 7 terms (a decode step's routed slots and shared expert), which the kernel sums."""
    from ds4trt.model.hc import hc_post_pre

    g = torch.Generator().manual_seed(_seed("hc_post_pre", D))
    S, M = 4, 24
    for T, J in [(T, J) for T in (T_GPU if GPU else (1, 3)) for J in (None, 7)]:
        f = torch.randn(T, D, generator=g) if J is None else torch.randn(T, J, D, generator=g)
        X = torch.randn(T, S, D, generator=g) * 2
        post, comb = torch.rand(T, S, generator=g) * 2, torch.rand(T, S, S, generator=g)
        fn = torch.randn(M, S * D, generator=g) / (S * D) ** 0.5
        scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(M, generator=g)
        norm = torch.rand(D, generator=g) + 0.5
        f_sum = f.double() if J is None else f.double().sum(dim=1)
        want = hc_post_pre(f_sum, *(a.double() for a in (X, post, comb, fn, scale, base)), 1e-6, 1e-6, 20,
                           norm.double())
        got = hc_triton.hc_post_pre_triton(*(a.to(DEVICE) for a in (f, X, post, comb, fn, scale, base)), 1e-6, 1e-6,
                                           20, norm.to(DEVICE))
        for name, a, b in zip(("X", "u", "post", "comb"), got, want):
            assert a.shape == b.shape, name
            assert _rel(a, b) <= TOL, f"T = {T}, J = {J}, {name}: relative error {_rel(a, b):.2e}"


# (H, d, T, K): Flash at a prefill block (256 queries; the raw window band, a masked run of compressed rows), a
# tiny model's 4 heads of 64
ATTEND_LONG_SHAPES = [(64, 512, 256, 700), (4, 64, 37, 90)] if GPU else [(16, 128, 7, 70), (4, 64, 9, 37)]
# LONG_CONFIG, and others: two queries a program (a partial last query block when T is odd), half the heads,
# more keys a block, one dot over all d and one output block, output blocks of 16 dims (the rotated tail, d / 4 in
# this test, spans several); the last two with one float16 part (TOL_F16)
ATTEND_LONG_CONFIGS = (None, (2, 32, 32, 64, 256, 8, 2, 2), (1, 8, 64, 128, 512, 4, 1, 2), (4, 16, 16, 32, 64, 4, 2, 2),
                       (2, 16, 32, 32, 16, 4, 1, 2), (1, 64, 64, 64, 512, 8, 2, 1), (2, 16, 32, 32, 16, 4, 1, 1))


@pytest.mark.parametrize("shape", ATTEND_LONG_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_long_vs_float64(shape):
    """The prefill attention kernel against model/attention.py attend_unrotate in float64: fresh random queries,
    keys, sinks and rotation angles (the output's last d/4 dims rotated back); a sliding-window band like the raw
    keys' plus random visible compressed rows, one row seeing no key (its output: 0), one a single key, a block of
    keys no row sees (skipped). With `out`, the rows of a poisoned larger output are written and no other."""
    from ds4trt.model.attention import attend_unrotate

    H, d, T, K = shape
    g = torch.Generator().manual_seed(_seed("attend_long", *shape))
    q, k = torch.randn(T, H, d, generator=g) * 2, torch.randn(K, d, generator=g)
    sinks = torch.randn(H, generator=g)
    cos, sin = _output_rotation(g, T, d, d // 4)
    i, j = torch.arange(T)[:, None], torch.arange(K)[None, :]
    mask = ((j >= i) & (j < i + K // 4)) | (torch.rand(T, K, generator=g) < 0.3) & (j >= K // 2)
    mask[:, K // 2:K // 2 + 16] = False
    mask[1] = False
    mask[-1] = False
    mask[-1, K - 1] = True
    want = attend_unrotate(q.double(), k.double(), mask, sinks.double(), cos.double(), sin.double())
    args = tuple(a.to(DEVICE) for a in (q, k, mask, sinks, cos, sin))
    for config in ATTEND_LONG_CONFIGS:
        got = attn_triton.attend_long_triton(*args, config)
        assert got.shape == want.shape
        assert _rel(got, want) <= _parts_tol(config or attn_triton.LONG_CONFIG), \
            f"config {config}: relative error {_rel(got, want):.2e}"
        assert float(got[1].abs().max()) == 0.0, f"config {config}: a row that sees no key"
    whole = torch.full((T + 3, H, d), float("nan"), device=DEVICE)
    assert attn_triton.attend_long_triton(*args, out=whole[2:T + 2]).data_ptr() == whole[2].data_ptr()
    assert _rel(whole[2:T + 2], want) <= _parts_tol(attn_triton.LONG_CONFIG)
    assert whole[:2].isnan().all() and whole[T + 2:].isnan().all(), "rows outside out written"


# (H, d, T, Kr, Kc, k): Flash at a prefill chunk's 48 queries (their window band and 512 top rows of 3000), a
# tiny model's 4 heads of 64 with top-3 (fewer heads than tl.dot's 16 rows, a partial block of top rows)
ATTEND_TOP_SHAPES = [(64, 512, 48, 175, 3000, 512), (4, 64, 37, 90, 50, 3)] if GPU else \
    [(16, 128, 5, 40, 70, 24), (4, 64, 6, 30, 20, 3)]
# TOP_CONFIG, and others: half the heads and smaller blocks, one dot over all d and one output block; the last two
# with one float16 part (TOL_F16)
ATTEND_TOP_CONFIGS = (None, (32, 32, 32, 64, 4, 2, 2), (8, 16, 128, 512, 4, 1, 2), (64, 64, 64, 256, 8, 3, 1),
                      (8, 16, 32, 32, 4, 1, 1))


@pytest.mark.parametrize("shape", ATTEND_TOP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attend_top_vs_float64(shape):
    """The prefill attention over each query's own top rows against model/attention.py attend_unrotate in float64
    over the raw keys and comp[top[t]]: fresh random queries, keys, sinks, rotation angles (the output's last d/8
    dims rotated back), distinct random top rows per query; a window band of raw keys, top rows invisible at random
    and a whole block of them for every query (skipped), one query seeing no key (its output: 0), one a single top
    row."""
    from ds4trt.model.attention import attend_unrotate

    H, d, T, KR, KC, k = shape
    g = torch.Generator().manual_seed(_seed("attend_top", *shape))
    q, raw, comp = torch.randn(T, H, d, generator=g) * 2, torch.randn(KR, d, generator=g), torch.randn(KC, d,
                                                                                                     generator=g)
    sinks = torch.randn(H, generator=g)
    cos, sin = _output_rotation(g, T, d)
    i, j = torch.arange(T)[:, None], torch.arange(KR)[None, :]
    raw_mask = (j >= i) & (j < i + KR // 3)
    top = torch.stack([torch.randperm(KC, generator=g)[:k] for _ in range(T)])
    top_vis = torch.rand(T, k, generator=g) < 0.8
    top_vis[:, k // 2:k // 2 + 16] = False
    raw_mask[1], top_vis[1] = False, False
    raw_mask[-1], top_vis[-1] = False, False
    top_vis[-1, k - 1] = True
    want = torch.cat([attend_unrotate(q[t:t + 1].double(), torch.cat([raw, comp[top[t]]]).double(),
                                      torch.cat([raw_mask[t], top_vis[t]])[None], sinks.double(),
                                      cos[t:t + 1].double(), sin[t:t + 1].double()) for t in range(T)])
    args = tuple(a.to(DEVICE) for a in (q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin))
    for config in ATTEND_TOP_CONFIGS:
        got = attn_triton.attend_top_triton(*args, config=config)
        assert got.shape == want.shape
        assert _rel(got, want) <= _parts_tol(config or attn_triton.TOP_CONFIG), \
            f"config {config}: relative error {_rel(got, want):.2e}"
        assert float(got[1].abs().max()) == 0.0, f"config {config}: a query that sees no key"


# (N, K): the router, a ratio-4 compressor, the indexer's query projection and per-head weights at Flash width; odd
# sizes (a partial row tile, K not a multiple of the K tile)
F16_SHAPES = [(256, 4096), (1024, 4096), (8192, 1024), (64, 4096), (100, 200)] if GPU else [(64, 256), (37, 100)]


@pytest.mark.parametrize("shape", F16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_f16_matmul_vs_float64(shape):
    """The F16 matrix product against float64 on fresh random f16 weights and float32 rows, T = 1..MAX_T."""
    N, K = shape
    g = torch.Generator().manual_seed(_seed("f16", *shape))
    w = (torch.randn(N, K, generator=g) / K ** 0.5).half()
    for T in range(1, f16_triton.MAX_T + 1):
        x = torch.randn(T, K, generator=g) * 3
        got = f16_triton.f16_matmul(x.to(DEVICE), w.to(DEVICE))
        assert _rel(got, x.double() @ w.double().T) <= TOL, f"T = {T}"


# (nh, di, K): Flash's indexer (64 heads of 128, 2k context: 512 compressed rows + 1, a partial last program),
# a tiny model's 4 heads of 32
INDEX_SHAPES = [(64, 128, 513), (4, 32, 37)] if GPU else [(8, 128, 37), (4, 32, 5)]


@pytest.mark.parametrize("shape", INDEX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_index_score_vs_float64(shape):
    """The indexer-score kernel against model/attention.py index_score in float64, fresh random weights, queries and
    keys (relu clips about half of the products), at CONFIG and at the float32 FMA form ("ieee")."""
    from ds4trt.model.attention import index_score

    nh, di, K = shape
    g = torch.Generator().manual_seed(_seed("index", *shape))
    for T in (T_GPU if GPU else (1, 3)):
        w, q = torch.randn(T, nh, generator=g), torch.randn(T, nh, di, generator=g)
        keys = torch.randn(K, di, generator=g)
        want = index_score(w.double(), q.double(), keys.double())
        for config in (None, (16, 4, "ieee")):
            got = index_triton.index_score_triton(w.to(DEVICE), q.to(DEVICE), keys.to(DEVICE), config)
            assert got.shape == want.shape
            assert _rel(got, want) <= TOL, f"T = {T}, config {config}: relative error {_rel(got, want):.2e}"


@pytest.mark.parametrize("shape", INDEX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_index_score_long_vs_float64(shape):
    """The prefill chunks' indexer-score kernel against model/attention.py index_score in float64 (fresh random
    inputs; T past a whole number of query blocks, K past a whole number of key blocks), at LONG_CONFIG and
    another shape."""
    from ds4trt.model.attention import index_score

    nh, di, K = shape
    g = torch.Generator().manual_seed(_seed("index_long", *shape))
    T = 300 if GPU else 19
    w, q, keys = torch.randn(T, nh, generator=g), torch.randn(T, nh, di, generator=g), torch.randn(K, di, generator=g)
    want = index_score(w.double(), q.double(), keys.double())
    for config in (None, (32, 8, 4)):
        got = index_triton.index_score_long_triton(w.to(DEVICE), q.to(DEVICE), keys.to(DEVICE), config)
        assert got.shape == want.shape
        assert _rel(got, want) <= TOL, f"config {config}: relative error {_rel(got, want):.2e}"


# (E experts, k chosen): Flash's router, the tiny models'
ROUTE_SHAPES = [(256, 6), (8, 2)]


@pytest.mark.parametrize("shape", ROUTE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_route_vs_model(shape):
    """The router kernel against model/moe.py route in float64 on fresh logits and bias rounded to quarters (equal
    values), row 0 shifted down by 9 (softplus's small values), logits beyond both ends of its range (-30, 25), and
    in row 0 an unchosen expert made equal to the k-th chosen one (the lower id must win): the same ids, the
    weights to 1e-5; steps of 1..16 tokens and a prefill chunk (300 tokens, 37 on the interpreter)."""
    from ds4trt.model.moe import WEIGHT_SUM_FLOOR, route

    E, k = shape
    g = torch.Generator().manual_seed(_seed("route", *shape))
    tokens = torch.zeros(1, dtype=torch.long)
    for T in ((*T_GPU, 300) if GPU else (1, 3, 37)):
        logits = torch.round(torch.randn(T, E, generator=g) * 12) / 4
        logits[0] -= 9                                  # small probs, where log(1 + exp(x)) would lose digits
        logits[-1, :2] = torch.tensor([-30.0, 25.0])
        bias = torch.round(torch.randn(E, generator=g) * 2) / 4
        chosen = route(logits[:1].double(), bias.double(), None, tokens, k, 1.5)[0][0].tolist()
        a = chosen[-1]
        b = [e for e in torch.randperm(E, generator=g).tolist() if e not in chosen][0]
        logits[0, b], bias[b] = logits[0, a], bias[a]                      # a tie at the k-th place of row 0
        want_ids, want_w = route(logits.double(), bias.double(), None, tokens.expand(T), k, 1.5)
        ids, w = route_triton.route_triton(logits.to(DEVICE), bias.to(DEVICE), k, 1.5, WEIGHT_SUM_FLOOR)
        assert min(a, b) in want_ids[0].tolist() and max(a, b) not in want_ids[0].tolist()
        assert torch.equal(ids.cpu(), want_ids), f"T = {T}: {ids.cpu().tolist()} against {want_ids.tolist()}"
        assert _rel(w, want_w) <= 1e-5, f"T = {T}: relative error {_rel(w, want_w):.2e}"


def test_route_refuses_more_slots_than_experts():
    logits = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="route_triton: expected float32 logits"):
        route_triton.route_triton(logits, torch.zeros(8, device=DEVICE), 9, 1.0, 1e-4)


# (N scores, k kept): a 4096-token cache at Flash's top-k (1024 compressed rows + a verify step's), the kernel's
# longest rows (MAX_N), and small ones (k = N: all kept; 7 columns)
@pytest.mark.parametrize("shape", [(1028, 512), (16384, 512), (40, 12), (7, 7)] if GPU
                         else [(1028, 512), (40, 12), (7, 7)])
def test_top_rows_vs_stable_sort(shape):
    """The indexer's top-k kernel keeps the same columns as a stable descending sort's first k (in ascending column
    order), on fresh scores in steps of 1/8 (many exact ties at the k-th value), -inf columns (invisible rows;
    row 0 sees fewer than k), both zeros (-0.0 equals +0.0 for the sort) and a row of one value; then a row of
    normal scores that differ down to their last bits and one of scores within a few ulps of each other (the
    lowest bits of the keys decide there). It fails when ties take any column but the lowest, or when -0.0 sorts
    below +0.0."""
    N, k = shape
    g = torch.Generator().manual_seed(_seed("top_rows", *shape))
    for T in ((*T_GPU, 300) if GPU else (1, 3, 37)):
        score = torch.randint(-16, 16, (T, N), generator=g).float() / 8
        score[torch.rand(T, N, generator=g) < 0.3] = float("-inf")
        score[0, k // 2:] = float("-inf")
        score[-1, ::3] = -0.0
        if T > 2:
            score[1] = 0.25
        fine = torch.stack([torch.randn(N, generator=g),
                            -1.5 + torch.randint(-300, 300, (N,), generator=g).float() * 2.0 ** -23])
        for rows in (score, fine):
            want = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values
            got = topk_triton.top_rows_triton(rows.to(DEVICE), k).cpu()
            assert torch.equal(got, want), f"T = {T}: {(got != want).sum().item()} columns differ"


def test_top_rows_refuses_long_rows():
    with pytest.raises(ValueError, match="top_rows_triton: expected float32 score"):
        topk_triton.top_rows_triton(torch.zeros(2, topk_triton.MAX_N + 1, device=DEVICE), 4)


def test_hc_pre_refuses_long_steps():
    X = torch.zeros(hc_triton.MAX_T + 1, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="hc_pre_triton: expected X float32"):
        hc_triton.hc_pre_triton(X, torch.zeros(24, 256, device=DEVICE), torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 20,
                                torch.ones(64, device=DEVICE))


# ---------------------------------------------------------------------------------------------------
# Cache commit

def test_commit_rows_match_cache_write():
    """commit_triton (one launch per commit) against CacheState.write on random rows: a 6-layer cache of every ratio,
    commits of 1..9 of 9 proposed rows from positions that cross the rings (raw window, 8-slot compressor states)
    and the emitting positions 4k-1, 127; every cache tensor equal bit for bit after each commit (the spare last row of
    comp / index excepted: any non-emitting row may land there, on the GPU whichever program stores last)."""
    from ds4trt.model.state import LayerRows
    from ds4trt.plugins.kernels.commit_triton import CommitPlan
    from ds4trt.runtime.cache import CacheState
    from ds4trt.testing.tiny_gguf import tiny_config

    cfg = tiny_config(compress_ratios=(0, 4, 128, 4, 128, 0))
    ctx, T = 300, 9
    gen = torch.Generator().manual_seed(23)
    got, want = (CacheState(cfg, ctx, device=DEVICE) for _ in range(2))
    pos = 0
    for n in (1, 3, 9, 2, 9, 9, 1, 5, 9, 9, 9, 7, 4) + (9,) * 6 + (8, 1):
        rows = [LayerRows(**{name: torch.randn(T, t.shape[1], generator=gen).to(DEVICE)
                             for name, t in layer.tensors().items()}) for layer in got.layers]
        start = torch.tensor(pos, device=DEVICE)
        plan = CommitPlan.build(got.layers, got.ratios, rows, n)
        ring = plan.table[:, 6] == 0                       # a ring copies only its last min(n, cap) rows
        assert torch.equal(plan.table[ring, 7], torch.clamp(n - plan.table[ring, 5], min=0))
        before = [t.clone() for t in got.tensors().values()]
        plan.load(start)
        assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(), before)), "load() wrote a row"
        plan.write(start)
        want.write(rows, n, start)
        pos += n
        for (name, a), b in zip(got.tensors().items(), want.tensors().values()):
            if name.endswith(("comp", "index")):
                a, b = a[:-1], b[:-1]
            assert torch.equal(a, b), (n, pos, name)
    assert pos > 128 and any(t.abs().sum() > 0 for t in got.tensors().values())


def test_commit_plan_refusals():
    """Rows whose elements are not contiguous: no plan (the caller falls back to CacheState.write); rows that do not
    fit the cache (too few, another width): a one-line error."""
    from ds4trt.model.state import LayerRows
    from ds4trt.plugins.kernels.commit_triton import CommitPlan
    from ds4trt.runtime.cache import CacheState
    from ds4trt.testing.tiny_gguf import tiny_config

    cache = CacheState(tiny_config(compress_ratios=(0, 4)), 64, device=DEVICE)
    rows = [LayerRows(**{name: torch.randn(3, t.shape[1], device=DEVICE) for name, t in layer.tensors().items()})
            for layer in cache.layers]
    assert CommitPlan.build(cache.layers, cache.ratios, rows, 3) is not None
    strided = torch.randn(3, 2 * cache.layers[1].comp.shape[1], device=DEVICE)[:, ::2]
    bad = [rows[0], LayerRows(**{**rows[1].__dict__, "comp": strided})]
    assert CommitPlan.build(cache.layers, cache.ratios, bad, 3) is None
    with pytest.raises(ValueError, match="rows.raw"):
        CommitPlan.build(cache.layers, cache.ratios, rows, 4)
    wide = [LayerRows(raw=torch.randn(3, cache.layers[0].raw.shape[1] + 1, device=DEVICE)), rows[1]]
    with pytest.raises(ValueError, match="rows.raw"):
        CommitPlan.build(cache.layers, cache.ratios, wide, 1)


# ---------------------------------------------------------------------------------------------------
# Compilation for the H200 without one

@pytest.mark.skipif(not INTERP, reason="the offline sm_90 compile check runs with DS4_TRITON_INTERPRET=1 (no GPU)")
def test_every_variant_compiles_for_sm90():
    """Compile (not run) each kernel variant the GPU tests and the benchmark use, for sm_90, with ptxas from
    the triton wheel: catches what the interpreter cannot (types, layouts, shared memory over the limit, register
    spills of the decode kernels, read from the SASS with the wheel's cuobjdump). Runs in a subprocess: it swaps
    Triton's active driver for a stand-in that answers sm_90."""
    code = textwrap.dedent("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        from ds4trt.testing.sm90 import activate, sass_stats
        activate()
        from ds4trt.testing import warmups as W
        from ds4trt.plugins.kernels import attn_triton as A, f16_triton as F16, index_triton as I, moe_triton as M, \
            q8_triton as Q
        sys.path.insert(0, "scripts")
        from bench_kernels import ATTEND_LONG_SWEEP, ATTEND_SWEEP, ATTEND_TOP_SWEEP, F16_SWEEP, LONG_SWEEP, \
            LONG_SWEEP_Q4, Q8_SWEEP, SINGLE_SWEEP
        n = 0
        ONE_PAIR_TS = (1, *(most for most, _ in M.SHORT_CONFIG))     # a call size for each one-pair launch entry
        Q8_LAUNCHES = [*Q.ROWS_CONFIG.items(), *((t, c) for t, _, _, c in Q.SIZE_CONFIG)]  # (T, config) q8_matmul takes
        def ok(k):
            # launch limits the interpreter cannot see: dynamic shared memory per block (227 KB on sm_90)
            global n
            assert "cubin" in k.asm and k.metadata.name, k
            assert k.metadata.shared <= 227 * 1024, (k.metadata.name, k.metadata.shared)
            n += 1
        for P, D in ((6, 4096), (96, 512)):
            ok(W.moe_prepare(P, D))
        ok(W.split_runs())
        for gt, ut, dt in ((16, 16, 10), (12, 12, 12), (10, 10, 10), (16, 16, 16)):
            for D, F in ((512, 256), (4096, 2048)):
                for T in ONE_PAIR_TS:                 # every one-pair launch moe_forward picks, and the other prefetch
                    cfg = M.one_pair_config(T)
                    (gbr, gw, greg, gpf), (dbr, dw, dreg, dpf) = cfg[gt], cfg[dt]
                    for (br, w, reg, pf), (dbr_, dw_, dreg_, dpf_) in (((gbr, gw, greg, gpf), (dbr, dw, dreg, dpf)),
                                                                   ((16, 4, None, not gpf), (16, 4, None, not dpf))):
                        ok(W.moe_gateup_single(gt, ut, dt, D, F, br, w, pf, maxnreg=reg))
                        ok(W.moe_down_single(dt, D, F, dbr_, dw_, dpf_, maxnreg=dreg_))
                    if T == 1:                        # with the shared expert's down (moe_forward's `shared`)
                        ok(W.moe_down_single(dt, D, F, dbr, dw, dpf, maxnreg=dreg, shared=True))
                longs = (*M.LONG_CONFIGS.values(), *M.LONG_CONFIGS_Q4.values())
                for cap, br, w, compact, st, parts in ((M.CAP, M.MULTI_BR, M.MULTI_WARPS, False, 3, 2),
                                                       (16, 32, 4, True, 1, 2), (16, 32, 4, True, 1, 1),
                                                       *((*c[:3], True, *c[3:]) for c in longs)):
                    ok(W.moe_gateup_multi(gt, ut, D, F, cap, br, w, compact, st, parts))
                    ok(W.moe_down_multi(dt, D, F, cap, br, w, compact, st, parts))
                ok(W.moe_gateup_single(gt, ut, dt, D, F, gbr, gw, gpf, compact=True))
            ok(W.dequant_rows(gt))
        for K in (1024, 4096, 8192, 320):
            for T, config in Q8_LAUNCHES:
                br, w, _, pf, nb = Q.launch_fields(config)
                for steps, splits in ((1, 16), (2, 1), (2, 8), (16, 1)):
                    ok(W.q8_rows(K, br, w, steps, splits, T, pf=pf, nb=nb))
            ok(W.dequant_f16(K))
            ok(W.x_f16(8 * K))
        ok(W.head_norm_rope(64, 512, 64))
        ok(W.split_f16())
        for N in (1028, 16384):
            ok(W.top_rows(N))
        ok(W.route_rows())
        ok(W.commit_rows())
        for N, K in ((256, 4096), (1024, 4096), (8192, 1024), (64, 4096), (2624, 4096)):   # 2624: an indexer F16 group
            for T in range(1, F16.LAUNCH_T + 1):
                ok(W.f16_rows(N, K, T, *F16.launch_shape(N, K, T)))
        ok(W.index_score())
        for R, C, NR, post, n_nope in ((128, 512, 64, "fp8", 448), (4, 512, 64, "fp8", 448), (4, 128, 64, "fp4", 448)):
            ok(W.compress_emit(R, C, NR, post, n_nope))
        ok(W.kv_row())
        ok(W.index_score_long(*I.LONG_CONFIG))
        for K in (194, 1154):
            ks, ch, w = A.SMALL_CONFIG if K <= A.SMALL_KEYS else A.CONFIG
            ok(W.attend_part(K, ks, ch, w))
            ok(W.attend_join(K, ks, ch))
        ok(W.hc_combine(4, 4096))
        ok(W.hc_post_dots(4, 4096))
        ok(W.hc_post_dots(4, 4096, update=False))
        ok(W.hc_post(4, 4096))
        ok(W.hc_dots_long(4, 4096, *W.hc_triton.LONG_CONFIG))
        ok(W.attend_long(A.LONG_CONFIG))
        ok(W.attend_top(A.TOP_CONFIG))
        # the launch shapes scripts/bench_kernels.py sweeps (timing only)
        for br, w, _, pf in SINGLE_SWEEP:
            for t in (16, 10, 12):
                ok(W.moe_gateup_single(t, t, t, 4096, 2048, br, w, pf))
                if t != 16:                           # the down kernels (Q2_K, Q4_K)
                    ok(W.moe_down_single(t, 4096, 2048, br, w, pf))
        for T, configs in Q8_SWEEP.items():
            for config in configs:
                br, w, _, pf, nb = Q.launch_fields(config)
                ok(W.q8_rows(4096, br, w, 2, 8, T, pf=pf, nb=nb))
        for ks, ch, w in ATTEND_SWEEP:
            ok(W.attend_part(1153, ks, ch, w))
        for config in ATTEND_LONG_SWEEP:
            ok(W.attend_long(config))
        for config in ATTEND_TOP_SWEEP:
            ok(W.attend_top(config))
        for br, bk in F16_SWEEP:
            for T in (1, 4):
                ok(W.f16_rows(2624, 4096, T, br, bk))
        LONG_SWEEP = tuple((cap, br, w, True, st, parts) for cap, br, w, st, parts in LONG_SWEEP)
        for cap, br, w, compact, st, parts in ((16, 32, 4, False, 3, 2), (16, 64, 4, False, 3, 2)) + LONG_SWEEP:
            ok(W.moe_gateup_multi(16, 16, 4096, 2048, cap, br, w, compact, st, parts))
            ok(W.moe_down_multi(10, 4096, 2048, cap, br, w, compact, st, parts))
        for cap, br, w, st, parts in LONG_SWEEP_Q4:
            ok(W.moe_gateup_multi(12, 12, 4096, 2048, cap, br, w, True, st, parts))
            ok(W.moe_down_multi(12, 4096, 2048, cap, br, w, True, st, parts))
        # the decode kernels (one-pair MoE, Q8_0 for T <= 4) at their default launch shapes must not spill registers
        # to local memory (the multi-pair MoE kernels do: see the closing notes; not asserted here)
        spills = lambda k: sass_stats(k)["spills"]     # sass_stats checks that it really disassembled
        for gt, dt in ((16, 10), (12, 12), (10, 10), (16, 16)):
            for T in ONE_PAIR_TS:
                cfg = M.one_pair_config(T)
                (gbr, gw, greg, gpf), (dbr, dw, dreg, dpf) = cfg[gt], cfg[dt]
                assert spills(W.moe_gateup_single(gt, gt, dt, 4096, 2048, gbr, gw, gpf, maxnreg=greg)) == 0, \
                    ("_moe_gateup_single spills", gt, T)
                assert spills(W.moe_down_single(dt, 4096, 2048, dbr, dw, dpf, maxnreg=dreg)) == 0, \
                    ("_moe_down_single spills", dt, T)
                if T == 1:
                    assert spills(W.moe_down_single(dt, 4096, 2048, dbr, dw, dpf, maxnreg=dreg, shared=True)) == 0, \
                        ("_moe_down_single spills, shared", dt)
        for T, config in Q8_LAUNCHES:
            br, w, _, pf, nb = Q.launch_fields(config)
            for splits in (1, 8):
                assert spills(W.q8_rows(4096, br, w, 2, splits, T, pf=pf, nb=nb)) == 0, ("_q8_rows spills", T, splits)
        assert spills(W.attend_top(A.TOP_CONFIG)) == 0, "_attend_top spills at TOP_CONFIG"
        print("compiled", n)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-4000:]
    assert "compiled" in res.stdout
