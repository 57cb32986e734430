"""Engine (model + tokenizer, opened from GGUF files) and Session (one conversation's caches).

    engine = Engine.open("model.gguf", mtp_path="mtp.gguf")
    s = engine.session(ctx=4096)
    s.warm_up(n_draft=2)                    # a CUDA-graph backend captures its step graphs now
    logits = s.prefill(ids)                 # [V]
    tok = s.argmax()
    logits = s.eval(tok)                    # one-token decode
    s.rewind(10)                            # back to 10 committed tokens
    got = s.eval_speculative_argmax(tok, max_tokens=64, eos=engine.tokenizer.eos_id)
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds4trt.errors import Ds4Error
from ds4trt.model.mtp import MTPHead
from ds4trt.model.transformer import Transformer
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.runtime import speculative
from ds4trt.runtime.cache import CacheState
from ds4trt.runtime.profile import PHASES
from ds4trt.runtime.steps import Steps
from ds4trt.tokenizer import Tokenizer

PREFILL_CHUNK = 256


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, mtp: MTPHead | None = None,
                 source: str = "", dtype: torch.dtype = torch.float32, device: str = "cpu", steps=Steps,
                 prefill_chunk: int = PREFILL_CHUNK):
        """`model` and `mtp` are any backend's callables with the signatures of Transformer.forward and
        MTPHead.forward (PyTorch modules here; ONNX Runtime / TensorRT graph runners elsewhere).
        `steps(model, cache)` binds one of them to a session's cache (runtime/steps.py; CUDA graphs:
        backends/cuda.py)."""
        self.model, self.tokenizer, self.mtp, self.source = model, tokenizer, mtp, source
        self.dtype, self.device = dtype, torch.device(device)
        self.bind_steps = steps
        self.prefill_chunk = prefill_chunk       # tokens per prefill step (Session.prefill's default)
        self.cfg = model.cfg

    @classmethod
    def open(cls, gguf_path: str | Path, mtp_path: str | Path | None = None, numerics: str = "ds4",
             dtype: torch.dtype = torch.float32, device: str = "cpu") -> "Engine":
        """The PyTorch reference: every weight dequantized to `dtype` (CPU; any torch device). On a GPU,
        backends/cuda.py's open_engine keeps the GGUF blocks and runs the kernels."""
        gguf_file, cfg, weights = load_target(gguf_path)
        tokenizer = Tokenizer.from_gguf(gguf_file)
        model = Transformer(cfg, weights, numerics).to(device=device, dtype=dtype)
        mtp = None
        if mtp_path is not None:
            _, mtp_weights = load_mtp(mtp_path, cfg)
            mtp = MTPHead(model, mtp_weights).to(device=device, dtype=dtype)
        return cls(model, tokenizer, mtp, str(gguf_path), dtype, device)

    def session(self, ctx: int = 4096) -> "Session":
        return Session(self, ctx)


