"""Greedy MTP speculative decoding: draft -> verify -> accept -> commit, in `speculative_step`.

From the committed state (n tokens in every cache, `first_token` = the target's next greedy token):
  1. draft   the MTP head proposes up to N tokens, stopping early when its top-1 minus top-2 logit gap
             falls below the margin (the drafter's own confidence; ds4's --mtp-margin);
  2. verify  ONE batched target pass over [first_token, d_1, ..., d_k] at positions n..n+k;
  3. accept  the longest prefix with d_i == target argmax after d_{i-1} (argmax after first_token for d_1);
  4. commit  first_token and the accepted drafts to every cache; the other rows are never written.
The target's argmax after the last kept token (the correction at the first mismatch, or the bonus token
after a full accept) is the next call's first_token. The output is therefore exactly plain greedy
decoding of the target, whatever the drafter proposes.

The MTP drafter's own ring only ever receives rows built from committed target states (pairs
(h_i, x_{i+1}), model/mtp.py); recursive drafts run on a scratch copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds4trt.model.mtp import MTPHead
from ds4trt.runtime.cache import CacheState
from ds4trt.runtime.profile import PHASES
from ds4trt.runtime.steps import Steps


@dataclass
class SpecStats:
    passes: int = 0                                     # target passes made by speculative steps
    tokens: int = 0                                     # tokens they committed
    drafted: list[int] = field(default_factory=list)    # [k]: cycles that drafted a (k+1)-th token
    accepted: list[int] = field(default_factory=list)   # [k]: cycles whose (k+1)-th draft was accepted

    def record(self, n_drafted: int, n_accepted: int, n_kept: int) -> None:
        self.passes += 1
        self.tokens += n_kept
        while len(self.drafted) < n_drafted:
            self.drafted.append(0)
            self.accepted.append(0)
        for k in range(n_drafted):
            self.drafted[k] += 1
            self.accepted[k] += k < n_accepted

    def report(self) -> str:
        if not self.passes:
            return "mtp: no speculative steps"
        rates = " ".join(f"d{k + 1}={a / d:.0%}({a}/{d})" for k, (a, d) in enumerate(zip(self.accepted, self.drafted)))
        return (f"mtp: {self.tokens} tokens in {self.passes} target passes "
                f"({self.tokens / self.passes:.2f} tokens/pass); acceptance {rates or '(nothing drafted)'}")


class MTPDrafter:
    """Drafts with the MTP head. Keeps the target HC states it has not consumed yet."""

    def __init__(self, mtp: MTPHead, ctx: int, dtype: torch.dtype, device: torch.device = torch.device("cpu"),
                 steps=Steps):
        self.mtp = mtp
        self.cache = CacheState(mtp.cfg, ctx, ratios=[0], dtype=dtype, device=device)
        self.scratch = CacheState(mtp.cfg, ctx, ratios=[0], dtype=dtype, device=device)   # recursive drafts
        self.head, self.scratch_head = steps(mtp, self.cache), steps(mtp, self.scratch)
        self.reset()

    def reset(self) -> None:
        self.cache.reset()
        self.pending_hc = None                          # [U, S, D]: h_i for i = cache.pos .. cache.pos+U-1

    def observe(self, hc: torch.Tensor) -> None:
        """hc: [n, S, D] final target states of newly committed tokens."""
        self.pending_hc = hc if self.pending_hc is None else torch.cat([self.pending_hc, hc])

    def prepare(self, n_draft: int) -> int:
        """Capture the head's steps of up to n_draft drafts per cycle now (runtime/steps.py prepare): catch-up of the
        1..n_draft+1 pairs a cycle commits, and the recursive one-token drafts. Returns the graphs captured."""
        S, D, raw = self.mtp.cfg.n_hc, self.mtp.cfg.n_embd, self.cache.layers[0].raw     # the caches' dtype, device
        h = lambda T: torch.zeros(T, S, D, dtype=raw.dtype, device=raw.device)  # noqa: E731
        n = sum(self.head.prepare(T, True, h(T)) for T in range(1, n_draft + 2))
        return n + (self.scratch_head.prepare(1, False, h(1)) if n_draft > 1 else 0)

    @torch.no_grad()
    def catch_up(self, tokens: list[int], graph: bool = True) -> torch.Tensor | None:
        """Run (and commit) the head on every pending pair (h_i, tokens[i+1]); returns the logits [V] and
        output HC state [1, S, D] of the last pair, or None if no pair was ready. graph=False after a prefill
        chunk (runtime/steps.py)."""
        i0 = self.cache.pos
        n = 0 if self.pending_hc is None else min(len(self.pending_hc), len(tokens) - 1 - i0)
        if n <= 0:
            return None
        logits, hc, rows = self.head.run(tokens[i0 + 1:i0 + 1 + n], self.pending_hc[:n], last_only=True,
                                         graph=graph)
        self.head.commit(rows, n)
        self.pending_hc = self.pending_hc[n:]
        return logits[0], hc[-1:]

    @torch.no_grad()
    def draft(self, tokens: list[int], first_token: int, n: int, margin: float, eos: int | None):
        """Up to n drafts for the tokens after `first_token`: [(token, top1 - top2 logit gap)]."""
        ready = self.catch_up(tokens + [first_token])
        if ready is None or self.cache.pos != len(tokens):
            return []
        logits, hc = ready
        drafts, copied = [], False
        while True:
            top = torch.topk(logits, 2)
            # the top-1 minus top-2 gap (in the logits' float32) and the token in one host read: float64 holds both
            gap, tok = torch.stack([(top.values[0] - top.values[1]).double(), top.indices[0].double()]).tolist()
            tok = int(tok)
            if gap < margin:
                break
            drafts.append((tok, gap))
            if len(drafts) == n or tok == eos:
                break
            if not copied:
                self.scratch.copy_from(self.cache)
                copied = True
            logits, hc, rows = self.scratch_head.run([tok], hc)
            self.scratch_head.commit(rows, 1)
            logits = logits[0]
        return drafts


def speculative_step(session, drafter, first_token: int, max_tokens: int, eos: int | None, n_draft: int,
                     margin: float, log=None) -> list[int]:
    """One cycle; returns the committed tokens (first_token first). session: runtime/session.py."""
    room = min(n_draft, max_tokens - 1, session.ctx - session.pos - 1)
    drafts = []
    if drafter is not None and room > 0 and first_token != eos:
        with PHASES.phase("draft"):
            drafts = drafter.draft(session.tokens, first_token, room, margin, eos)[:room]

    # verify: one batched target pass over the pending token and every draft
    seq = [first_token] + [t for t, _ in drafts]
    with PHASES.phase("verify"):
        logits, hc, rows = session.target_step(seq)                 # logits: [1+k, V]

    # accept the longest prefix of drafts that match the target's own greedy choice
    with PHASES.phase("accept"):
        target_next = logits.argmax(-1).tolist()
        n_ok = 0
        while n_ok < len(drafts) and drafts[n_ok][0] == target_next[n_ok]:
            n_ok += 1
        keep = 1 + n_ok
        if eos is not None and eos in seq[:keep]:
            keep = seq.index(eos) + 1
            n_ok = keep - 1                                         # drafts past the EOS are not committed

    # commit the kept rows; the rest are dropped
    with PHASES.phase("commit"):
        session.commit(seq, hc, rows, logits[keep - 1], keep)
    session.stats.record(len(drafts), n_ok, keep)
    if log is not None:
        log(f"mtp pos={session.pos - keep} drafted={[t for t, _ in drafts]} "
            f"margins={[round(g, 2) for _, g in drafts]} target={target_next} accepted={n_ok}")
    return seq[:keep]
