"""The CUDA backend (runtime/backends/cuda.py): GGUF blocks resident on the GPU, Triton kernels, CUDA graphs.

Checked against the PyTorch reference on the CPU (Engine.open, float32, every weight dequantized):
  - Q8_0 dequantization in torch is bit-exact against gguf-py (runs everywhere);
  - Q8Linear against Linear on fresh random blocks, every row-count path and grouped rows; the float16 operands
    of long prefill chunks (q8_triton.dequant_f16, x_f16) bit for bit those of torch;
  - greedy tokens of the tiny model and of the bundled demo model identical on both paths, graphs on and off;
  - speculative decoding on the GPU path gives exactly its greedy tokens (demo model, real MTP head, drafts
    1..4, several prompts; and with the blocks compiled), commits every accepted-length graph, and leaves the
    caches of sequential decoding;
  - rewind resets the caches in place, so the captured graphs stay valid.
GPU tests skip without CUDA; with DS4_TRITON_INTERPRET=1 the eager kernel path runs on the CPU interpreter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from triton_env import DEVICE, GPU, HAVE_TRITON, INTERP  # noqa: I001 - first: it may set TRITON_INTERPRET
from ds4trt.runtime.session import PREFILL_CHUNK, Engine
from tiny_engines import PROMPT, greedy, tiny_files

if HAVE_TRITON:
    from ds4trt.plugins.kernels import q8_triton
    from ds4trt.runtime.backends import cuda

torch.set_num_threads(1)
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
kernels = pytest.mark.skipif(not (GPU or INTERP), reason="needs a CUDA GPU (scripts/gpu_kernels.sh on the H200) "
                                                         "or DS4_TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (scripts/gpu_kernels.sh on the H200)")
PROJECT_F16_TOL = 1e-3       # prefill chunks' projections (project_f16: float16 inputs); shorter steps 1e-5

MODELS = Path(__file__).resolve().parents[1] / "models"
DEMO_PROMPTS = ["import os\nimport sys\n\n\nclass ", "def main(argv=None):\n    ", "    for i in range(",
                "# Copyright 2001 Python Software Foundation\n"]


def _q8_blocks(rng, N: int, K: int, magnitude: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Fresh random Q8_0 rows (uint8 [N, K/32*34]) and their gguf-py dequantization [N, K]."""
    w = (rng.standard_normal((N, K)) * rng.uniform(0.1, 3, (N, 1)) * magnitude).astype(np.float32)
    blocks = gguf_quants.quantize(w, GGMLQuantizationType.Q8_0)
    return blocks, gguf_quants.dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float32)


@needs_triton
def test_split_q8_dequantizes_exactly():
    blocks, ref = _q8_blocks(np.random.default_rng(1), 48, 96)
    got = q8_triton.dequantize(*q8_triton.split_q8(torch.from_numpy(blocks), 48, 96), 96)
    assert torch.equal(got, torch.from_numpy(ref))


