"""The tensor-core IQ2_XXS gate/up and Q2_K down of long MoE calls (plugins/kernels/moe_mma.cu, launched by
moe_mma.py; on mma.sync and on wgmma) against float64.

Where they run: the offline check (NVRTC compiles each launch for sm_90, ptxas' report must show no spills) wherever
NVRTC loads, CI included; the products on "emu", the CPU stand-in of tests/cuda_emu (g++ builds the CUDA C++ as host
code), at small shapes, and on "cuda", a GPU, at Flash's widths too. Fresh random IQ2_XXS experts (the q2 mix's gate
and up), x ~ 3 N(0, 1), items made by moe_triton._long_items from random routing; h NaN-poisoned, and the rows of
pairs outside multi-pair items must stay NaN. Bound: TOL_F16 (1e-3 of the largest |reference|; the gate/up, whose x
and values are each rounded to float16, leaves ~5e-4, as does the wgmma down; the mma.sync down, with exact values and
one float16 part of h, ~2.5e-4).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

import cuda_emu
from triton_env import DEVICE, GPU, INTERP
from ds4trt.plugins import moe as moe_ref
from ds4trt.plugins.kernels import cuda_launch, moe_mma, moe_triton, q8_triton
from moe_cases import random_moe_inputs
from test_kernels import CLAMP, TOL_F16, _rel, _seed

IQ2_XXS = 16


def _split(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """split_runs' hi, shi, slo and inv in torch: per 256-value chunk with e the biased exponent of its largest |x| (at
    most 252), scale = 2^(126 - e): hi = float16(x * scale), the sums of x over 16-value runs times scale = shi + slo
    (float16 each), inv = 1 / scale."""
    T, D = v.shape
    chunks = v.view(T, D // 256, 256)
    e = torch.clamp((chunks.abs().amax(-1).view(torch.int32) >> 23) & 255, max=252)
    scale = torch.ldexp(torch.ones(T, D // 256), (126 - e).float())
    hi = (chunks * scale[..., None]).to(torch.float16).view(T, D)
    s16 = chunks.view(T, D // 256, 16, 16).sum(-1) * scale[..., None]
    shi = s16.to(torch.float16)
    slo = (s16 - shi.float()).to(torch.float16)
    return hi, shi.view(T, D // 16), slo.view(T, D // 16), 1 / scale


def _rows_f16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_triton.x_f16 in torch: s = the power of two with each row's largest |x| in [s / 2, s), xh = float16(x / s)."""
    s = torch.ldexp(torch.ones(v.shape[0]), torch.frexp(v.abs().amax(1)).exponent).float()
    return (v / s[:, None]).to(torch.float16), s


def _items(ids: np.ndarray, E: int, cap: int, apart: bool = True):
    """moe_triton._long_items of the routing -> (flat ids, order, cnt, listed multi-pair starts, their pairs); apart
    False: every item's start, one-pair items too."""
    from ds4trt.plugins.kernels import moe_triton

    flat = torch.from_numpy(ids.reshape(-1))
    order, cnt, _, multis = moe_triton._long_items(flat, E, cap, apart)
    pos = torch.cat([torch.arange(s, s + cnt[s]) for s in multis.tolist()]) if multis.numel() else torch.zeros(0)
    pairs = order[pos.long()].long()
    assert pairs.numel() > 0, "no multi-pair items: the test routed too few tokens per expert"
    return flat, order, cnt, multis, pairs


def _only_pairs_written(out: torch.Tensor, pairs: torch.Tensor) -> None:
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[pairs] = False
    assert torch.isnan(out[others]).all(), "rows of pairs outside the multi-pair items were written"


