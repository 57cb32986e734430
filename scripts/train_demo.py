"""Train the bundled demo model: a small DeepSeek-V4-architecture model and its MTP head.

    python scripts/train_demo.py --out models/ [--device cuda] [--target-steps N] [--mtp-steps N]

Corpus: the Python standard library's source of the interpreter that runs this script (every machine
has one); files are sorted by path and every 50th is held out (scripts/eval_demo.py uses them).
Tokenizer: a byte-level BPE of DEMO_VOCAB tokens trained with HF `tokenizers` on the same corpus, with the
DeepSeek V4 pre-tokenizer, stored in the GGUF as ds4's files store theirs (tokens + merges).
Model: ds4trt's own reference model (model/transformer.py) at DEMO_CONFIG: every layer kind (sliding,
ratio 4 + indexer, ratio 16 standing in for 128), hash-routed layers, hyper-connections, MoE.
Training: next-token cross-entropy on random --seq-token windows (one long window per step keeps the GPU
busy: the step function takes one sequence), float numerics; the indexer's top-k
selection is not differentiable, so its weights stay at their seeded initial values (as DeepSeek trains the
indexer with a separate objective, which this demo omits). Then the MTP head with the target frozen:
DeepSeek's objective, hidden state h_i + embedding of x_{i+1} -> x_{i+2} (model/mtp.py).
Stage 2 (--target-gguf): the shipped MTP head is trained again against the finished, quantized target
as it runs (ds4 numerics), distilled from the target's own distribution of the token after next, which
is what the speculative loop's acceptance measures.
Export: ds4's quant mix (Q8_0 projections, Q4_K routed experts, F16/F32 elsewhere) via the test-model
writer, which quantizes the trained values. Seeded: the same corpus, steps and device reproduce the files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ds4trt.model.layout import mtp_layout, target_layout
from ds4trt.model.mtp import MTPHead
from ds4trt.model.transformer import Transformer
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.runtime.cache import CacheState
from ds4trt.testing.tiny_gguf import SPECIAL_TOKENS, tiny_config, write_model_gguf, write_mtp_gguf
from ds4trt.tokenizer import pre_tokenizer

DEMO_VOCAB = 4096
DEMO_CONFIG = dict(n_layer=6, compress_ratios=(0, 0, 4, 16, 4, 16), n_hash_layer=3, n_embd=256, n_vocab=DEMO_VOCAB,
                   n_head=4, head_dim=64, n_rot=16, q_lora_rank=128, o_lora_rank=64, o_groups=2, n_expert=16,
                   n_expert_used=2, expert_ff=256, window=32, index_n_head=4, index_head_dim=32, index_top_k=32,
                   context_length=4096, name="ds4trt-demo (Python stdlib)")
Q4_K = 12
HELD_OUT_EVERY = 50


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    train = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY]
    held = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0]
    return train, held


def read_text(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab: int) -> tuple[list[str], list[str]]:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    ordered = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in ordered]
    assert [i for _, i in ordered] == list(range(len(tokens))) and len(tokens) == vocab, len(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def encode_corpus(tokens: list[str], merges: list[str], texts: list[str]) -> np.ndarray:
    from ds4trt.tokenizer import Tokenizer
    tok = Tokenizer.from_vocab(tokens, merges)
    eos = tok.eos_id
    ids = []
    for t in texts:
        ids.extend(tok.encode(t))
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


class Named:
    """Records which GGUF tensor each model parameter came from (parameters share the loaded storage)."""

    def __init__(self, weights):
        self.weights, self.loaded = weights, {}

    def get(self, name):
        t = self.weights.get(name)
        self.loaded[name] = t
        return t

    def has(self, name):
        return self.weights.has(name)

    def trainable(self, module) -> dict[str, torch.nn.Parameter]:
        by_ptr = {p.data_ptr(): p for p in module.parameters()}
        return {n: by_ptr[t.data_ptr()] for n, t in self.loaded.items()
                if t.is_floating_point() and t.data_ptr() in by_ptr}


def windows(data: np.ndarray, n: int, seq: int, rng: np.random.Generator) -> list[np.ndarray]:
    """n random windows of seq + 2 tokens (inputs, next tokens, and the token after for the MTP)."""
    starts = rng.integers(0, len(data) - seq - 2, size=n)
    return [data[s:s + seq + 2] for s in starts]


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))) * 0.9 + peak * 0.05


def fresh_caches(cfg, seq, device, ratios=None):
    return CacheState(cfg, seq, ratios=ratios, device=device).layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models", help="output folder for demo.gguf and demo-mtp.gguf")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="folder of .py files")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-steps", type=int, default=0,
                    help="optimizer steps for the target (0: as many as fit in --target-seconds, measured on the "
                         "first steps; the log prints the number, which reproduces the run)")
    ap.add_argument("--mtp-steps", type=int, default=0, help="the same for the MTP head")
    ap.add_argument("--target-seconds", type=float, default=300)
    ap.add_argument("--mtp-seconds", type=float, default=80)
    ap.add_argument("--batch", type=int, default=1, help="windows per optimizer step")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-gguf", help="stage 2: keep this trained target (ds4 numerics, as it runs) and "
                    "train only the MTP head, distilled from the target's own next-token distribution")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    train_paths, held_paths = corpus_files(Path(args.corpus))
    texts = read_text(train_paths)
    if args.target_gguf:
        return train_mtp_stage2(args, out, texts)
    tokens, merges = train_tokenizer(texts, DEMO_VOCAB)
    data = encode_corpus(tokens, merges, texts)
    print(f"corpus {args.corpus}: {len(train_paths)} train files, {len(held_paths)} held out, "
          f"{len(data)} tokens; tokenizer {time.time() - t0:.0f}s", flush=True)

    cfg = tiny_config(**DEMO_CONFIG)
    init, init_mtp = out / "init.gguf", out / "init-mtp.gguf"
    write_model_gguf(init, cfg, seed=args.seed, tokenizer=(tokens, merges), expert_types=(Q4_K,) * 3)
    write_mtp_gguf(init_mtp, cfg, seed=args.seed + 1)
    _, _, weights = load_target(init)
    named = Named(weights)
    model = Transformer(cfg, named, numerics="float")
    params = named.trainable(model)
    model.to(args.device)
    for p in params.values():
        p.requires_grad_(True)
    print(f"target: {sum(p.numel() for p in params.values()) / 1e6:.2f} M trainable parameters", flush=True)

    rng = np.random.default_rng(args.seed)
    steps = train(params, lambda seq: target_loss(model, seq, cfg, args.device), data, rng, args.batch, args.seq,
                  args.target_steps, args.target_seconds, peak_lr=2e-3, name="target")

    for p in params.values():
        p.requires_grad_(False)
    mtp, mtp_params = trainable_mtp(model, init_mtp, cfg, args.device)
    mtp_steps = train(mtp_params, lambda seq: mtp_loss(model, mtp, seq, cfg, args.device), data, rng, args.batch,
                      args.seq, args.mtp_steps, args.mtp_seconds, peak_lr=2e-3, name="mtp")

    save = lambda ps: {n: p.detach().float().cpu().numpy() for n, p in ps.items()}  # noqa: E731
    write_model_gguf(out / "demo.gguf", cfg, seed=args.seed, tokenizer=(tokens, merges), tensors=save(params),
                     expert_types=(Q4_K,) * 3)
    write_mtp_gguf(out / "demo-mtp.gguf", cfg, seed=args.seed + 1, tensors=save(mtp_params))
    init.unlink()
    init_mtp.unlink()
    print(f"wrote {out / 'demo.gguf'} ({(out / 'demo.gguf').stat().st_size / 1e6:.1f} MB) and "
          f"{out / 'demo-mtp.gguf'} ({(out / 'demo-mtp.gguf').stat().st_size / 1e6:.1f} MB); "
          f"target steps {steps}, mtp steps {mtp_steps}, batch {args.batch}, seq {args.seq}, "
          f"{time.time() - t0:.0f}s", flush=True)
    return 0


def trainable_mtp(model: Transformer, init_path: Path, cfg, device) -> tuple[MTPHead, dict]:
    """An MTP head initialised from the seeded random GGUF at `init_path`, its parameters trainable."""
    _, weights = load_mtp(init_path, cfg)
    named = Named(weights)
    mtp = MTPHead(model, named)
    params = named.trainable(mtp)
    mtp.to(device)
    for p in params.values():
        p.requires_grad_(True)
    return mtp, params


def train_mtp_stage2(args, out: Path, texts: list[str]) -> int:
    """Train the MTP head against a finished target: the loss is the cross-entropy to the target's own
    distribution of the token after next (what acceptance measures), not to the data."""
    from ds4trt.tokenizer import Tokenizer
    gguf_file, cfg, weights = load_target(args.target_gguf)
    tok = Tokenizer.from_gguf(gguf_file)
    data = encode_corpus(tok.tokens, [m for m in gguf_file.metadata["tokenizer.ggml.merges"].value], texts)
    model = Transformer(cfg, weights, numerics="ds4").to(args.device)
    init_mtp = out / "init-mtp.gguf"
    write_mtp_gguf(init_mtp, cfg, seed=args.seed + 1)
    mtp, params = trainable_mtp(model, init_mtp, cfg, args.device)
    rng = np.random.default_rng(args.seed + 2)
    steps = train(params, lambda seq: mtp_distill_loss(model, mtp, seq, cfg, args.device), data, rng, args.batch,
                  args.seq, args.mtp_steps, args.mtp_seconds, peak_lr=2e-3, name="mtp")
    write_mtp_gguf(out / "demo-mtp.gguf", cfg, seed=args.seed + 1,
                   tensors={n: p.detach().float().cpu().numpy() for n, p in params.items()})
    init_mtp.unlink()
    print(f"wrote {out / 'demo-mtp.gguf'}: stage 2 against {args.target_gguf}, mtp steps {steps}", flush=True)
    return 0


def mtp_distill_loss(model: Transformer, mtp: MTPHead, seq: np.ndarray, cfg, device) -> torch.Tensor:
    """MTP row i (h_i + embedding of x_{i+1}) against the target's distribution after x_{i+1} (row i+1)."""
    n = len(seq) - 2
    x = torch.as_tensor(seq[:n + 1], device=device)
    start = torch.zeros((), dtype=torch.int64, device=device)
    with torch.no_grad():
        target_logits, hc, _ = model(x, start, fresh_caches(cfg, n + 1, device))      # [n+1, V], [n+1, S, D]
        probs = torch.softmax(target_logits[1:], dim=-1)
    logits, _, _ = mtp(x[1:], hc[:-1], start, fresh_caches(cfg, n, device, ratios=[0]))
    return F.cross_entropy(logits, probs)