@kernels
def test_split_runs_splits_each_chunk_exactly_enough():
    """moe_triton.split_runs (the multi-pair MoE kernels' activations): per 256-value chunk a power-of-two scale
    with |x * scale| < 1, x * scale = hi + lo to 2^-22 of the chunk's largest |x|, the 16-value run sums likewise,
    inv * scale = 1; chunks of zeros and of tiny or huge values included, chunks past a whole program (fresh random
    rows)."""
    from ds4trt.plugins.kernels import moe_triton

    g = torch.Generator().manual_seed(11)
    R, K = 5, 1024
    x = torch.randn(R, K, generator=g) * torch.logspace(-30, 30, R)[:, None]
    x[2, 256:512] = 0
    hi, lo, shi, slo, inv = (a.cpu() for a in moe_triton.split_runs(x.to(DEVICE)))
    assert (hi.dtype, lo.dtype, shi.dtype, slo.dtype, inv.dtype) == (torch.float16,) * 4 + (torch.float32,)
    assert hi.shape == lo.shape == (R, K) and shi.shape == slo.shape == (R, K // 16) and inv.shape == (R, K // 256)
    xc = x.double().reshape(R, K // 256, 256)
    amax = xc.abs().amax(dim=2, keepdim=True)
    scale = 1 / inv.double()[..., None]
    assert (torch.frexp(inv)[0] == 0.5).all(), "inv (and scale) must be powers of two"
    assert ((xc * scale).abs() < 1).all()
    back = (hi.double() + lo.double()).reshape(R, K // 256, 256)
    assert ((back - xc * scale).abs() <= amax * scale * 2.0 ** -22).all()
    runs = xc.reshape(R, K // 256, 16, 16).sum(dim=3) * scale
    back16 = (shi.double() + slo.double()).reshape(R, K // 256, 16)
    assert ((back16 - runs).abs() <= amax * scale * 2.0 ** -18).all()
    assert (hi[2, 256:512] == 0).all() and (lo[2, 256:512] == 0).all()


@needs_triton
def test_bench_decode_checks_that_the_layers_fit(monkeypatch):
    """scripts/bench_decode.py's memory check, without a GPU: resident_bytes of its synthetic Flash weights grows with
    the layers (28 layers: within 1 % of the 54.16 GiB an H100 run held, BENCHMARKS.md), and layers_that_fit gives
    the most layers whose weights and RUN_HEADROOM fit the free bytes."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_decode as B

    need = [cuda.resident_bytes(B.SyntheticWeights(B.flash_layers(n))) for n in (27, 28, 29)]
    assert need[0] < need[1] < need[2]
    assert abs(need[1] / 2 ** 30 - 54.16) < 0.01 * 54.16
    assert B.layers_that_fit(need[1] + B.RUN_HEADROOM) == 28
    assert B.layers_that_fit(need[1] + B.RUN_HEADROOM - 1) == 27
    assert B.layers_that_fit(B.RUN_HEADROOM) == 0
    assert B.layers_that_fit(2 ** 50) == 43


@needs_triton
def test_matmul_flops_times_a_real_product(monkeypatch):
    """scripts/bench_kernels.py's compute-rate probe, without a GPU (on the CPU at a small size, the timer a stand-in
    that runs the product it is given once and checks it): FLOP/s = 2 n^3 / the median time."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_kernels as BK

    ran = []

    def timer(fn, warmup, rep, return_mode):
        c = fn()
        assert c.shape == (64, 64) and c.dtype == torch.bfloat16 and c.float().abs().sum() > 0
        ran.append(return_mode)
        return 0.25                                                     # ms

    monkeypatch.setattr(BK, "DEV", "cpu")
    monkeypatch.setattr(BK, "do_bench", timer)
    assert BK.matmul_flops(64) == 2 * 64 ** 3 / 0.25e-3
    assert ran == ["median"]


@needs_triton
def test_resident_bytes_is_what_the_model_holds():
    """The memory estimate open_engine checks against the device equals the model's parameters and buffers
    (on the CPU: the same modules), up to the small derived buffers (Hadamard matrices)."""
    from ds4trt.model.weights import load_mtp, load_target

    target, mtp = tiny_files()
    engine = cuda.open_engine(target, mtp, device="cpu", graphs=False)
    held = sum(t.numel() * t.element_size() for m in (engine.model, engine.mtp)
               for t in [*m.parameters(), *m.buffers()])
    _, cfg, w = load_target(target)
    want = cuda.resident_bytes(w) + cuda.resident_bytes(load_mtp(mtp, cfg)[1])
    assert want <= held <= want * 1.02


@needs_triton
def test_programmatic_dependent_launch_only_where_supported(monkeypatch):
    """plugins/kernels/pdl.py asks for PDL only on CUDA devices of compute capability 9.0 or more (an H200's 9.0, a
    DGX Spark's 12.1; not a Jetson Orin's 8.7, whose ptxas has no griddepcontrol), never for CPU tensors or under
    Triton's interpreter, and not with DS4_PDL=0."""
    from ds4trt.plugins.kernels import pdl

    caps = {0: (9, 0), 1: (8, 7), 2: (12, 1)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: caps[index])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DS4_PDL", raising=False)

    def on(device: str) -> bool:
        pdl._supported.cache_clear()
        launch = pdl.pdl_launch(torch.device(device))
        assert launch["PDL"] == launch["launch_pdl"]
        return launch["PDL"]

    try:
        assert [on("cuda:0"), on("cuda:1"), on("cuda:2"), on("cpu")] == [True, False, True, False]
        monkeypatch.setenv("DS4_PDL", "0")
        assert not on("cuda:0")
        monkeypatch.delenv("DS4_PDL")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not on("cuda:0")
    finally:
        pdl._supported.cache_clear()          # the real answers again for the tests after this one


@needs_triton
def test_weights_larger_than_the_free_device_memory_are_refused(monkeypatch):
    from ds4trt.errors import Ds4Error

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 2**30))
    target, _ = tiny_files()
    with pytest.raises(Ds4Error, match=r"tiny.gguf: the CUDA backend needs .* GiB .* has 0.0 GiB free"):
        cuda.open_engine(target, device="cuda")


@kernels
@pytest.mark.parametrize("T", [1, 3, 7, 20])
@pytest.mark.parametrize("groups", [1, 2])
def test_q8_linear_matches_linear(T, groups):
    from ds4trt.model.linear import Linear

    rng = np.random.default_rng(100 * T + groups)
    N, K = 128, 96
    blocks, w = _q8_blocks(rng, N, K)
    x = torch.from_numpy(rng.standard_normal((T, groups * K)).astype(np.float32))
    ref = Linear(torch.from_numpy(w), groups).double()(x.double())
    got = cuda.Q8Linear(torch.from_numpy(blocks).to(DEVICE), N, K, groups)(x.to(DEVICE)).double().cpu()
    assert got.shape == (T, N)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= (1e-5 if T <= cuda.KERNEL_MAX_T else PROJECT_F16_TOL), f"relative error {rel:.2e}"


@kernels
@pytest.mark.parametrize("K", [96, 1056])
def test_dequant_f16_equals_torch(K):
    """q8_triton.dequant_f16 (the Q8_0 weight operand of long prefill chunks) bit for bit torch's float16 rounding
    of the dequantized weight over f16_scale, fresh random blocks: K past a whole number of 256-value tiles, row
    counts past a whole number of row tiles; and weights 2^-10 and 2^16 times larger, whose values would be float16
    subnormals or overflow it unscaled."""
    rng = np.random.default_rng(K)
    for N in (1, 40, 96):
        for magnitude in (1.0, 2.0 ** -10, 2.0 ** 16):
            blocks, _ = _q8_blocks(rng, N, K, magnitude)
            quants, scales = q8_triton.split_q8(torch.from_numpy(blocks).to(DEVICE), N, K)
            f16_scale = q8_triton.f16_scale(scales)
            w = q8_triton.dequantize(quants, scales, K)
            assert 2 ** 13 < w.abs().max().item() / f16_scale < 2 ** 15
            got = q8_triton.dequant_f16(quants, scales, K, 1 / f16_scale).cpu()
            want = (w / f16_scale).to(torch.float16).cpu()
            assert got.dtype == torch.float16 and got.shape == (N, K)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"N = {N}: values differ"


@kernels
def test_x_f16_equals_torch():
    """q8_triton.x_f16 (the input operand of long prefill chunks' products) bit for bit torch's float16 rounding of
    each row over its power-of-two scale s, with max |x| / s in [1/2, 1): fresh random rows of magnitudes 1e-30 ..
    1e30 (float16's range is 6e-8 .. 65504), a row of zeros, row and input counts past a whole program and step;
    each wgmma order a permutation of each 256-value chunk."""
    g = torch.Generator().manual_seed(41)
    for T, GK in ((1, 64), (37, 300)):
        x = torch.randn(T, GK, generator=g) * torch.logspace(-30, 30, T)[:, None]
        x[T // 2] = 0.0
        got, s = (a.cpu() for a in q8_triton.x_f16(x.to(DEVICE)))
        assert got.shape == (T, GK) and s.shape == (T,)
        assert torch.equal(torch.frexp(s).mantissa, torch.full((T,), 0.5))                # powers of two
        ratio = x.abs().amax(1) / s
        live = x.abs().amax(1) > 0
        assert ((ratio[live] >= 0.5) & (ratio[live] < 1)).all() and s[T // 2] == 2.0 ** -126
        want = (x / s[:, None]).to(torch.float16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"T = {T}, GK = {GK}: values differ"
    x = torch.randn(19, 512, generator=g)                      # wgmma orders: each chunk's values permuted
    plain, s = q8_triton.x_f16(x.to(DEVICE))
    for position, order in ((q8_triton.wgmma_position, {"wgmma_order": True}),
                            (q8_triton.down_wgmma_position, {"down_order": True})):   # the gate/up's, the down's
        got, s_wg = q8_triton.x_f16(x.to(DEVICE), **order)
        where = position(torch.arange(256))
        assert sorted(where.tolist()) == list(range(256)) and torch.equal(s_wg, s)
        assert torch.equal(got.cpu().view(19, 2, 256)[:, :, where], plain.cpu().view(19, 2, 256)), order


@kernels
def test_split_f16_kernel_equals_the_torch_split():
    """parts.split_f16_triton (the float16 parts of the prefill attention's and indexer's operands on a GPU) bit
    for bit the torch split: fresh random values from ~1e-8 to ~4e4 (within float16's range; subnormal residuals
    included), a size past a whole program."""
    from ds4trt.plugins.kernels.parts import split_f16_triton, split_parts

    g = torch.Generator().manual_seed(43)
    x = torch.randn(3, 5000, generator=g) * torch.logspace(-8, 4, 5000)
    hi, lo = split_f16_triton(x.to(DEVICE))
    want_hi, want_lo = split_parts(x)                                  # on the CPU: the torch split
    assert torch.equal(hi.cpu().view(torch.int16), want_hi.view(torch.int16))
    assert torch.equal(lo.cpu().view(torch.int16), want_lo.view(torch.int16))


@kernels
@pytest.mark.parametrize("groups", [1, 8])
def test_project_f16_vs_float64(groups):
    """Long prefill chunks' products on the float16 tensor cores (x over a power of two per row and the weight
    over f16_scale, each rounded to float16, one GEMM) against float64, fresh random rows of magnitudes 1e-6 ..
    1e8 (past float16's range) and a weight whose values would overflow float16 unscaled: within PROJECT_F16_TOL
    relative, and no closer than 1e-5 (the inputs really are rounded to float16)."""
    from ds4trt.model.linear import project

    g = torch.Generator().manual_seed(31 + groups)
    T, N, K = 300, 512, 1024
    x = torch.randn(T, groups * K, generator=g) * torch.logspace(-6, 8, T)[:, None]
    w = torch.randn(N, K, generator=g) * 1e6 / K ** 0.5
    ref = project(x.double(), w.double(), groups)
    got = cuda.project_f16(x.to(DEVICE), (w / 2 ** 10).to(torch.float16).to(DEVICE), groups, 2.0 ** 10).double().cpu()
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()                  # the worst row, normwise
    assert got.shape == ref.shape and 1e-5 < rel <= PROJECT_F16_TOL, f"relative error {rel:.2e}"


@kernels
@pytest.mark.parametrize("T", [1, 3, 6, 20])
def test_linear_group_matches_each_projection(T, monkeypatch):
    """LinearGroup over two Q8_0, two F16 and one float32 projection of one input (one q8_matmul + one f16_matmul
    up to their row limits, 16 each; T = 6: the F16 pair in two launches, T = 20: every member alone, the four
    quantized ones on one x_f16 of x) against float64 products of each weight, and each module alone still computing
    its own rows from its view of the shared weight."""
    from ds4trt.model.linear import Linear

    rng = np.random.default_rng(7 + T)
    K = 96
    (ba, wa), (bb, wb) = _q8_blocks(rng, 64, K), _q8_blocks(rng, 32, K)
    wc, wd = ((rng.standard_normal((n, K)) / K ** 0.5).astype(np.float16) for n in (48, 16))
    we = rng.standard_normal((8, K)).astype(np.float32)
    q8 = lambda b, n: cuda.Q8Linear(torch.from_numpy(b).to(DEVICE), n, K)  # noqa: E731
    f16 = lambda w: cuda.F16Linear(torch.from_numpy(w).to(DEVICE))  # noqa: E731
    mods = (q8(ba, 64), f16(wc), Linear(torch.from_numpy(we).to(DEVICE)), q8(bb, 32), f16(wd))
    group = cuda.LinearGroup(mods)
    assert [kernel for kernel, *_ in group.fused] == ["q8", "f16"]
    x = torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32)).to(DEVICE)
    splits = []
    monkeypatch.setattr(cuda.q8_triton, "x_f16", lambda x, f=cuda.q8_triton.x_f16: splits.append(x.shape) or f(x))
    outs = group(x, *mods)
    assert splits == ([(T, K)] if T > cuda.KERNEL_MAX_T else [])
    for got, m, w in zip(outs, mods, (wa, wc, we, wb, wd)):
        ref = x.double().cpu() @ torch.from_numpy(w.astype(np.float64)).T
        for y in (got, m(x)):
            assert y.shape == ref.shape
            rel = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
            assert rel <= (1e-5 if T <= cuda.KERNEL_MAX_T else PROJECT_F16_TOL), \
                f"{type(m).__name__}: relative error {rel:.2e}"


@kernels
def test_prefill_queries_in_one_pass_are_the_float16_of_the_two_steps():
    """A prefill chunk's queries (queries_kernel: q_b's product before its rows are scaled back, normed and rotated
    straight to float16) are bit for bit the float16 of q_b then head_norm_rope_kernel, in each of the tiny model's
    attention layers, fresh random inputs of 40 rows (rows of magnitudes 1e-3 .. 1e3); shorter steps keep float32."""
    from ds4trt.model.attention import Attention
    from ds4trt.model.rope import rope_cos_sin

    target, _ = tiny_files()
    engine = cuda.open_engine(target, device=DEVICE, graphs=False)
    layers = [m for m in engine.model.modules() if isinstance(m, Attention)]
    assert layers and all(isinstance(m.q_b, cuda.Q8Linear) for m in layers)
    g = torch.Generator().manual_seed(41)
    for m in layers:
        cfg = m.cfg
        for T in (40, cuda.KERNEL_MAX_T):
            qn = (torch.randn(T, m.q_b.K, generator=g) * torch.logspace(-3, 3, T)[:, None]).to(DEVICE)
            freq = engine.model.rope_freqs[m.ratio != 0].cpu()
            cos, sin = (c.float().to(DEVICE) for c in rope_cos_sin(freq, torch.arange(T) + 1000))
            got = m.queries(qn, cos, sin)
            want = cuda.head_norm_rope_kernel(m.q_b(qn).reshape(T, cfg.n_head, cfg.head_dim), cos, sin, cfg.rms_eps)
            if T > cuda.KERNEL_MAX_T:
                assert got.dtype == torch.float16 and torch.equal(got.view(torch.int16), want.half().view(torch.int16))
            else:
                assert got.dtype == torch.float32 and torch.equal(got, want)


def _greedy_text(engine, text: str, n: int) -> list[int]:
    return greedy(engine, n, engine.tokenizer.encode(text), ctx=512, chunk=PREFILL_CHUNK)


@kernels
@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_tiny_greedy_eager_kernels_match_cpu(numerics):
    target, mtp = tiny_files()
    got = greedy(cuda.open_engine(target, mtp, numerics=numerics, device=DEVICE, graphs=False))
    assert got == greedy(Engine.open(target, mtp, numerics=numerics))


@gpu_only
@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_tiny_greedy_graphs_match_cpu(numerics):
    target, mtp = tiny_files()
    engine = cuda.open_engine(target, mtp, numerics=numerics)
    assert greedy(engine) == greedy(Engine.open(target, mtp, numerics=numerics))


@gpu_only
@pytest.mark.parametrize("min_bound", [None, 16])
def test_tiny_greedy_compiled_graphs_match_cpu(min_bound, monkeypatch):
    """numerics float: Inductor's fused glue agrees with the reference to float32 rounding, not bit for bit. With
    cuda.MIN_BOUND 16 the decode steps (positions 22..35 of a 64-token context) read the compressed caches cut to
    bounds 32 and 64, and the second bound compiles nothing (the cut's row count is a dynamic dimension)."""
    from torch._dynamo.utils import counters

    if min_bound is not None:
        monkeypatch.setattr(cuda, "MIN_BOUND", min_bound)
    target, mtp = tiny_files()
    want = greedy(Engine.open(target, mtp, numerics="float"))
    s = cuda.open_engine(target, mtp, numerics="float", compile=True).session(64)
    s.prefill(PROMPT, chunk=9)
    got, compiled = [s.argmax()], {}
    while len(got) < len(want):
        bound, before = s.target.bound(1), counters["stats"]["unique_graphs"]
        s.eval(got[-1])
        got.append(s.argmax())
        compiled[bound] = compiled.get(bound, 0) + counters["stats"]["unique_graphs"] - before
    assert got == want
    if min_bound is None:
        assert list(compiled) == [64]
    else:
        assert list(compiled) == [32, 64] and compiled[32] > 0 and compiled[64] == 0, compiled


@pytest.fixture(scope="module")
def demos():
    return {n: cuda.open_engine(MODELS / "demo.gguf", MODELS / "demo-mtp.gguf", numerics=n) for n in ("ds4", "float")}


@pytest.fixture(scope="module")
def demo(demos):
    return demos["ds4"]


@gpu_only
def test_demo_greedy_matches_cpu(demo):
    cpu = Engine.open(MODELS / "demo.gguf")
    for text in DEMO_PROMPTS[:2]:
        assert _greedy_text(demo, text, 48) == _greedy_text(cpu, text, 48), text


@gpu_only
@pytest.mark.parametrize("numerics", ["ds4", "float"])
@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_demo_speculative_equals_greedy(demos, numerics, n_draft):
    """Tokens always; caches too in float numerics (in ds4 numerics the float32 differences between a batched
    verify and T = 1 steps can move an FP8-rounded KV value by one step: the tokens still agree)."""
    _speculative_equals_greedy(demos[numerics], numerics, n_draft, DEMO_PROMPTS)


@gpu_only
def test_demo_speculative_compiled_equals_greedy():
    """compile=True (Inductor with INDUCTOR_OPTIONS, as ds4-run --compile): the compiled verify steps accept exactly
    the tokens of the compiled T = 1 steps, and leave their caches"""
    demo = cuda.open_engine(MODELS / "demo.gguf", MODELS / "demo-mtp.gguf", numerics="float", compile=True)
    _speculative_equals_greedy(demo, "float", 3, DEMO_PROMPTS[:3])


@gpu_only
def test_tensor_core_q8_decodes_the_cpu_tokens(monkeypatch):
    """DS4_Q8_MMA=1: every Q8_0 product of up to 16 rows on q8_mma's tensor-core kernel (decode, verify, draft steps
    and short prefill chunks, graphs on): the demo model's greedy tokens are the CPU reference's, and speculative
    decoding (3 drafts, float numerics) gives its own greedy tokens and caches."""
    monkeypatch.setenv("DS4_Q8_MMA", "1")
    cpu = Engine.open(MODELS / "demo.gguf")
    demo = cuda.open_engine(MODELS / "demo.gguf", MODELS / "demo-mtp.gguf")
    for text in DEMO_PROMPTS[:2]:
        assert _greedy_text(demo, text, 48) == _greedy_text(cpu, text, 48), text
    demo = cuda.open_engine(MODELS / "demo.gguf", MODELS / "demo-mtp.gguf", numerics="float")
    _speculative_equals_greedy(demo, "float", 3, DEMO_PROMPTS[:3])


def _speculative_equals_greedy(demo, numerics: str, n_draft: int, prompts) -> None:
    kept = set()
    for text in prompts:
        ref = demo.session(512)
        ref.prefill(demo.tokenizer.encode(text))
        want = [ref.argmax()]
        while len(want) < 64:
            ref.eval(want[-1])
            want.append(ref.argmax())

        s = demo.session(512)
        s.prefill(demo.tokenizer.encode(text))
        got = [s.argmax()]
        while len(got) < 64:          # got: the committed tokens after the prompt, then the next one
            step = s.eval_speculative_argmax(got[-1], max_tokens=64 - len(got), eos=None, n_draft=n_draft,
                                             margin=0.0)
            kept.add(len(step))
            got.extend(step[1:] + [s.argmax()])
        assert got == want, text
        # the session committed exactly the greedy tokens: its caches are those of sequential decoding
        assert s.pos == ref.pos
        ref_cache, cache = ref.cache.live_tensors(), s.cache.live_tensors()
        for k in ref_cache if numerics == "float" else ():
            torch.testing.assert_close(cache[k], ref_cache[k], rtol=1e-4, atol=1e-4, msg=k)
    assert max(kept) > 1, f"no draft was ever accepted (kept lengths {sorted(kept)})"
    assert len(kept) >= min(3, n_draft + 1), f"accepted lengths seen: {sorted(kept)}"


@gpu_only
def test_rewind_resets_in_place(demo):
    s = demo.session(512)
    ids = demo.tokenizer.encode(DEMO_PROMPTS[0])
    s.prefill(ids)
    first = [s.argmax()]
    for _ in range(8):
        s.eval(first[-1])
        first.append(s.argmax())
    ptrs = {k: v.data_ptr() for k, v in s.cache.tensors().items()}
    graphs = len(s.target.graphs)
    s.rewind(len(ids))
    again = [s.argmax()]
    for _ in range(8):
        s.eval(again[-1])
        again.append(s.argmax())
    assert again == first
    assert {k: v.data_ptr() for k, v in s.cache.tensors().items()} == ptrs
    assert len(s.target.graphs) == graphs


@kernels
@pytest.mark.parametrize("numerics,query_block", [("float", None), ("ds4", None), ("ds4", 20)])
def test_tiny_long_prefill_eager_kernels_match_cpu(numerics, query_block, monkeypatch):
    """A 44-token prompt in one prefill chunk: the experts run in slices of 16 tokens and the Q8_0 projections
    through the dequantized path (more than 16 rows), the ratio-4 layers attend each query's own top rows
    (attend_top_kernel: positions 16.. need the indexer); with ds4 numerics the indexer's queries are rounded by
    qat_triton. With queries in blocks of 20 (model/attention.py QUERY_BLOCK; Flash's chunks take 256), the other
    layers' attention writes each block's rows into the chunk's output (attend_kernel's `out`: the queries come as
    float16 from queries_kernel, so all three blocks by attend_long_triton, the last of 4 rows too; float32 queries'
    last 4 rows would go to the decode kernel and a copy)."""
    from ds4trt.model import attention

    if query_block:
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    target, mtp = tiny_files()
    run = lambda engine: greedy(engine, 6, PROMPT * 2, ctx=128, chunk=PREFILL_CHUNK)  # noqa: E731
    assert run(cuda.open_engine(target, mtp, numerics=numerics, device=DEVICE, graphs=False)) == \
        run(Engine.open(target, mtp, numerics=numerics))


@gpu_only
@pytest.mark.parametrize("query_block", [None, 20])
def test_tiny_long_prefill_compiled_matches_cpu(query_block, monkeypatch):
    """DS4_COMPILE_PREFILL=1 with compile=True, the backend's whole chunks made 44 tokens long: the 44-token chunk
    above runs through the compiled blocks (GraphedSteps.compiles says so), its kernels custom ops (with queries in
    blocks of 20, Attention.attend_chunk's op writes three blocks' rows), and the tokens are the CPU's (numerics
    float, as test_tiny_greedy_compiled_graphs_match_cpu)."""
    from ds4trt.model import attention

    if query_block:
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    monkeypatch.setenv("DS4_COMPILE_PREFILL", "1")
    monkeypatch.setattr(cuda, "PREFILL_CHUNK", 2 * len(PROMPT))
    asked = []
    compiles = cuda.GraphedSteps.compiles

    def spy(self, T):                                   # GraphedSteps.compiles, each answer recorded
        asked.append((T, compiles(self, T)))
        return asked[-1][1]
    monkeypatch.setattr(cuda.GraphedSteps, "compiles", spy)
    target, mtp = tiny_files()
    run = lambda engine: greedy(engine, 6, PROMPT * 2, ctx=128, chunk=PREFILL_CHUNK)  # noqa: E731
    assert run(cuda.open_engine(target, mtp, numerics="float", compile=True)) == \
        run(Engine.open(target, mtp, numerics="float"))
    assert (2 * len(PROMPT), True) in asked


@gpu_only
@pytest.mark.parametrize("min_bound", [None, 16])
def test_tiny_graphed_prefill_chunks_equal_eager(min_bound, monkeypatch):
    """GraphedSteps.prefill with whole chunks made 20 tokens long (more than 16: the long calls' kernels): a
    110-token prompt in five whole chunks, each captured where its (indexer, bound) is new and replayed at the later
    positions of the same key, and a rest of 10 tokens eagerly, leaves bit for bit the logits and caches of the same
    prompt prefilled eagerly (DS4_GRAPH_PREFILL=0), and the tokens decoded after it are the CPU reference's. With
    cuda.MIN_BOUND 16 the chunks' bounds are 32, 64, 64, 128, 128."""
    if min_bound is not None:
        monkeypatch.setattr(cuda, "MIN_BOUND", min_bound)
    monkeypatch.setattr(cuda, "PREFILL_CHUNK", 20)
    target, mtp = tiny_files()
    prompt = torch.randint(0, 200, (110,), generator=torch.Generator().manual_seed(4)).tolist()
    sessions = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("DS4_GRAPH_PREFILL", graphs)
        s = sessions[graphs] = cuda.open_engine(target, mtp, numerics="ds4").session(128)
        s.prefill(prompt)
    graphed, eager = sessions["1"], sessions["0"]
    keys = set(graphed.target.chunks)
    assert not eager.target.chunks and 1 < len(keys) < 5, keys
    assert {key[2] for key in keys} == ({128} if min_bound is None else {32, 64, 128})
    assert torch.equal(graphed.logits, eager.logits)
    want = eager.cache.tensors()
    assert all(torch.equal(t, want[name]) for name, t in graphed.cache.tensors().items())
    ref = Engine.open(target, mtp, numerics="ds4").session(128)
    ref.prefill(prompt)

    def decoded(s) -> list[int]:
        out = [s.argmax()]
        while len(out) < 8:
            s.eval(out[-1])
            out.append(s.argmax())
        return out
    assert decoded(graphed) == decoded(ref)


@gpu_only
@pytest.mark.parametrize("mode", [["--glm-mtp", "--mtp-draft", "3", "--mtp-margin", "0"],
                                  ["--temp", "0.8", "--top-k", "40", "--seed", "3"]], ids=["mtp", "sampled"])
def test_cli_device_cuda_prints_the_cpu_text(mode, capsys):
    """ds4-run on the bundled demo model: --device cuda streams the same text as --device cpu (MTP greedy, and
    sampling with a seed: the sampler draws on the CPU whatever the device)."""
    from ds4trt import cli

    texts = []
    for device in ("cpu", "cuda"):
        try:
            cli.run_main(["--raw", "-p", DEMO_PROMPTS[0], "-n", "40", "--device", device] + mode)
        except SystemExit as e:
            assert e.code in (0, None), capsys.readouterr().err
        texts.append(capsys.readouterr().out)
    assert texts[0] and texts[1] == texts[0]


@kernels
@pytest.mark.parametrize("n_draft", [1, 3, 5])
def test_tiny_speculative_matches_cpu_greedy(n_draft):
    """Speculative decoding on the kernel path (CUDA graphs on a GPU) against plain greedy on the CPU reference;
    margin 0, so every cycle drafts and verifies n_draft tokens (5: verify steps of 6 rows, ds4::MoE's
    multi-row kernels, Q8_0 and F16 products in two launches)."""
    target, mtp = tiny_files()
    engine = cuda.open_engine(target, mtp, numerics="float", device=DEVICE, graphs=GPU)
    want = greedy(Engine.open(target, mtp, numerics="float"))
    s = engine.session(64)
    s.prefill(PROMPT, chunk=9)
    got = [s.argmax()]
    while len(got) < len(want):
        step = s.eval_speculative_argmax(got[-1], max_tokens=len(want) - len(got), eos=None, n_draft=n_draft,
                                         margin=0.0)
        got.extend(step[1:] + [s.argmax()])
    assert got == want
    assert s.stats.drafted and s.stats.drafted[0] > 0          # the drafter ran and its drafts were verified


@gpu_only
@pytest.mark.parametrize("min_bound", [None, 16])
def test_warm_up_captures_every_graph_decoding_replays(min_bound, monkeypatch):
    """Session.warm_up(n_draft) captures the graphs that speculative (and plain) decoding replay, with and without
    the indexer (and, with cuda.MIN_BOUND 16 in a 64-token context, for bounds 16, 32 and 64: Steps.kinds), and
    writes no cache row: a tiny-model session whose prompt ends below position 4 * index_top_k and whose generation
    passes it captures nothing more, and decodes exactly the CPU reference's greedy tokens. Every commit graph is
    the one-kernel commit (commit_triton), none CacheState.write's fallback."""
    if min_bound is not None:
        monkeypatch.setattr(cuda, "MIN_BOUND", min_bound)
    target, mtp = tiny_files()
    engine = cuda.open_engine(target, mtp, numerics="float")
    prompt = PROMPT[:8]
    n = 4 * engine.cfg.index_top_k + 16 - len(prompt)
    want = greedy(Engine.open(target, mtp, numerics="float"), n, prompt)
    for n_draft in (0, 3):
        s = engine.session(64)
        empty = {k: v.clone() for k, v in s.cache.tensors().items()}
        assert s.warm_up(n_draft) > 0
        assert all(torch.equal(v, empty[k]) for k, v in s.cache.tensors().items())
        assert {key[2] for key in s.target.graphs} == {False, True}
        assert {key[3] for key in s.target.graphs} == ({64} if min_bound is None else {16, 32, 64})
        steps = [s.target] + ([s.drafter.head, s.drafter.scratch_head] if n_draft else [])
        assert all(plan is not None for st in steps for _, plan in st.commits.values()), "a commit fell back"
        captured = lambda: [(set(st.graphs), set(st.commits)) for st in steps]  # noqa: E731
        before = captured()
        s.prefill(prompt, chunk=9)
        got = [s.argmax()]
        while len(got) < n:
            if n_draft:
                step = s.eval_speculative_argmax(got[-1], max_tokens=n - len(got), eos=None, n_draft=n_draft,
                                                 margin=0.0)
            else:
                s.eval(got[-1])
                step = [got[-1]]
            got.extend(step[1:] + [s.argmax()])
        assert got == want, f"n_draft {n_draft}"
        assert captured() == before, f"n_draft {n_draft}: graphs captured after the warm-up"
        assert s.warm_up(n_draft) == 0
