"""Command lines: argument parsing and printing only; the work is in runtime/ (and export/ for builds).

ds4-run: stdout carries only the generated text, streamed; statistics and notes go to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from ds4trt.errors import Ds4Error
from ds4trt.runtime.profile import PHASES

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_CTX = 4096


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-run", description="Run DeepSeek V4 Flash (ds4 GGUF files).")
    p.add_argument("--gguf", help="target model GGUF (default: the bundled demo model in models/)")
    p.add_argument("--engines", metavar="DIR",
                   help="run an engine directory written by ds4-build (ONNX Runtime or TensorRT, as its manifest "
                        "says) instead of --gguf")
    p.add_argument("--mtp", help="MTP head GGUF for speculative decoding")
    p.add_argument("-p", "--prompt", help="prompt; without it, an interactive multi-turn chat on stdin")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--ctx", type=int, default=None,
                   help=f"context size in tokens (default {DEFAULT_CTX}, or the model's context length if smaller)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_true", help="thinking mode (<think>)")
    think.add_argument("--nothink", dest="think", action="store_false", help="no thinking (default)")
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as plain text")
    p.add_argument("--numerics", choices=("ds4", "float"), default="ds4",
                   help="ds4: FP8 KV and FP4 indexer rounding as ds4 does (default); float: none")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="with --gguf: cuda keeps the GGUF blocks on the GPU and replays CUDA graphs (Triton kernels); "
                        "cpu runs the PyTorch reference; auto: cuda when a GPU and Triton are present (default)")
    p.add_argument("--compile", action="store_true",
                   help="with --device cuda: torch.compile each block's glue around the kernels (faster steps; "
                        "each step shape compiles first, in the warm-up: seconds to a minute each)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="with --device cuda: capture (and with --compile compile) each step shape on its first use "
                        "instead of before the prompt (a stall mid-stream, e.g. at the first step past position "
                        "4 x index_top_k, where the indexer starts)")
    p.add_argument("--info", action="store_true", help="print the model summary and exit")
    p.add_argument("--profile", action="store_true",
                   help="print per-phase latency p50/p99 (prefill, decode, draft, verify, accept, commit) on stderr")
    p.add_argument("--glm-mtp", action="store_true", help="MTP speculative decoding (forces greedy decoding)")
    p.add_argument("--mtp-draft", type=int, default=2, help="tokens drafted per step, 1..8 (default 2)")
    p.add_argument("--mtp-margin", type=float, default=3.0,
                   help="stop drafting when the drafter's top-1 minus top-2 logit gap is below this (default 3)")
    return p


def _default_model(name: str) -> Path:
    path = DEFAULT_MODEL_DIR / name
    if not path.exists():
        raise Ds4Error(f"no --gguf given and the bundled model {path} is missing")
    return path


def _info(path: str) -> None:
    """The summary from the metadata and the tensor directory: nothing is dequantized, and the BPE
    tokenizer is not built (its ids are only looked up), so a Flash-size file takes about a second."""
    from ds4trt.gguf_io import names as N
    from ds4trt.gguf_io.names import TYPE_NAMES
    from ds4trt.model.weights import load_target
    from ds4trt.tokenizer import BOS, EOS

    gguf_file, cfg, weights = load_target(path)
    types: dict[str, int] = {}
    for t in gguf_file.tensors.values():
        name = TYPE_NAMES.get(t.ggml_type, str(t.ggml_type))
        types[name] = types.get(name, 0) + t.nbytes
    print(f"file         {path} ({gguf_file.file_size / 1e9:.2f} GB, GGUF v{gguf_file.version}, "
          f"{len(gguf_file.tensors)} tensors)")
    print(cfg.summary())
    size = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"  # noqa: E731
    print("tensor data  " + ", ".join(f"{k} {size(v)}" for k, v in sorted(types.items(), key=lambda kv: -kv[1])))
    tokens, merges = (gguf_file.metadata.get(k) for k in (N.KEY_TOKENS, N.KEY_MERGES))
    if tokens is None or not isinstance(tokens.value, list):
        print(f"tokenizer    none ({N.KEY_TOKENS} is missing or not a string array)")
    else:
        vocab = tokens.value
        ids = {s: (vocab.index(s) if s in vocab else None) for s in (BOS, EOS)}
        n_merges = len(merges.value) if merges is not None and isinstance(merges.value, list) else 0
        note = "" if len(vocab) == cfg.n_vocab else f" (does not match {N.KEY_VOCAB} {cfg.n_vocab})"
        print(f"tokenizer    {len(vocab)} tokens{note}, {n_merges} merges, BOS={ids[BOS]} EOS={ids[EOS]}")


class _Sampler:
    def __init__(self, temp: float, top_k: int, top_p: float, seed: int):
        self.temp, self.top_k, self.top_p = temp, top_k, top_p
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temp <= 0:
            return int(torch.argmax(logits))
        z = logits.double().cpu() / self.temp       # on the CPU: the same seed samples the same on every device
        if self.top_k > 0:
            kth = torch.topk(z, min(self.top_k, z.numel())).values[-1]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, -1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p >= self.top_p
            drop[0] = False  # the most likely token always stays
            probs[order[drop]] = 0
            probs /= probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.gen))


def _generate(session, args, sampler, use_mtp: bool, out) -> tuple[int, float]:
    """Generate up to -n tokens after the session's logits, streaming text to `out`. Returns (count, seconds)."""
    tok = session.engine.tokenizer
    eos = tok.eos_id
    stream = tok.stream()
    log = (lambda line: print(line, file=sys.stderr)) if os.environ.get("DS4_MTP_CONF_LOG") == "1" else None
    n, t0 = 0, time.perf_counter()
    nxt = sampler(session.logits)
    while n < args.n_predict:
        room = min(args.n_predict - n, session.ctx - session.pos)
        if room <= 0:
            print("\nds4-run: context full", file=sys.stderr)
            break
        if use_mtp:
            new = session.eval_speculative_argmax(nxt, room, eos, args.mtp_draft, args.mtp_margin, log=log)
        else:
            session.eval(nxt)
            new = [nxt]
        n += len(new)
        for t in new:
            if t != eos:
                out.write(stream.push(t))
        out.flush()
        if new[-1] == eos:
            break
        nxt = sampler(session.logits)
    out.write(stream.flush())
    out.flush()
    return n, time.perf_counter() - t0