def target_loss(model: Transformer, seq: np.ndarray, cfg, device) -> torch.Tensor:
    n = len(seq) - 2
    x = torch.as_tensor(seq[:n], device=device)
    y = torch.as_tensor(seq[1:n + 1], device=device)
    logits, _, _ = model(x, torch.zeros((), dtype=torch.int64, device=device), fresh_caches(cfg, n, device))
    return F.cross_entropy(logits, y)


def mtp_loss(model: Transformer, mtp: MTPHead, seq: np.ndarray, cfg, device) -> torch.Tensor:
    """h_i (target, frozen) + embedding of x_{i+1} -> x_{i+2}."""
    n = len(seq) - 2
    x = torch.as_tensor(seq[:n], device=device)
    start = torch.zeros((), dtype=torch.int64, device=device)
    with torch.no_grad():
        hc = model.step(x, start, fresh_caches(cfg, n, device)).hc                # [n, S, D]
    nxt = torch.as_tensor(seq[1:n + 1], device=device)
    y = torch.as_tensor(seq[2:n + 2], device=device)
    logits, _, _ = mtp(nxt, hc, start, fresh_caches(cfg, n, device, ratios=[0]))
    return F.cross_entropy(logits, y)


def train(params, loss_fn, data, rng, batch: int, seq_len: int, steps: int, seconds: float, peak_lr: float,
          name: str) -> int:
    """AdamW with warmup + cosine decay over `steps` (0: fit the count to `seconds`, timed on steps 1..10)."""
    opt = torch.optim.AdamW(params.values(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
    total_steps = steps or 10 ** 9
    t0, t1, avg, step = time.time(), None, None, 0
    while step < total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, peak_lr)      # warmup (100 steps) does not depend on the total
        total = 0.0
        for seq in windows(data, batch, seq_len, rng):
            loss = loss_fn(seq) / batch
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 1:
            t1 = time.time()
        if step == 11 and not steps:
            per_step = (time.time() - t1) / 10
            total_steps = max(11, int((seconds - (t1 - t0)) / per_step))
            print(f"{name}: {per_step * 1000:.0f} ms/step -> {total_steps} steps "
                  f"(rerun with --{name}-steps {total_steps} to reproduce)", flush=True)
        avg = total if avg is None else 0.98 * avg + 0.02 * total
        if step % 50 == 1 or step == total_steps:
            print(f"{name} step {step:5d} loss {total:.3f} (avg {avg:.3f}) {time.time() - t0:.0f}s", flush=True)
    return step


if __name__ == "__main__":
    sys.exit(main())