def _inputs(T, E, F, D, k, seed, skew):
    """random_moe_inputs of the q2 mix; skew: most tokens' first slot on expert 0 (items of cap pairs and a partial
    one beside the other experts' items)."""
    v, ids, w, blocks = random_moe_inputs((IQ2_XXS, IQ2_XXS, 10), T, seed, E, F, D, k)
    if skew:
        ids[: 3 * T // 4, 0] = 0
        ids[: 3 * T // 4, 1:] = np.where(ids[: 3 * T // 4, 1:] == 0, 1, ids[: 3 * T // 4, 1:])
    return v, ids, w, blocks


def _dev(a, device):
    return (torch.from_numpy(a) if isinstance(a, np.ndarray) else a).to(device)


def _permuted(xh: torch.Tensor, position) -> torch.Tensor:
    """xh [R, D] with value o of each 256-value chunk moved to position(o) (a wgmma kernel's order)."""
    R, D = xh.shape
    out = torch.empty_like(xh).view(R, D // 256, 256)
    out[:, :, position(torch.arange(256))] = xh.view(R, D // 256, 256)
    return out.view(R, D)


def _check(device, T, E, F, D, k, cap, seed, skew=False, apart=True, wg=False):
    """One long call's multi-pair items (apart False: all its items) through gateup_iq2 (wg: its wgmma kernel)
    against float64 w * swiglu(gate x, up x)."""
    v, ids, w, (gate, up, _) = _inputs(T, E, F, D, k, seed, skew)
    flat, order, cnt, multis, pairs = _items(ids, E, cap, apart)
    xh, xscale = _rows_f16(torch.from_numpy(v))
    if wg:
        xh = _permuted(xh, q8_triton.wgmma_position)
    dev = functools.partial(_dev, device=device)
    h = torch.full((T * k, F), float("nan"), device=device)
    moe_mma.gateup_iq2(dev(xh), dev(xscale), dev(flat), dev(w.reshape(-1)), dev(order), dev(cnt), dev(multis),
                       dev(gate), dev(up), h, k, CLAMP, cap, wg)
    h = h.cpu().double()
    _only_pairs_written(h, pairs)
    p = pairs.numpy()
    t, e = p // k, ids.reshape(-1)[p]
    want = np.empty((p.size, F))
    for x in np.unique(e):                          # one expert's float64 matrices at a time
        sel = e == x
        xt = v[t[sel]].astype(np.float64)
        g = xt @ moe_ref.dequantize_expert(gate[x], IQ2_XXS).astype(np.float64).T
        u = xt @ moe_ref.dequantize_expert(up[x], IQ2_XXS).astype(np.float64).T
        want[sel] = w.reshape(-1)[p[sel], None] * moe_ref.swiglu(g, u, CLAMP)
    err = _rel(h[pairs], torch.from_numpy(want))
    assert err <= TOL_F16, f"T = {T}, cap = {cap}: relative error {err:.3g}"


def _check_down(device, T, E, F, D, k, cap, seed, skew=False, apart=True, wg=False):
    """One long call's multi-pair items through down_q2k (wg: down_q2k_wg) against float64 down_e h[pair], h ~
    N(0, 1) per pair with a few rows 1e4 times larger or smaller and a few of mean 30 (there the run sums' lo parts
    matter to down_q2k). The wgmma kernel's values are float16 (the min term in them): each output within the bound
    of float16 values and h, all but the rows of mean 30 within TOL_F16, and those (30 sum w cancels most of their
    terms) within twice it."""
    v, ids, _, (_, _, down) = _inputs(T, E, F, D, k, seed, skew)
    rng = np.random.default_rng(seed + 1)
    hv = rng.standard_normal((T * k, F)).astype(np.float32)
    hv[::7] *= 1e4
    hv[3::7] *= 1e-4
    hv[1::5] += 30                                  # a large mean: the min term cancels most of the main one
    flat, order, cnt, multis, pairs = _items(ids, E, cap, apart)
    dev = functools.partial(_dev, device=device)
    y = torch.full((T * k, D), float("nan"), device=device)
    if wg:                                          # h as x_f16's rows in the down order
        hh, hs = _rows_f16(torch.from_numpy(hv))
        moe_mma.down_q2k_wg(dev(_permuted(hh, q8_triton.down_wgmma_position)), dev(hs), dev(flat), dev(order),
                            dev(cnt), dev(multis), dev(down), y, cap)
    else:
        hh, hsh, hsl, hinv = _split(torch.from_numpy(hv))
        moe_mma.down_q2k(dev(hh), dev(hsh), dev(hsl), dev(hinv), dev(flat), dev(order), dev(cnt), dev(multis),
                         dev(down), y, cap)
    y = y.cpu().double()
    _only_pairs_written(y, pairs)
    p = pairs.numpy()
    e = ids.reshape(-1)[p]
    u = 2.0 ** -11                                  # float16's unit roundoff
    mean_rows = []
    for x in np.unique(e):
        sel = p[e == x]
        W = moe_ref.dequantize_expert(down[x], 10).astype(np.float64)                  # [D, F]
        hx = hv[sel].astype(np.float64)
        want = hx @ W.T
        # the wgmma kernel's bound, a product of values each off by two roundings of itself (2u |w|, plus 2^-25 where
        # subnormal) and h's float16 rows (u |h|, 2^-25 s): 4u sum |w h| per output, with slack for the float32 sums
        bound = 4 * u * np.abs(hx) @ np.abs(W).T + 2.0 ** -24 * (np.abs(hx).sum(1, keepdims=True)
                                                                   + np.abs(hx).max(1, keepdims=True) * np.abs(W).sum(1))
        for i, pair in enumerate(sel):              # each pair against its own scale (rows differ by 1e8)
            if wg:
                over = np.abs(y[pair].numpy() - want[i]) / bound[i]
                assert over.max() <= 1, f"T = {T}, cap = {cap}, pair {pair} (expert {x}): {over.max():.3g}x the bound"
            err = _rel(y[pair], torch.from_numpy(want[i]))
            if wg and pair % 5 == 1:                # rows of mean 30: their sum cancels most of its terms
                mean_rows.append(err)
                continue
            assert err <= TOL_F16, f"T = {T}, cap = {cap}, pair {pair} (expert {x}): relative error {err:.3g}"
    if mean_rows:
        assert max(mean_rows) <= 2 * TOL_F16, f"T = {T}, cap = {cap}: rows of mean 30, relative error up to " \
                                              f"{max(mean_rows):.3g}"


@pytest.mark.parametrize("fuse", [True, False], ids=["gate and up in one pass", "apart"])
@pytest.mark.parametrize("nib", [True, False], ids=["nibble tables", "float16 tables"])
@pytest.mark.parametrize("cap", [32, 64])
def test_gateup_iq2_small(kernel_device, cap, nib, fuse, monkeypatch):
    """A call of 40 tokens over 8 experts (~30 pairs each: items of 2..30 pairs), 4 row tiles of 64; each table form,
    gate and up in one pass or apart."""
    monkeypatch.setattr(moe_mma, "NIB", nib)
    monkeypatch.setattr(moe_mma, "FUSE", {cap: fuse})
    _check(kernel_device, 40, 8, 256, 512, 6, cap, _seed("moe mma", cap))


@pytest.mark.parametrize("nib", [True, False], ids=["nibble tables", "float16 tables"])
@pytest.mark.parametrize("cap", [32, 64])
def test_gateup_iq2_full_items(kernel_device, cap, nib, monkeypatch):
    """Most tokens on one expert: items of exactly cap pairs beside a partial one and the other experts' items."""
    monkeypatch.setattr(moe_mma, "NIB", nib)
    _check(kernel_device, 100, 8, 256, 256, 2, cap, _seed("moe mma skew", cap), skew=True)


def _wgmma_device(kernel_device):
    if kernel_device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs compute capability 9.0 (H100 / H200)")


@pytest.mark.parametrize("fuse", [True, False], ids=["gate and up in one pass", "apart"])
@pytest.mark.parametrize("cap", [32, 64])
def test_gateup_iq2_wgmma_small(kernel_device, cap, fuse, monkeypatch):
    """The wgmma kernel (moe_gateup_iq2_wg, x in x_f16's wgmma order) on test_gateup_iq2_small's call; on the CPU
    stand-in its wgmma reads B through the descriptor as PTX describes the no-swizzle layout."""
    _wgmma_device(kernel_device)
    monkeypatch.setattr(moe_mma, "FUSE", {cap: fuse})
    _check(kernel_device, 40, 8, 256, 512, 6, cap, _seed("moe mma wg", cap), wg=True)


@pytest.mark.parametrize("warps", [None, 4], ids=["WARPS", "4 warps"])
@pytest.mark.parametrize("cap", [32, 64])
def test_gateup_iq2_wgmma_full_items(kernel_device, cap, warps, monkeypatch):
    """Skewed routing (full items); also at one warpgroup a program, where CAP 64's 8 token groups take two a warp in
    the copies of x (moe_mma.cu's TileCopies)."""
    _wgmma_device(kernel_device)
    if warps:
        monkeypatch.setitem(moe_mma.WARPS, cap, warps)
    _check(kernel_device, 100, 8, 256, 256, 2, cap, _seed("moe mma wg skew", cap), skew=True, wg=True)


@pytest.mark.parametrize("warps", [None, 4], ids=["WARPS", "4 warps"])
@pytest.mark.parametrize("cap", [32, 64])
def test_down_q2k_wgmma(kernel_device, cap, warps, monkeypatch):
    """The wgmma down (moe_down_q2k_wg, h as x_f16's rows in the down order) on test_down_q2k_small's and
    test_down_q2k_full_items' calls; also at one warpgroup a program."""
    _wgmma_device(kernel_device)
    if warps:
        monkeypatch.setitem(moe_mma.WARPS, cap, warps)
    _check_down(kernel_device, 40, 8, 512, 256, 6, cap, _seed("moe mma down wg", cap), wg=True)
    _check_down(kernel_device, 100, 8, 256, 256, 2, cap, _seed("moe mma down wg skew", cap), skew=True, wg=True)


@pytest.mark.parametrize("cap", [32, 64])
def test_down_q2k_small(kernel_device, cap):
    """The Q2_K down of the same kind of call: 40 tokens over 8 experts, D = 256 (4 row tiles), F = 512 (2 blocks)."""
    _check_down(kernel_device, 40, 8, 512, 256, 6, cap, _seed("moe mma down", cap))


@pytest.mark.parametrize("cap", [32, 64])
def test_down_q2k_full_items(kernel_device, cap):
    _check_down(kernel_device, 100, 8, 256, 256, 2, cap, _seed("moe mma down skew", cap), skew=True)


@pytest.mark.parametrize("cap", [32, 64])
def test_one_pair_items_too(kernel_device, cap):
    """Both kernels on every item of a call, one-pair items among them (_long_items' apart False): 12 tokens over 40
    experts, so that many items hold one pair."""
    for check, F, D, seed in ((_check, 256, 256, _seed("moe mma singles gate", cap)),
                              (_check_down, 256, 256, _seed("moe mma singles down", cap))):
        ids = _inputs(12, 40, F, D, 2, seed, False)[1]
        assert (np.bincount(ids.reshape(-1), minlength=40) == 1).sum() >= 4, "too few one-pair items to test"
        check(kernel_device, 12, 40, F, D, 2, cap, seed, apart=False)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (scripts/gpu_kernels.sh on the H200)")
@pytest.mark.parametrize("wg", [False, True], ids=["mma.sync", "wgmma"])
@pytest.mark.parametrize("cap", [32, 64])
def test_down_q2k_flash_widths(cap, wg):
    if wg:
        _wgmma_device("cuda")
    _check_down("cuda", 256, 32, 2048, 4096, 6, cap, _seed("moe mma down flash", cap), wg=wg)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (scripts/gpu_kernels.sh on the H200)")
@pytest.mark.parametrize("wg", [False, True], ids=["mma.sync", "wgmma"])
@pytest.mark.parametrize("cap", [32, 64])
def test_gateup_iq2_flash_widths(cap, wg):
    """Flash's D = 4096, F = 2048; 256 tokens over 32 experts (48 pairs each)."""
    if wg:
        _wgmma_device("cuda")
    _check("cuda", 256, 32, 2048, 4096, 6, cap, _seed("moe mma flash", cap), wg=wg)


@pytest.mark.skipif(not (GPU or INTERP and cuda_emu.available()),
                    reason="needs a CUDA GPU, or DS4_TRITON_INTERPRET=1 with triton and g++ (for the Triton kernels "
                           "beside)")
@pytest.mark.parametrize("wg", [False, True], ids=["mma.sync", "wgmma"])
@pytest.mark.parametrize("together", [False, True], ids=["one-pair items apart", "one-pair items here too"])
@pytest.mark.parametrize("cap", [32, 64])
def test_moe_forward_long_call_with_ds4_moe_mma(monkeypatch, cap, together, wg):
    """moe_forward's long q2 call with DS4_MOE_MMA=1 (its multi-pair gate/up and down here) against the
    float64 contract, as test_kernels.test_moe_long_calls: 40 tokens on experts 0..6 (~17 pairs each) and token 0
    alone on expert 7 (a one-pair item: to the one-pair Triton kernels, or with `together`, SINGLES_IN_ITEMS_FROM
    lowered to 1, to moe_mma's); wg: the gate/up and the down (down_q2k_wg) on wgmma (DS4_MOE_WGMMA=1; an H100 / H200
    only, since use_wgmma asks for compute capability 9.0). Without a GPU: the Triton kernels in Triton's
    interpreter, moe_mma's on the CPU stand-in."""
    from ds4trt.plugins.kernels import moe_triton
    from test_kernels import _deq_experts, _moe_ref64, _run_moe, _small_case

    monkeypatch.setenv("DS4_MOE_WGMMA", "1" if wg else "0")      # on an H100 / H200 unset means wgmma
    if wg:
        if not (GPU and torch.cuda.get_device_capability() == (9, 0)):
            pytest.skip("wgmma needs a GPU of compute capability 9.0 (H100 / H200)")
        monkeypatch.setattr(moe_mma, "gateup_iq2", lambda *a, f=moe_mma.gateup_iq2: f(*a) if a[-1] is True
                            else pytest.fail("gate/up not on wgmma"))
    if together:
        monkeypatch.setattr(moe_triton, "SINGLES_IN_ITEMS_FROM", 1)
        monkeypatch.setattr(moe_triton, "_moe_gateup_single", None)       # must not launch

    if not GPU:
        monkeypatch.setattr(cuda_launch, "launch", cuda_emu.launch)
        monkeypatch.setattr(cuda_launch, "runs_on", lambda device: True)
    monkeypatch.setenv("DS4_MOE_MMA", "1")
    calls = []
    downs = ("down_q2k_wg", "down_q2k") if wg else ("down_q2k",)      # on wgmma the down must be down_q2k_wg
    for name in ("gateup_iq2",) + downs:
        fn = getattr(moe_mma, name)
        monkeypatch.setattr(moe_mma, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    types = (IQ2_XXS, IQ2_XXS, 10)
    T = 40
    v, _, w, blocks = _small_case(types, seed=_seed("moe mma forward", cap), T=T)
    rng = np.random.default_rng(_seed("moe mma forward ids", cap))
    ids = np.stack([rng.permutation(7)[:3] for _ in range(T)]).astype(np.int64)
    ids[0, 0] = 7
    dev = [torch.from_numpy(a).to(DEVICE) for a in (v, ids, w, *blocks)]
    got = _run_moe(*dev[:3], dev[3:], types, long_config=(cap, 32, 4, 1, 1))
    assert calls == ["gateup_iq2", downs[0]]
    assert _rel(got, _moe_ref64(*dev[:3], _deq_experts(blocks, types, range(8)), CLAMP)) <= TOL_F16


def _stack_and_spills(kernel: cuda_launch.Kernel, arch: str) -> tuple[bytes, tuple[int, int, int]]:
    """kernel compiled for arch -> (cubin, ptxas' (stack frame, spill store, spill load) bytes for its entry)."""
    cubin, log = cuda_launch.compile_cubin(kernel, arch, ptxas_verbose=True)
    if not log:
        pytest.skip("this NVRTC returns no ptxas -v report (the GPU machine's image: NVRTC 13.0 under cuda.bindings "
                    "13.3); the check runs where it does, as on CI")
    frame = re.search(rf"Function properties for {kernel.name}\s+ptxas\s+\.\s+(\d+) bytes stack frame, "
                      rf"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert frame, f"{kernel}: {log}"
    return cubin, tuple(map(int, frame.groups()))


@pytest.mark.skipif(not cuda_launch.builds(), reason="NVRTC not found (pip install nvidia-cuda-nvrtc)")
def test_every_launch_compiles_for_sm90_without_spills():
    """Each CAP's launch (WARPS, FUSE, MIN_BLOCKS) and its down, and the gate/up with the other table form (NIB) at one
    program an SM (as bench_kernels' sweep runs it): NVRTC compiles them for sm_90 and ptxas reports no stack frame
    and no spills, but for CAP 64's kernels at 8 warps and two programs an SM, which ptxas holds to 128 registers:
    the down with a 32-40 byte stack frame and 28-32 bytes spilled (at most SPILL_64 bytes of either), the fused
    gate/up with a 56-byte frame, 56 bytes stored and 296 loaded (at most SPILL_64_GATEUP; 272 / 780 while it kept
    per-block partial sums)."""
    SPILL_64, SPILL_64_GATEUP = 48, 320
    for cap, warps in moe_mma.WARPS.items():
        fuse = moe_mma.FUSE[cap]
        for name, nib, fuse, minb in (("moe_gateup_iq2", moe_mma.NIB, fuse, None),
                                      ("moe_gateup_iq2", not moe_mma.NIB, fuse, 1),
                                      ("moe_down_q2k", moe_mma.NIB, False, None)):
            kernel = moe_mma.kernel(name, cap // 8, warps, nib, fuse, minb)
            cubin, frame = _stack_and_spills(kernel, "sm_90")
            assert cubin[:4] == b"\x7fELF"
            bound = 0
            if (cap, warps) == (64, 8) and minb is None:
                bound = SPILL_64_GATEUP if name == "moe_gateup_iq2" else SPILL_64
            assert max(frame) <= bound, f"{kernel}: stack frame, spill stores, spill loads {frame}"
    for cap, warps in moe_mma.WARPS.items():          # the wgmma kernels as _launch builds them, for sm_90a: no spills
        for name in ("moe_gateup_iq2_wg", "moe_down_q2k_wg"):
            kernel = moe_mma.kernel(name, cap // 8, warps)
            _, frame = _stack_and_spills(kernel, "sm_90a")
            assert max(frame) == 0, f"{kernel}: stack frame, spill stores, spill loads {frame}"


def test_the_cuda_kernels_need_compute_capability_8(monkeypatch):
    """mma.sync.m16n8k16 and cp.async exist from sm_80: on an older GPU, or without cuda-bindings and NVRTC, the Triton
    kernels stay; and moe_mma takes only one-part IQ2_XXS / Q2_K products in items of a CAP it has a launch for, with
    DS4_MOE_MMA=1 (unset: DEFAULT_MODE), on wgmma only at compute capability 9.0 (DS4_MOE_WGMMA=0: never)."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("DS4_MOE_MMA", "1")
    for capability, runs in (((7, 5), False), ((7, 2), False), ((8, 0), True), ((8, 7), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert cuda_launch.runs_on(gpu) is runs, capability
        assert moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048, 32, gpu) is runs, capability
    assert moe_mma.use_down(10, 1, 4096, 64, gpu)                              # Q2_K
    assert not moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 2, 2048, 32, gpu)         # two activation parts
    assert not moe_mma.use_gateup(12, 12, 1, 2048, 32, gpu)                   # Q4_K
    assert not moe_mma.use_gateup(IQ2_XXS, 10, 1, 2048, 32, gpu)              # a Q2_K up
    assert not moe_mma.use_down(IQ2_XXS, 1, 4096, 64, gpu)                    # an IQ2_XXS down
    assert not moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048 + 16, 32, gpu)    # rows not whole row tiles
    monkeypatch.delenv("DS4_MOE_WGMMA", raising=False)                         # wgmma: Hopper's alone
    monkeypatch.setattr(cuda_launch, "builds_sm90a", lambda: True)
    for capability, wg in (((8, 0), False), ((8, 7), False), ((10, 0), False), ((12, 1), False),
                           ((9, 0), moe_mma.WG_DEFAULT_MODE == "1")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert moe_mma.use_wgmma(gpu, 64) is wg, capability
    monkeypatch.setenv("DS4_MOE_WGMMA", "1")
    assert moe_mma.use_wgmma(gpu, 64)
    monkeypatch.setattr(cuda_launch, "builds_sm90a", lambda: False)          # an NVRTC before CUDA 12: mma.sync
    assert not moe_mma.use_wgmma(gpu, 64)
    monkeypatch.setattr(cuda_launch, "builds_sm90a", lambda: True)
    monkeypatch.setattr(moe_mma, "WARPS", {64: 2})                            # half a warpgroup
    assert not moe_mma.use_wgmma(gpu, 64) and not moe_mma.use_wgmma(gpu, 32)     # (and a CAP without a launch)
    monkeypatch.setattr(moe_mma, "WARPS", {32: 8, 64: 8})
    monkeypatch.setenv("DS4_MOE_WGMMA", "0")
    assert not moe_mma.use_wgmma(gpu, 64)
    assert not moe_mma.use_wgmma(torch.device("cpu"), 64)
    assert not moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048, 16, gpu)         # a CAP without a launch (a sweep's)
    monkeypatch.setenv("DS4_MOE_MMA", "0")
    assert not moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048, 32, gpu)
    monkeypatch.delenv("DS4_MOE_MMA")
    assert moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048, 32, gpu) is (moe_mma.DEFAULT_MODE == "1")
    monkeypatch.setenv("DS4_MOE_MMA", "1")
    monkeypatch.setattr(cuda_launch, "builds", lambda: False)                      # no cuda-bindings / NVRTC
    assert not cuda_launch.runs_on(gpu) and not moe_mma.use_gateup(IQ2_XXS, IQ2_XXS, 1, 2048, 32, gpu)
    assert not cuda_launch.runs_on(torch.device("cpu"))                           # only the tests' stand-in