class Session:
    """Committed tokens and the caches that hold exactly them; the target logits after the last one."""

    def __init__(self, engine: Engine, ctx: int):
        self.engine, self.ctx = engine, ctx
        self.model = engine.model
        self.dtype, self.device = engine.dtype, engine.device
        self.cache = CacheState(engine.cfg, ctx, dtype=self.dtype, device=self.device)
        self.target = engine.bind_steps(self.model, self.cache)
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None      # [V] after the last committed token
        self.drafter = speculative.MTPDrafter(engine.mtp, ctx, self.dtype, self.device, engine.bind_steps) \
            if engine.mtp else None
        self.stats = speculative.SpecStats()

    @property
    def pos(self) -> int:
        return self.cache.pos

    # ---- the target model: propose, then commit ----
    def target_step(self, tokens: list[int], all_logits: bool = True, graph: bool = True):
        """Run the target on `tokens` after the committed ones. Nothing is written. graph=False: a shape seen
        once (a CUDA-graph backend runs it eagerly rather than capture it).
        returns logits [T, V] (or [1, V] for the last row only), final HC [T, S, D], proposed rows"""
        if self.pos + len(tokens) > self.ctx:
            raise Ds4Error(f"context full: {self.pos} + {len(tokens)} tokens exceed --ctx {self.ctx}")
        with torch.no_grad():
            return self.target.run(tokens, last_only=not all_logits, graph=graph)

    def commit(self, tokens: list[int], hc: torch.Tensor, rows, logits_row: torch.Tensor, n: int) -> None:
        """Keep the first n of `tokens` (their rows are `rows`); `logits_row` [V] follows token n-1."""
        self.target.commit(rows, n)
        self._committed(tokens[:n], hc[:n], logits_row)

    def _committed(self, tokens: list[int], hc: torch.Tensor, logits_row: torch.Tensor) -> None:
        """Record tokens whose rows the caches now hold (hc [n, S, D] theirs, logits_row [V] after the last)."""
        self.tokens.extend(tokens)
        self.logits = logits_row
        if self.drafter is not None:
            self.drafter.observe(hc)

    # ---- public API ----
    def prefill(self, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
        """Commit `tokens` in chunks (of the engine's prefill_chunk by default); returns the logits after the
        last one [V]."""
        chunk = chunk or self.engine.prefill_chunk
        if self.pos + len(tokens) > self.ctx:
            raise Ds4Error(f"prompt of {len(tokens)} tokens does not fit in --ctx {self.ctx}"
                           + (f" after {self.pos} tokens" if self.pos else ""))
        for i in range(0, len(tokens), chunk):
            part = tokens[i:i + chunk]
            with PHASES.phase("prefill"), torch.no_grad():
                logits, hc = self.target.prefill(part)           # run and commit (one graph for a whole chunk)
                self._committed(part, hc, logits[-1])
                if self.drafter is not None:      # feed the drafter every pair whose next token is known
                    self.drafter.catch_up(self.tokens, graph=False)
        return self.logits

    def eval(self, token: int) -> torch.Tensor:
        """Decode one token; returns the logits after it [V]."""
        with PHASES.phase("decode"):
            logits, hc, rows = self.target_step([token])
            self.commit([token], hc, rows, logits[0], 1)
        return self.logits

    def warm_up(self, n_draft: int = 0, first: int = 0, end: int | None = None) -> int:
        """Capture now every step shape decoding replays (a CUDA-graph backend; the eager ones have nothing to do):
        the one-token step and, with the MTP head and up to n_draft drafts per cycle, the verify steps of 2..n_draft+1
        tokens and the drafter's steps, each with and without the indexer where decoding from position `first` up to
        `end` tokens (default: the context) can need both. Without it each shape compiles and captures on its first
        use, mid-stream. Returns the graphs captured."""
        drafts = n_draft if self.drafter is not None else 0
        with torch.no_grad():
            n = sum(self.target.prepare(T, False, first=first, end=end) for T in range(1, drafts + 2))
            return n + (self.drafter.prepare(drafts) if drafts else 0)

    def argmax(self) -> int:
        return int(torch.argmax(self.logits))

    def rewind(self, pos: int) -> None:
        """Go back to `pos` committed tokens (replays the kept prefix: compressor state is not positional
        far back, so recomputing is the exact way)."""
        if not 0 <= pos <= self.pos:
            raise Ds4Error(f"cannot rewind to position {pos}: the session holds {self.pos} tokens")
        kept = self.tokens[:pos]
        self.cache.reset()
        self.tokens, self.logits = [], None
        if self.drafter is not None:
            self.drafter.reset()
        if kept:
            self.prefill(kept)

    def eval_speculative_argmax(self, first_token: int, max_tokens: int, eos: int | None,
                                n_draft: int = 2, margin: float = 3.0, drafter=None, log=None) -> list[int]:
        """One draft -> verify -> commit cycle (runtime/speculative.py). Returns the committed tokens,
        first_token first; afterwards argmax(self.logits) is the next token."""
        return speculative.speculative_step(self, drafter or self.drafter, first_token, max_tokens, eos,
                                            n_draft, margin, log)