def _stats(n_prompt: int, t_prefill: float, n_gen: int, t_gen: float, session, use_mtp: bool,
           computed: int | None = None) -> None:
    """`computed`: prompt tokens actually run (a chat turn reuses the cached prefix); default all."""
    rate = lambda n, t: f"{n / t:.1f}" if t > 0 else "-"  # noqa: E731
    computed = n_prompt if computed is None else computed
    cached = f" ({n_prompt - computed} cached)" if computed != n_prompt else ""
    print(f"\nprompt: {n_prompt} tokens{cached}, prefill: {rate(computed, t_prefill)} t/s, "
          f"generation: {rate(n_gen, t_gen)} t/s ({n_gen} tokens)", file=sys.stderr)
    if use_mtp:
        print(session.stats.report(), file=sys.stderr)
    if PHASES.enabled:
        print(PHASES.report(), file=sys.stderr)


def _warm_up(session, args, use_mtp: bool, first: int = 0, end: int | None = None) -> None:
    """Session.warm_up for decoding from position `first` up to `end` (unless --no-warm-up); says what it took."""
    if args.warm_up:
        t0 = time.perf_counter()
        n = session.warm_up(args.mtp_draft if use_mtp else 0, first, end)
        if n:
            print(f"ds4-run: {n} step graphs captured in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def _utf8(text: str, what: str) -> str:
    """Text from argv or stdin; undecodable bytes arrive as lone surrogates (surrogateescape), which
    the tokenizer cannot take: say which input and which byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        byte = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"code point U+{ch:04X}"
        raise Ds4Error(f"{what} is not valid UTF-8 ({byte} at character {e.start})") from None
    return text


def _check_args(args) -> None:
    if not 1 <= args.mtp_draft <= 8:
        raise Ds4Error(f"--mtp-draft must be in 1..8, got {args.mtp_draft}")
    if args.ctx is not None and args.ctx < 1:
        raise Ds4Error(f"--ctx must be >= 1, got {args.ctx}")
    if args.n_predict < 0:
        raise Ds4Error(f"-n must be >= 0, got {args.n_predict}")
    if not args.temp >= 0:  # also NaN
        raise Ds4Error(f"--temp must be >= 0, got {args.temp}")
    if args.top_k < 0:
        raise Ds4Error(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise Ds4Error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not -(1 << 63) <= args.seed < 1 << 64:
        raise Ds4Error(f"--seed must fit in 64 bits, got {args.seed}")
    if not math.isfinite(args.mtp_margin):
        raise Ds4Error(f"--mtp-margin must be a finite number, got {args.mtp_margin}")
    if args.prompt is not None:
        _utf8(args.prompt, "the prompt (-p)")
    _utf8(args.system, "the system prompt (--system)")


def _context(args, engine) -> int:
    """--ctx, checked against the model's context length (deepseek4.context_length; 0 = unknown)."""
    limit = engine.cfg.context_length
    if args.ctx is None:
        return min(DEFAULT_CTX, limit) if limit > 0 else DEFAULT_CTX
    if limit > 0 and args.ctx > limit:
        raise Ds4Error(f"--ctx {args.ctx} exceeds the model's context length {limit} ({engine.source})")
    return args.ctx


def _device(choice: str) -> str:
    """--device resolved: 'cuda' needs a CUDA device and Triton (the kernels), 'auto' picks it when both exist."""
    import importlib.util

    import torch

    have = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    if choice == "cuda" and not have:
        raise Ds4Error("--device cuda: " + ("no CUDA device is visible to PyTorch" if not torch.cuda.is_available()
                                            else "the kernels need Triton (pip install triton)"))
    return "cuda" if choice == "cuda" or (choice == "auto" and have) else "cpu"


def _open_engine(args, gguf, mtp):
    """The Engine: from GGUF files, or with --engines from an engine directory written by ds4-build (ONNX
    Runtime or TensorRT by its manifest's backend; the session's context is the one the directory was built for)."""
    from ds4trt.runtime.session import Engine

    if not args.engines:
        if _device(args.device) == "cuda":
            from ds4trt.runtime.backends.cuda import open_engine as open_cuda

            return open_cuda(gguf, mtp, numerics=args.numerics, compile=args.compile)
        if args.compile:
            raise Ds4Error("--compile applies to --device cuda (the PyTorch reference on the CPU runs eagerly)")
        return Engine.open(gguf, mtp, numerics=args.numerics)
    from ds4trt.export.manifest import backend_of

    if backend_of(args.engines) == "tensorrt":
        from ds4trt.runtime.backends.tensorrt import open_engine
    else:
        from ds4trt.runtime.backends.onnxruntime import open_engine

    engine = open_engine(args.engines)
    if mtp is None:
        engine.mtp = None
    elif engine.mtp is None:
        raise Ds4Error(f"{args.engines}: no MTP graph for --glm-mtp (build it with ds4-build --mtp FILE)")
    built = engine.model.ctx
    if args.ctx is not None and args.ctx > built:
        raise Ds4Error(f"--ctx {args.ctx} exceeds the {built} positions {args.engines} was built for "
                       f"(rebuild with ds4-build --ctx {args.ctx})")
    args.ctx = built
    return engine


def run(argv: list[str] | None = None) -> int:
    args = _run_parser().parse_args(argv)
    from ds4trt.chat import Conversation, render_single

    _check_args(args)
    PHASES.enabled = args.profile
    if args.engines and (args.gguf or args.mtp or args.info):
        raise Ds4Error("--engines replaces --gguf, --mtp and --info: the directory holds the model")
    if args.engines and args.device != "auto":
        raise Ds4Error("--device applies to --gguf runs; --engines runs on the backend its manifest names")
    gguf = args.gguf or (None if args.engines else str(_default_model("demo.gguf")))
    if args.info:
        _info(gguf)
        return 0
    mtp = args.mtp
    if args.glm_mtp:
        args.temp = 0.0
        if mtp is None and args.engines:
            mtp = args.engines                   # the directory's MTP graph
        if mtp is None:
            mtp = str(_default_model("demo-mtp.gguf")) if args.gguf is None else None
        if mtp is None:
            raise Ds4Error("--glm-mtp needs an MTP GGUF: pass --mtp FILE")
    use_mtp = mtp is not None and args.mtp_draft >= 1
    if use_mtp and args.temp > 0:
        print("ds4-run: MTP speculative decoding needs greedy decoding (--temp 0); decoding normally",
              file=sys.stderr)
        use_mtp = False
    engine = _open_engine(args, gguf, mtp if use_mtp else None)
    tok = engine.tokenizer
    if tok.n_vocab != engine.cfg.n_vocab:
        # generated ids must decode and prompt ids must embed: the two vocabularies are one
        raise Ds4Error(f"{gguf}: metadata tokenizer.ggml.tokens has {tok.n_vocab} entries, expected "
                       f"{engine.cfg.n_vocab} (deepseek4.vocab_size and the embedding/output rows)")
    ctx = _context(args, engine)
    try:
        session = engine.session(ctx)
    except (MemoryError, RuntimeError) as e:  # torch: "DefaultCPUAllocator: can't allocate memory ..."
        raise Ds4Error(f"--ctx {ctx}: cannot allocate the caches ({e})") from None
    sampler = _Sampler(args.temp, args.top_k, args.top_p, args.seed)
    out = sys.stdout

    if args.prompt is not None:
        ids = tok.encode(args.prompt) if args.raw else render_single(tok, args.prompt, args.system, args.think)
        if not ids:
            raise Ds4Error("the prompt (-p) is empty: with --raw there is no token to continue from")
        if len(ids) <= ctx:                   # else prefill says it does not fit
            _warm_up(session, args, use_mtp, first=len(ids), end=len(ids) + args.n_predict)
        t0 = time.perf_counter()
        session.prefill(ids)
        t_prefill = time.perf_counter() - t0
        n, t = _generate(session, args, sampler, use_mtp, out)
        out.write("\n")
        _stats(len(ids), t_prefill, n, t, session, use_mtp)
        return 0

    # interactive multi-turn chat: re-render the conversation, keep the common prefix of the cache; each turn warms up
    # the steps its reply can take (from the prompt's end to -n tokens later), so a long --ctx costs no up-front
    # capture of every bound, and a turn that reaches a new bound or the indexer captures its graphs before it
    # streams, not mid-reply
    conv = Conversation()
    if args.system:
        conv.append("system", args.system)
    interactive = sys.stdin.isatty()
    line_no = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line_no += 1
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:  # a strict stdin encoding (PYTHONIOENCODING=utf-8)
            raise Ds4Error(f"stdin line {line_no} is not valid {e.encoding} ({e.reason})") from None
        if not line:
            return 0
        if not line.strip():
            continue
        conv.append("user", _utf8(line.rstrip("\n"), f"stdin line {line_no}"))
        ids = conv.render(tok, think=args.think)
        common = 0
        while common < min(len(ids), session.pos) and ids[common] == session.tokens[common]:
            common += 1
        keep = min(common, len(ids) - 1)
        t0 = time.perf_counter()
        replayed = 0
        if keep < session.pos:  # the cache holds tokens the new rendering does not: go back (replays `keep`)
            session.rewind(keep)
            replayed = keep
        computed = replayed + len(ids) - session.pos
        session.prefill(ids[session.pos:])
        t_prefill = time.perf_counter() - t0
        start = session.pos
        _warm_up(session, args, use_mtp, first=start, end=start + args.n_predict)
        n, t = _generate(session, args, sampler, use_mtp, out)
        out.write("\n")
        _stats(len(ids), t_prefill, n, t, session, use_mtp, computed=computed)
        reply = [t for t in session.tokens[start:] if t != tok.eos_id]
        conv.append("assistant", tok.decode(reply))


def _main(prog: str, command, argv: list[str] | None) -> None:
    """Run a command; a Ds4Error becomes one line on stderr and exit status 1."""
    try:
        sys.exit(command(argv))
    except Ds4Error as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def run_main(argv: list[str] | None = None) -> None:
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a generated character
    try:
        _main("ds4-run", run, argv)
    except BrokenPipeError:  # stdout closed by the reader (ds4-run ... | head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        sys.exit(141)


# ---- ds4-build ----

def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-build", description="Export ds4 GGUF files to an engine directory "
                                "(ONNX step graphs + weights + tokenizer + manifest.json) for ds4-run --engines; "
                                "with --backend tensorrt also the TensorRT engines (this machine's GPU and TensorRT).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="target model GGUF")
    src.add_argument("--from-onnx", metavar="DIR",
                     help="(re)build the TensorRT engines of an existing engine directory in place, from its ONNX "
                          "graphs (on the device: scripts/jetson_build.sh); needs --backend tensorrt")
    p.add_argument("--mtp", help="MTP head GGUF: also export the MTP step graph")
    p.add_argument("--out", help="engine directory to write (with --gguf)")
    p.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                   help="runtime the engines are for (default onnxruntime)")
    p.add_argument("--ctx", type=int, default=4096, help="maximum context: the cache shapes (default 4096)")
    p.add_argument("--numerics", choices=("ds4", "float"), default="ds4",
                   help="ds4: FP8 KV and FP4 indexer rounding as ds4 does (default); float: none")
    p.add_argument("--check", action="store_true",
                   help="compare every graph in ONNX Runtime with the PyTorch reference on random inputs "
                        "(polygraphy); reference inputs/outputs are saved to OUT/check/; with --backend tensorrt "
                        "the engines are then compared with those saved outputs")
    trt = p.add_argument_group("TensorRT (--backend tensorrt)")
    trt.add_argument("--mtp-draft-max", type=int, default=8,
                     help="largest ds4-run --mtp-draft the verify profile serves: T = 2..N+1 (default 8)")
    trt.add_argument("--prefill-chunk", type=int, default=256,
                     help="largest step (the prefill profile's T), at most --ctx (default 256, ds4-run's chunk)")
    trt.add_argument("--version-compatible", action="store_true",
                     help="embed the lean runtime: the engines also run on later TensorRT versions (maybe slower)")
    trt.add_argument("--timing-cache", metavar="FILE", help="TensorRT timing cache to reuse and update "
                     "(default DIR/timing.cache)")
    return p


