"""Evaluate the bundled demo model on held-out Python standard-library files.

    python scripts/eval_demo.py [--corpus DIR] [--prompts 12] [--draft 3] [--margin 0]

Held-out files: every 50th .py file of the corpus sorted by path (the split scripts/train_demo.py trains
without). Prints the perplexity of both numerics modes on up to --ppl-tokens tokens, then greedy
generation with and without MTP speculative decoding from the first --prompt-tokens tokens of
--prompts held-out files: acceptance per draft position, mean tokens per target pass, and the wall-time
speedup over plain greedy (this reference backend, on this machine), checking the outputs are identical.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo import corpus_files, read_text  # noqa: E402

from ds4trt.runtime.session import Engine  # noqa: E402
from ds4trt.runtime.speculative import SpecStats  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"


def perplexity(engine: Engine, ids: list[list[int]], chunk: int) -> float:
    nll, n = 0.0, 0
    for seq in ids:
        s = engine.session(chunk)
        logits, _, _ = s.target_step(seq[:chunk])
        tgt = torch.tensor(seq[1:chunk])
        nll += torch.nn.functional.cross_entropy(logits[:-1].double(), tgt, reduction="sum").item()
        n += len(tgt)
    return math.exp(nll / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(MODELS / "demo.gguf"))
    ap.add_argument("--mtp", default=str(MODELS / "demo-mtp.gguf"))
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=512, help="tokens per held-out file for perplexity")
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--margin", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    _, held = corpus_files(Path(args.corpus))
    texts = [t for t in read_text(held) if len(t) > 2000]
    engines = {m: Engine.open(args.gguf, args.mtp, numerics=m) for m in ("ds4", "float")}
    tok = engines["ds4"].tokenizer
    ids = [tok.encode(t) for t in texts]
    print(f"held-out: {len(texts)} files from {args.corpus}")
    for mode, engine in engines.items():
        print(f"perplexity ({mode} numerics, {args.ppl_tokens} tokens x {len(ids)} files): "
              f"{perplexity(engine, ids, args.ppl_tokens):.2f}")

    engine = engines["ds4"]
    stats, t_plain, t_spec, n_tok = SpecStats(), 0.0, 0.0, 0
    for seq in ids[:args.prompts]:
        prompt = seq[:args.prompt_tokens]
        s = engine.session(len(prompt) + args.new_tokens + 1)
        s.prefill(prompt)
        t0 = time.perf_counter()
        plain = []
        while len(plain) < args.new_tokens:
            plain.append(s.argmax())
            s.eval(plain[-1])
        t_plain += time.perf_counter() - t0

        s = engine.session(len(prompt) + args.new_tokens + 1)
        s.stats = stats
        s.prefill(prompt)
        t0 = time.perf_counter()
        spec = []
        while len(spec) < args.new_tokens:
            spec += s.eval_speculative_argmax(s.argmax(), args.new_tokens - len(spec), None, args.draft, args.margin)
        t_spec += time.perf_counter() - t0
        n_tok += len(spec)
        if spec != plain:
            print("MISMATCH: speculative output differs from plain greedy", file=sys.stderr)
            return 1
    print(f"greedy {args.new_tokens} tokens from {args.prompts} held-out prompts ({args.prompt_tokens} tokens), "
          f"draft {args.draft}, margin {args.margin}: speculative output identical to plain greedy")
    print(stats.report())
    print(f"wall time: plain {t_plain:.2f}s, speculative {t_spec:.2f}s, speedup {t_plain / t_spec:.2f}x "
          f"(PyTorch reference backend on {torch.get_num_threads()} CPU thread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