class _Bar:
    """export/package.py Progress on a tqdm bar (stderr)."""

    def __init__(self):
        self.bar = None

    def stage(self, text: str) -> None:
        self._close()
        print(f"ds4-build: {text}", file=sys.stderr)

    def start_bytes(self, text: str, total: int) -> None:
        from tqdm import tqdm

        self._close()
        self.bar = tqdm(total=total, desc=f"ds4-build: {text}", unit="B", unit_scale=True, file=sys.stderr)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _print_tensorrt(directory) -> None:
    from ds4trt.export import manifest as M

    info = M.tensorrt_info(M.load(directory, verify_hashes=False))
    ranges = ", ".join(f"{p['name']} T {p['min']}..{p['max']}" for p in info.profiles)
    print(f"TensorRT {info.version} engines for compute capability {info.compute_capability}"
          f"{' (version-compatible)' if info.version_compatible else ''}: "
          f"{', '.join(p.name for p in info.engines.values())}; profiles {ranges}")


def build(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from ds4trt.export.package import build as build_engine
    from ds4trt.export.tensorrt import TrtOptions

    trt = TrtOptions(args.mtp_draft_max, args.prefill_chunk, args.version_compatible, args.timing_cache)
    if args.from_onnx:
        if args.backend != "tensorrt":
            raise Ds4Error("--from-onnx builds TensorRT engines: pass --backend tensorrt")
        if args.out is not None and Path(args.out).resolve() != Path(args.from_onnx).resolve():
            raise Ds4Error("--from-onnx builds in place: leave out --out (or give the same directory)")
        if args.mtp:
            raise Ds4Error("--from-onnx takes the graphs the directory has: leave out --mtp")
        from ds4trt.export.tensorrt import rebuild

        bar = _Bar()
        rebuild(args.from_onnx, trt, bar)
        bar._close()
        _print_tensorrt(args.from_onnx)
        return _check_tensorrt(args.from_onnx) if args.check else 0
    if args.out is None:
        raise Ds4Error("--out DIR is required with --gguf")
    bar = _Bar()
    report = build_engine(args.gguf, args.out, mtp=args.mtp, backend=args.backend, ctx=args.ctx,
                          numerics=args.numerics, progress=bar, trt=trt)
    bar._close()
    size = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"  # noqa: E731
    print(f"engine directory {report.out} ({args.backend}, ctx {args.ctx}, {args.numerics} numerics) "
          f"in {report.seconds:.1f} s")
    for name, n in report.files.items():
        print(f"  {name:16} {size(n)}")
    for role, g in report.graphs.items():
        print(f"  {role} graph: {g['nodes']} nodes, {g['initializers']} initializers, {g['moe_nodes']} ds4::MoE")
    if report.trt_problems:
        print(f"TensorRT ONNX parser support: {len(report.trt_problems)} problem(s):")
        for line in report.trt_problems:
            print(f"  {line}")
    else:
        print("TensorRT ONNX parser support: every op and input type is in the support matrix (or a ds4 plugin)")
    if args.backend == "tensorrt":
        _print_tensorrt(args.out)
    if not args.check:
        return 0
    from ds4trt.export.check import TOL, check_engine

    results = check_engine(args.out, args.gguf, args.mtp, save_dir=Path(args.out) / "check")
    failed = [r for r in results if not r.ok]
    for g in dict.fromkeys(r.graph for r in results):
        rel = lambda rows: max(r.rel for r in results                                     # noqa: E731
                               if r.graph == g and r.output.startswith("rows.") == rows)
        print(f"check {g}: ONNX Runtime vs PyTorch, max |diff| / max |ref|: logits and hc {rel(False):.1e}, "
              f"cache rows {rel(True):.1e} (tolerance {TOL:g}; ds4 numerics: rows may differ by one FP8 "
              "rounding step in up to 1% of elements)")
    for r in failed:
        print(f"check FAILED: {r.graph} T={r.T} {r.output}: {r.rel:.2e}, {r.flips:.1%} of elements beyond")
    print(f"check: reference inputs and outputs saved in {Path(args.out) / 'check'} (polygraphy JSON)")
    if args.backend == "tensorrt" and _check_tensorrt(args.out):
        return 1
    return 1 if failed else 0


def _check_tensorrt(directory) -> int:
    """The engines against the ONNX Runtime outputs an earlier --check saved in DIR/check (export/tensorrt.py)."""
    from ds4trt.export.check import TOL
    from ds4trt.export.tensorrt import compare_with_saved

    if not (Path(directory) / "check").is_dir():
        raise Ds4Error(f"{directory}/check is missing: run ds4-build --gguf ... --check once to save the reference "
                       "inputs and outputs")
    results = compare_with_saved(directory)
    for g in dict.fromkeys(r.graph for r in results):
        worst = max(r.rel for r in results if r.graph == g)
        print(f"check {g}: TensorRT vs ONNX Runtime (saved), max |diff| / max |ref| {worst:.1e} (tolerance {TOL:g}; "
              "ds4 numerics: rows may differ by one FP8 rounding step in up to 1% of elements)")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"check FAILED: TensorRT {r.graph} T={r.T} {r.output}: {r.rel:.2e}, {r.flips:.1%} of elements beyond")
    return 1 if failed else 0


def build_main(argv: list[str] | None = None) -> None:
    _main("ds4-build", build, argv)
