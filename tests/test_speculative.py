"""MTP head and greedy speculative decoding (runtime/speculative.py, model/mtp.py).

The contract under test: `Session.eval_speculative_argmax` produces exactly the plain greedy stream of the
target (prefill + repeated `eval(argmax)`), whatever the drafter proposes; the target caches hold exactly
what sequential decoding of the committed tokens holds; the MTP ring only ever holds rows of committed
pairs (h_i, x_{i+1}) (DeepSeek pairing, model/mtp.py).

Numerics: the engines run in float64, so a batched verify pass and T = 1 decode steps agree to ~1e-15 and
cannot flip a near-tie of the argmax; one float32 smoke test runs the default dtype.

Drafters used here (all with MTPDrafter's `draft(tokens, first_token, n, margin, eos)` signature):
  ScriptedDrafter   knows the plain greedy stream; drafts it (oracle) or corrupts draft j ("wrong at j")
  SteeredDrafter    the real MTPDrafter code (catch-up, ring, scratch ring, recursion) with the head's last
                    logits row steered so its k-th draft is a chosen token with a chosen top1-top2 gap
  the session's own MTPDrafter (random tiny weights: it almost never agrees with the target)

Per-cycle cache checks compare against `SeqRef`: one sequential session per prompt (prefill, then
`eval` one token at a time) with snapshots of its caches at every position, and an MTP ring built by
T = 1 head steps on the true pairs, snapshotted at every ring position.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from ds4trt.model.mtp import MTPHead
from ds4trt.model.weights import load_mtp
from ds4trt.model.state import LayerRows
from ds4trt.runtime.cache import CacheState
from ds4trt.runtime.session import PREFILL_CHUNK, Engine
from ds4trt.runtime.speculative import MTPDrafter
from ds4trt.runtime.steps import Steps
from ds4trt.testing.tiny_gguf import tiny_config, write_model_gguf, write_mtp_gguf
from tiny_engines import greedy

torch.set_num_threads(1)

CTX = 256
TOL = 1e-12          # float64: batched verify vs sequential T = 1 decode
MAX_N = 4            # largest draft length tested (oracle look-ahead)


# ---------------------------------------------------------------------------------------------------
# Sequential references

def _clone(d: dict) -> dict:
    return {k: v.clone() for k, v in d.items()}


class HCRecorder:
    """Stands in for a sequential session's drafter: records the final target HC state of every committed
    token (Session.commit -> observe), so a reference MTP ring can be built from the true pairs."""

    def __init__(self):
        self.hc: list[torch.Tensor] = []

    def observe(self, hc):
        self.hc.extend(hc)

    def catch_up(self, tokens, graph=True):
        return None

    def reset(self):
        self.hc = []


def sequential_session(model: "Model", prompt, ctx: int = CTX):
    s = model.engine.session(ctx)
    s.drafter = HCRecorder()
    s.prefill(list(prompt))
    return s


def ring_reference(model: "Model") -> MTPDrafter:
    return MTPDrafter(model.engine.mtp, CTX, torch.float64)


def advance_ring(ref: MTPDrafter, hcs: list[torch.Tensor], tokens: list[int], pos: int) -> None:
    """Run the MTP head on the true pairs (h_i, x_{i+1}) one at a time (T = 1) until ref.cache.pos == pos."""
    while ref.cache.pos < pos:
        i = ref.cache.pos
        ref.observe(hcs[i][None])
        assert ref.catch_up(tokens[:i + 2]) is not None
        assert ref.pending_hc is not None and len(ref.pending_hc) == 0
    assert ref.cache.pos == pos


class SeqRef:
    """Sequential decoding of prompt + its greedy continuation (n tokens): target cache snapshots (live
    rows, whole buffers, logits) at every position p >= len(prompt), the HC state of every token, and
    T = 1 MTP ring snapshots at every ring position q >= len(prompt) - 1."""

    def __init__(self, model: "Model", prompt: list[int], n: int):
        self.n = n
        stream = model.greedy(prompt, n + 1)
        s = sequential_session(model, prompt)
        self.tokens = list(prompt) + stream
        self.target = {}

        def snap():
            self.target[s.pos] = (_clone(s.cache.live_tensors()), _clone(s.cache.tensors()), s.logits.clone())
        snap()
        for i, t in enumerate(stream[:n]):
            assert s.argmax() == t
            s.eval(t)
            snap()
        self.hc = s.drafter.hc
        assert len(self.hc) == len(prompt) + n
        ring, self.ring = ring_reference(model), {}
        for q in range(max(0, len(prompt) - 1), len(prompt) + n):
            advance_ring(ring, self.hc, self.tokens, q)
            self.ring[q] = (_clone(ring.cache.live_tensors()), _clone(ring.cache.tensors()))

    def check(self, s, ring: bool = True) -> None:
        """The speculative session `s` against the sequential state with the same committed tokens."""
        p = s.pos
        assert s.tokens == self.tokens[:p]
        live, whole, logits = self.target[p]
        assert_tensors_close(s.cache.live_tensors(), live, f"target live @{p}")
        # the write-on-commit design: rejected rows are never stored, so even the whole buffers agree
        assert_tensors_close(s.cache.tensors(), whole, f"target whole @{p}")
        assert (s.logits - logits).abs().max().item() <= 1e-10
        assert s.argmax() == int(logits.argmax())
        if ring:
            dr = s.drafter
            q = dr.cache.pos
            assert q in self.ring, (q, p)
            assert_tensors_close(dr.cache.live_tensors(), self.ring[q][0], f"ring live @{q}")
            assert_tensors_close(dr.cache.tensors(), self.ring[q][1], f"ring whole @{q}")
            # the HC states it has not consumed yet are those of the committed tokens after its ring
            assert dr.pending_hc is not None and len(dr.pending_hc) == p - q
            if p > q:
                assert (dr.pending_hc - torch.stack(self.hc[q:p])).abs().max().item() <= TOL


def assert_tensors_close(got: dict, want: dict, what: str, tol: float = TOL):
    assert got.keys() == want.keys(), what
    for k in got:
        assert got[k].shape == want[k].shape, f"{what} {k}: shape {tuple(got[k].shape)} != {tuple(want[k].shape)}"
        if got[k].numel():
            d = (got[k] - want[k]).abs().max().item()
            assert d <= tol, f"{what} {k}: max abs diff {d:.3g}"


# ---------------------------------------------------------------------------------------------------
# Engines (one per config, module scoped) with cached greedy streams and sequential references

class Model:
    def __init__(self, name: str, engine: Engine):
        self.name, self.engine, self.cfg = name, engine, engine.cfg
        self._greedy: dict[tuple[int, ...], list[int]] = {}
        self._ref: dict[tuple[int, ...], SeqRef] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The first n tokens of plain greedy decoding after `prompt` (prefill + repeated eval(argmax))."""
        key = tuple(prompt)
        have = self._greedy.get(key, [])
        if len(have) < n:
            have = self._greedy[key] = greedy(self.engine, n, prompt, CTX, PREFILL_CHUNK)
        return have[:n]

    def seqref(self, prompt: list[int], n: int) -> SeqRef:
        key = tuple(prompt)
        if key not in self._ref or self._ref[key].n < n:
            self._ref[key] = SeqRef(self, list(prompt), n)
        return self._ref[key]


def _open(path, mtp_path, dtype=torch.float64) -> Engine:
    return Engine.open(path, mtp_path=mtp_path, dtype=dtype)


@pytest.fixture(scope="module")
def m4(tiny_gguf, tiny_mtp_gguf):
    """The default tiny config: layers 0,1 sliding (window 8), ratio 4 + indexer, ratio 8."""
    return Model("r4r8", _open(tiny_gguf, tiny_mtp_gguf))


@pytest.fixture(scope="module")
def m128(tmp_path_factory):
    """A config with a ratio-128 layer: prompts of ~110-130 tokens make decoding cross position 127."""
    cfg = tiny_config(compress_ratios=(0, 0, 4, 128))
    d = tmp_path_factory.mktemp("spec128")
    write_model_gguf(d / "t.gguf", cfg)
    write_mtp_gguf(d / "t-mtp.gguf", cfg)
    return Model("r128", _open(d / "t.gguf", d / "t-mtp.gguf"))


@pytest.fixture(scope="module", params=["r4r8", "r128"])
def model(request):
    return request.getfixturevalue({"r4r8": "m4", "r128": "m128"}[request.param])


def prompts_for(model: Model, count: int, seed: int, gen=(12, 20), r128_lengths=(108, 130)):
    """(prompt, generation length) pairs of random token ids, seeded. r4r8: lengths 1..12 (the window-8
    fill, the first ratio-4/8 boundaries) alternating with 13..40; r128: lengths in `r128_lengths`, so that
    the generated tokens straddle position 127 (the first ratio-128 emission)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if model.name == "r128":
            n = rng.randint(*r128_lengths)
        else:
            n = rng.randint(1, 12) if i % 2 == 0 else rng.randint(13, 40)
        out.append(([rng.randrange(model.cfg.n_vocab) for _ in range(n)], rng.randint(*gen)))
    return out


# ---------------------------------------------------------------------------------------------------
# Drivers and drafters

def run_spec(model: Model, prompt, gen: int, n_draft: int, margin: float, eos=None, drafter=None, log=None,
             session=None, on_cycle=None, ctx: int = CTX):
    """Speculative decoding of `gen` tokens (or through eos) after `prompt` (or continuing `session`).
    Returns (tokens, session)."""
    s = session or model.engine.session(ctx)
    if session is None:
        s.prefill(list(prompt))
    base = s.pos
    tok, out = s.argmax(), []
    while len(out) < gen:
        before = s.pos
        got = s.eval_speculative_argmax(tok, gen - len(out), eos, n_draft=n_draft, margin=margin, drafter=drafter,
                                        log=log)
        assert got and got[0] == tok
        assert len(got) <= 1 + max(0, min(n_draft, gen - len(out) - 1, s.ctx - before - 1))
        assert s.pos == before + len(got) and s.tokens[before:] == got
        out += got
        if on_cycle is not None:
            on_cycle(s, got)
        if eos is not None and eos in got:
            assert got[-1] == eos
            break
        tok = s.argmax()
    assert s.tokens[base:] == out
    return out, s


class ScriptedDrafter:
    """Drafts from the plain greedy stream `ref` (prompt + continuation): draft k (0-based) is the target's
    own token, except at indices in `wrong` (a token the target does not pick). Records its calls."""

    def __init__(self, ref: list[int], vocab: int, wrong=(), gap: float = 10.0, stop_at_eos: bool = True):
        self.ref, self.vocab, self.wrong, self.gap, self.stop_at_eos = ref, vocab, set(wrong), gap, stop_at_eos
        self.calls: list[tuple[int, int, list[int]]] = []     # (position, n asked, drafted tokens)

    def draft(self, tokens, first_token, n, margin, eos):
        p = len(tokens)
        assert tokens == self.ref[:p] and first_token == self.ref[p], "drafter called off the greedy stream"
        drafts = []
        for k in range(n):
            t = self.ref[p + 1 + k]
            if k in self.wrong:
                t = (t + 1) % self.vocab
            if self.gap < margin:
                break
            drafts.append((t, self.gap))
            if self.stop_at_eos and t == eos:
                break
        self.calls.append((p, n, [t for t, _ in drafts]))
        return drafts


def wrong_set(wrong_at):
    return () if wrong_at is None else (wrong_at,)


class _SteeredHead:
    """Wraps an MTPHead (the drafter calls it as `mtp(tokens, h, start, caches, last_only)` -> (logits, hc,
    rows)); the k-th call of a draft returns the real logits with the last row changed so that plan[k] =
    (token, gap) is the top-1 with that top1-top2 gap (plan[k] None: the real logits). The step itself
    (hc, ring rows) is untouched."""

    def __init__(self, mtp: MTPHead):
        self.mtp, self.cfg, self.plan, self.calls = mtp, mtp.cfg, [], 0

    def __call__(self, tokens, h, start, caches, last_only: bool = False, indexer: bool = True):
        logits, hc, rows = self.mtp(tokens, h, start, caches, last_only=last_only, indexer=indexer)
        k, self.calls = self.calls, self.calls + 1
        if k < len(self.plan) and self.plan[k] is not None:
            tok, gap = self.plan[k]
            logits = logits.clone()
            others = logits[-1].clone()
            others[tok] = -math.inf
            logits[-1, tok] = others.max() + gap
        return logits, hc, rows


class SteeredDrafter(MTPDrafter):
    """The real MTPDrafter (its ring, catch-up, scratch and recursion) with steered draft tokens.
    plan_fn(tokens, first_token, n) -> a list of (token, gap) or None per draft index."""

    def __init__(self, mtp: MTPHead, plan_fn):
        super().__init__(_SteeredHead(mtp), CTX, torch.float64)
        self.plan_fn = plan_fn
        self.returned: list[list[tuple[int, float]]] = []

    def draft(self, tokens, first_token, n, margin, eos):
        self.mtp.plan, self.mtp.calls = self.plan_fn(tokens, first_token, n), 0
        out = super().draft(tokens, first_token, n, margin, eos)
        self.returned.append(out)
        return out


def oracle_plan(ref: list[int], vocab: int, wrong=(), gap: float = 10.0):
    def plan(tokens, first_token, n):
        p = len(tokens)
        assert tokens == ref[:p] and first_token == ref[p]
        return [(((ref[p + 1 + k] + 1) % vocab) if k in wrong else ref[p + 1 + k], gap) for k in range(n)]
    return plan


def predict(gen: int, n: int, wrong_at: int | None):
    """The accept pattern's prediction, per cycle: (drafted, accepted, committed)."""
    cycles, done = [], 0
    while done < gen:
        room = min(n, gen - done - 1)
        ok = room if wrong_at is None or wrong_at >= room else wrong_at
        cycles.append((room, ok, ok + 1))
        done += ok + 1
    return cycles


def check_stats(s, cycles):
    assert s.stats.passes == len(cycles)
    assert s.stats.tokens == sum(c[2] for c in cycles)
    width = max([c[0] for c in cycles] + [0])
    assert s.stats.drafted == [sum(c[0] > k for c in cycles) for k in range(width)]
    assert s.stats.accepted == [sum(c[1] > k for c in cycles) for k in range(width)]


LOG_RE = re.compile(r"^mtp pos=(\d+) drafted=\[([^\]]*)\] margins=\[([^\]]*)\] target=\[([^\]]*)\] accepted=(\d+)$")


def parse_log(line: str) -> dict:
    m = LOG_RE.match(line)
    assert m, line
    ints = lambda x: [int(v) for v in x.split(",") if v.strip()]  # noqa: E731
    return dict(pos=int(m[1]), drafted=ints(m[2]), margins=[float(v) for v in m[3].split(",") if v.strip()],
                target=ints(m[4]), accepted=int(m[5]))


# ---------------------------------------------------------------------------------------------------
# 1. token-exact equality with plain greedy: the real MTP drafter, 50 prompts x n 1..4 x margins {0, 3}

N_PROMPTS = 25      # per config, two configs: 50 prompts


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_mtp_drafter_matches_greedy(model, n_draft):
    drafted = 0
    for prompt, gen in prompts_for(model, N_PROMPTS, seed=1, gen=(8, 12), r128_lengths=(120, 127)):
        want = model.greedy(prompt, gen)
        if model.name == "r128":
            assert len(prompt) <= 127 < len(prompt) + gen          # decoding commits position 127
        for margin in (0.0, 3.0):
            log = []
            got, s = run_spec(model, prompt, gen, n_draft, margin, log=log.append)
            assert got == want, (model.name, len(prompt), n_draft, margin)
            assert s.stats.tokens == gen and s.stats.passes == len(log) <= gen
            done = 0
            for rec in map(parse_log, log):
                k = len(rec["drafted"])
                assert k <= min(n_draft, gen - done - 1)
                if margin == 0.0:           # margin 0: every cycle drafts min(n, room) tokens
                    assert k == min(n_draft, gen - done - 1)
                assert all(g >= margin - 0.005 for g in rec["margins"])
                done += 1 + rec["accepted"]
            assert done == gen
            drafted += sum(s.stats.drafted)
    assert drafted > 0


def test_eos_stops_stream(m4, m128):
    """eos = a token of the greedy stream (not its first): plain greedy and speculative decoding (MTP, an
    oracle that stops drafting at eos, one that drafts past it) all stop right after it."""
    checked = 0
    for model in (m4, m128):
        for prompt, _ in prompts_for(model, 2, seed=2):
            ref = model.greedy(prompt, 20)
            cands = [t for i, t in enumerate(ref[2:14], 2) if t not in ref[:i]]
            assert cands
            eos = cands[len(cands) // 2]
            stop = ref.index(eos) + 1
            s = model.engine.session(CTX)
            s.prefill(prompt)
            plain = [s.argmax()]
            while plain[-1] != eos:
                s.eval(plain[-1])
                plain.append(s.argmax())
            assert plain == ref[:stop]
            full = list(prompt) + ref + [0] * MAX_N
            for n in (1, 3):
                got, s = run_spec(model, prompt, 20, n, 0.0, eos=eos)
                assert got == ref[:stop], ("mtp", n)
                for stop_at_eos in (True, False):
                    got, s = run_spec(model, prompt, 20, n, 0.0, eos=eos,
                                      drafter=ScriptedDrafter(full, model.cfg.n_vocab, stop_at_eos=stop_at_eos))
                    assert got == ref[:stop], ("oracle", n, stop_at_eos)
                    assert s.stats.tokens == stop and s.tokens[-1] == eos
                    assert s.argmax() == model.greedy(prompt, stop + 1)[stop]     # logits after eos
            checked += 1
    assert checked == 4


def test_eos_as_first_token_drafts_nothing(m4):
    prompt = [5, 6, 7, 8, 9]
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    first = s.argmax()
    d = ScriptedDrafter(prompt + m4.greedy(prompt, 10), m4.cfg.n_vocab)
    got = s.eval_speculative_argmax(first, 10, first, n_draft=4, margin=0.0, drafter=d)
    assert got == [first] and d.calls == [] and s.stats.drafted == []
    got = s.eval_speculative_argmax(s.argmax(), 1, None, n_draft=4, margin=0.0, drafter=d)   # max_tokens 1
    assert len(got) == 1 and d.calls == []


def test_start_from_empty_session(m4):
    """No prefill: the first cycle commits only first_token (no pair for the drafter yet), then drafting
    starts; the stream equals plain greedy after [first_token]."""
    s = m4.engine.session(CTX)
    assert s.eval_speculative_argmax(7, 10, None, n_draft=3, margin=0.0) == [7] and s.stats.drafted == []
    got, s = run_spec(m4, None, 9, 3, 0.0, session=s)
    assert got == m4.greedy([7], 9)
    assert s.stats.drafted[0] == s.stats.passes - 2          # all but the first and the last (room 0)


def test_warm_up_of_eager_steps_is_a_no_op(m4):
    """The eager backends have no graphs: Session.warm_up captures none and writes nothing (the CUDA backend's
    captures: tests/test_cuda_backend.py)."""
    s = m4.engine.session(CTX)
    empty = _clone(s.cache.tensors())
    assert s.warm_up(3) == 0 and s.pos == 0
    assert all(torch.equal(v, empty[k]) for k, v in s.cache.tensors().items())
    s.prefill([5, 6, 7])
    got, _ = run_spec(m4, None, 9, 3, 0.0, session=s)
    assert got == m4.greedy([5, 6, 7], 9)


def test_step_kinds_of_a_position_range(m4):
    """Steps.kinds (what a graph backend's warm-up captures): the (indexer flag, bound) pairs of steps starting at
    `first` or later and ending by `end`. The tiny config's top-k of 3 needs the indexer once a step ends past
    position 15; without min_bound every bound is the context, with min_bound 16 the powers of two 16 .. CTX."""
    steps = m4.engine.session(CTX).target
    assert steps.kinds(1) == [(False, CTX), (True, CTX)]                # the whole context
    assert steps.kinds(1, 0, 15) == [(False, CTX)]                      # ends by 15: never
    assert steps.kinds(1, 20, 40) == [(True, CTX)]                      # starts past it: always
    assert steps.kinds(3, 12, 16) == [(False, CTX), (True, CTX)]        # 12..14 does not, 13..15 does
    assert steps.kinds(3, 0, 10 * CTX) == steps.kinds(3)                # end is at most the context
    cut = Steps(steps.model, steps.cache, 16)
    assert cut.kinds(1) == [(False, 16), (True, 16), (True, 32), (True, 64), (True, 128), (True, 256)]
    assert cut.kinds(3, 30, 70) == [(True, 64), (True, 128)]            # 30..32 ends in 33: past 32
    assert cut.kinds(1, 31, 32) == [(True, 32)]
    assert [cut.bound(1, p) for p in (0, 15, 16, 31, 32, 200, CTX - 1)] == [16, 16, 32, 32, 64, 256, 256]
    assert Steps(steps.model, CacheState(m4.cfg, CTX, ratios=[0]), 16).bound(1, 100) == CTX   # nothing to cut


def test_cut_caches_give_the_whole_caches_logits(m4):
    """Steps with min_bound read the compressed caches cut to the rows below each step's bound (a cache of 256
    positions: 65 / 33 rows per ratio-4 / ratio-8 layer; bound 16: 5 / 3; the config's 6 layers: sliding x 2, then
    ratio 4, 8, 4, 8): decode and verify steps at every
    position up to 200 give the logits of the whole caches, through every bound and past where the indexer starts."""
    s = m4.engine.session(CTX)
    whole, cut = s.target, Steps(s.model, s.cache, 16)
    tokens = torch.randint(0, m4.cfg.n_vocab, (204,), generator=torch.Generator().manual_seed(5)).tolist()
    sizes = {b: [c.comp.shape[0] for c in cut.layers(b) if c.comp is not None] for b in (16, 64, CTX)}
    assert sizes == {16: [5, 3] * 2, 64: [17, 9] * 2, CTX: [65, 33] * 2}
    bounds = set()
    with torch.no_grad():
        for p in range(200):
            for T in ((1, 3) if p % 7 == 0 else (1,)):
                (a, _, _), (b, _, _) = whole.run(tokens[p:p + T]), cut.run(tokens[p:p + T])
                rel = ((a - b).abs().max() / a.abs().max()).item()
                assert rel <= TOL, (p, T, rel)
                bounds.add(cut.bound(T))
            s.cache.commit(whole.run(tokens[p:p + 1])[2], 1)
    assert bounds == {16, 32, 64, 128, 256}


def test_cut_caches_compile_once_for_every_bound(tiny_gguf):
    """Steps.layers marks a cut's row count dynamic: torch.compile'd blocks (as the CUDA backend's compile_blocks,
    Inductor on the CPU here) compile for the first bound and the indexer's first step and for none of the later
    bounds (32, 64 of a 64-token context), each step within float32 rounding of the same blocks run eagerly. The
    MoE is replaced by a traceable stand-in (the reference's loop over the routed experts is data-dependent)."""
    from torch._dynamo.utils import counters

    from ds4trt.model.transformer import FeedForward

    engine = Engine.open(tiny_gguf, numerics="float")
    for m in engine.model.modules():
        if isinstance(m, FeedForward):
            m.both_experts = lambda v, ids, weights: v * weights.sum(dim=-1, keepdim=True)  # noqa: B023
    eager = engine.model.blocks
    compiled = torch.nn.ModuleList(torch.compile(b, fullgraph=True, dynamic=False) for b in eager)
    s = engine.session(64)
    steps = Steps(s.model, s.cache, 16)
    tokens = torch.randint(0, engine.cfg.n_vocab, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    made: dict[tuple, int] = {}
    with torch.no_grad():
        for p in range(40):
            kind, before = (steps.indexer(1), steps.bound(1)), counters["stats"]["unique_graphs"]
            engine.model.blocks = compiled
            got, _, rows = steps.run(tokens[p:p + 1])
            made[kind] = made.get(kind, 0) + counters["stats"]["unique_graphs"] - before
            engine.model.blocks = eager
            want = steps.run(tokens[p:p + 1])[0]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, p
            s.cache.commit(rows, 1)
    assert list(made) == [(False, 16), (True, 16), (True, 32), (True, 64)]
    assert made[(False, 16)] > 0 and made[(True, 16)] > 0 and made[(True, 32)] == made[(True, 64)] == 0, made


def test_engine_without_mtp(tiny_gguf, m4):
    """No MTP head: speculative steps degrade to one token per target pass; an external drafter still works."""
    model = Model("r4r8-nomtp", _open(tiny_gguf, None))
    assert model.engine.mtp is None and model.engine.session(8).drafter is None
    prompt, gen = list(range(70, 90)), 11
    want = m4.greedy(prompt, gen)
    got, s = run_spec(model, prompt, gen, 3, 0.0)
    assert got == want and s.stats.passes == gen and s.stats.drafted == []
    got, s = run_spec(model, prompt, gen, 3, 0.0,
                      drafter=ScriptedDrafter(prompt + m4.greedy(prompt, gen + MAX_N + 1), m4.cfg.n_vocab))
    assert got == want and s.stats.passes == math.ceil(gen / 4)


def test_overlong_drafter_output_is_capped(m4):
    """A drafter is asked for n = min(n_draft, max_tokens - 1, ctx room) drafts. One that returns more (a
    third-party drafter passed through drafter=) must not make a cycle commit more than 1 + n tokens:
    max_tokens and n_draft are caps of eval_speculative_argmax, whatever the drafter does."""
    prompt = list(range(50, 70))
    full = prompt + m4.greedy(prompt, 16)

    class Overlong:
        def draft(self, tokens, first_token, n, margin, eos):
            p = len(tokens)
            return [(full[p + 1 + k], 1.0) for k in range(n + 3)]        # correct, but 3 too many
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    got = s.eval_speculative_argmax(s.argmax(), 2, None, n_draft=1, margin=0.0, drafter=Overlong())
    assert got == full[20:22], f"max_tokens=2, n_draft=1 but {len(got)} tokens committed"
    s = m4.engine.session(len(prompt) + 3)
    s.prefill(prompt)
    got = s.eval_speculative_argmax(s.argmax(), 100, None, n_draft=2, margin=0.0, drafter=Overlong())
    assert got == full[20:23]                  # capped by the context room, no "context full" error


def test_float32_smoke(tiny_gguf, tiny_mtp_gguf):
    model = Model("f32", _open(tiny_gguf, tiny_mtp_gguf, dtype=torch.float32))
    assert model.engine.session(8).cache.layers[0].raw.dtype == torch.float32
    for prompt, gen in prompts_for(model, 2, seed=3):
        want = model.greedy(prompt, gen)
        for n in (2, 4):
            got, _ = run_spec(model, prompt, gen, n, 0.0)
            assert got == want
            d = ScriptedDrafter(prompt + model.greedy(prompt, gen + MAX_N + 1), model.cfg.n_vocab)
            got, s = run_spec(model, prompt, gen, n, 0.0, drafter=d)
            assert got == want
            assert s.stats.passes == math.ceil(gen / (n + 1))


# ---------------------------------------------------------------------------------------------------
# 2 + 3. scripted drafters (oracle: full accepts; wrong at j: partial accepts): output, target passes,
# per-position stats, and after every cycle the caches of sequential decoding

@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_scripted_drafters(model, n_draft):
    for prompt, gen in prompts_for(model, 2, seed=4):
        ref = model.seqref(prompt, gen)
        want = ref.tokens[len(prompt):len(prompt) + gen]
        for wrong_at in [None] + list(range(n_draft)):
            d = ScriptedDrafter(ref.tokens + [0] * MAX_N, model.cfg.n_vocab, wrong=wrong_set(wrong_at))
            log, ring_pos = [], []
            # the session's own MTP drafter only observes (its ring stays where prefill left it)
            got, s = run_spec(model, prompt, gen, n_draft, 0.0, drafter=d, log=log.append,
                              on_cycle=lambda s, got: (ref.check(s), ring_pos.append(s.drafter.cache.pos)))
            assert got == want, (model.name, len(prompt), n_draft, wrong_at)
            cycles = predict(gen, n_draft, wrong_at)
            check_stats(s, cycles)
            if wrong_at is None:
                assert s.stats.passes == math.ceil(gen / (n_draft + 1))
            if wrong_at == 0:
                assert s.stats.passes == gen                    # immediate reject: one token per pass
            # asked for min(n, room) drafts, at each cycle's start position
            starts = [len(prompt) + sum(c[2] for c in cycles[:i]) for i in range(len(cycles))]
            assert [(p, asked) for p, asked, _ in d.calls] == [(p, c[0]) for p, c in zip(starts, cycles) if c[0]]
            assert [parse_log(line)["accepted"] for line in log] == [c[1] for c in cycles]
            assert set(ring_pos) == {len(prompt) - 1}


def test_oracle_full_accepts_commit_n_plus_1(m4):
    prompt, gen = list(range(3, 23)), 17
    full = prompt + m4.greedy(prompt, gen + MAX_N + 1)
    for n in (1, 2, 3, 4):
        sizes = []
        got, s = run_spec(m4, prompt, gen, n, 0.0, drafter=ScriptedDrafter(full, m4.cfg.n_vocab),
                          on_cycle=lambda s, g: sizes.append(len(g)))
        assert got == full[len(prompt):len(prompt) + gen]
        assert sizes == [n + 1] * (gen // (n + 1)) + ([gen % (n + 1)] if gen % (n + 1) else [])
        assert s.stats.accepted == s.stats.drafted
        rep = s.stats.report()
        assert f"{gen} tokens in {len(sizes)} target passes" in rep and "d1=100%" in rep


@pytest.mark.parametrize("n_draft", [2, 4])
def test_steered_mtp_accept_patterns(model, n_draft):
    """The real MTPDrafter code with steered tokens (oracle / wrong at j): its ring catches up 1..n+1 pairs
    per cycle in one batched MTP step and recursion runs on a scratch copy; after every cycle: target
    caches == sequential, ring == T = 1 reference on the true pairs; stats as predicted."""
    for prompt, gen in prompts_for(model, 2, seed=6):
        ref = model.seqref(prompt, gen)
        for wrong_at in [None] + list(range(n_draft)):
            steered = SteeredDrafter(model.engine.mtp, oracle_plan(ref.tokens + [0] * MAX_N, model.cfg.n_vocab,
                                                                   wrong_set(wrong_at)))
            s = model.engine.session(CTX)
            s.drafter = steered
            s.prefill(prompt)
            ref.check(s)
            got, s = run_spec(model, None, gen, n_draft, 0.0, session=s, on_cycle=lambda s, got: ref.check(s))
            assert got == ref.tokens[len(prompt):len(prompt) + gen]
            check_stats(s, predict(gen, n_draft, wrong_at))
            assert all(len(r) > 0 for r in steered.returned)


@pytest.mark.parametrize("n_draft", [1, 3, 4])
def test_real_mtp_caches_every_cycle(model, n_draft):
    for prompt, gen in prompts_for(model, 2, seed=7):
        ref = model.seqref(prompt, gen)
        got, s = run_spec(model, prompt, gen, n_draft, 0.0, on_cycle=lambda s, got: ref.check(s))
        assert got == ref.tokens[len(prompt):len(prompt) + gen]


@pytest.mark.parametrize("which", ["r4r8", "r128"])
def test_compression_boundaries_inside_verify(which, request):
    """Prompt lengths chosen so the first verify batches put a compression boundary (position = 3 mod 4,
    7 mod 8, 127 mod 128) and the sliding-window edge (window 8) at every offset inside the batch, with
    full and partial accepts."""
    model = request.getfixturevalue({"r4r8": "m4", "r128": "m128"}[which])
    lengths = range(3, 11) if which == "r4r8" else range(123, 129)
    rng = random.Random(14)
    for L in lengths:
        prompt = [rng.randrange(model.cfg.n_vocab) for _ in range(L)]
        gen = 7
        ref = model.seqref(prompt, gen)
        for wrong_at in (None, 2):
            steered = SteeredDrafter(model.engine.mtp, oracle_plan(ref.tokens + [0] * MAX_N, model.cfg.n_vocab,
                                                                   wrong_set(wrong_at)))
            s = model.engine.session(CTX)
            s.drafter = steered
            s.prefill(prompt)
            got, s = run_spec(model, None, gen, 4, 0.0, session=s, on_cycle=lambda s, got: ref.check(s))
            assert got == ref.tokens[L:L + gen], (L, wrong_at)


def test_mixed_drafters(m4, m128):
    """Cycles alternate between an external oracle (the session's drafter only observes) and the session's
    MTP drafter, which then catches up several pairs in one batch; a plain eval in between too."""
    for model in (m4, m128):
        for prompt, gen in prompts_for(model, 2, seed=8):
            ref = model.seqref(prompt, gen + 2)
            oracle = ScriptedDrafter(ref.tokens + [0] * MAX_N, model.cfg.n_vocab)
            s = model.engine.session(CTX)
            s.prefill(prompt)
            cycle = 0
            while s.pos < len(prompt) + gen:
                cycle += 1
                tok = s.argmax()
                if cycle % 4 == 3:
                    s.eval(tok)
                else:
                    d = oracle if cycle % 4 in (1, 2) else None
                    s.eval_speculative_argmax(tok, len(prompt) + gen - s.pos, None, n_draft=3, margin=0.0, drafter=d)
                ref.check(s)
            assert s.tokens == ref.tokens[:len(prompt) + gen]


def test_forced_first_token_and_prefill_after_speculation(m4):
    """first_token need not be the argmax (e.g. a sampled or forced token); prefilling a new turn after
    speculative decoding; both keep every cache equal to a session that did the same sequentially."""
    prompt, turn2 = list(range(30, 45)), list(range(400, 410))
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    forced = (s.argmax() + 7) % m4.cfg.n_vocab
    got = s.eval_speculative_argmax(forced, 10, None, n_draft=3, margin=0.0)
    assert got[0] == forced
    run_spec(m4, None, 10 - len(got), 3, 0.0, session=s)
    assert s.tokens == prompt + [forced] + m4.greedy(prompt + [forced], 9)
    s.prefill(turn2)
    run_spec(m4, None, 8, 3, 0.0, session=s)
    base = s.tokens[:len(prompt) + 10] + turn2
    assert s.tokens == base + m4.greedy(base, 8)

    ref = sequential_session(m4, prompt)
    for t in s.tokens[len(prompt):len(prompt) + 10]:
        ref.eval(t)
    ref.prefill(turn2)
    for t in s.tokens[len(base):]:
        ref.eval(t)
    assert_tensors_close(s.cache.tensors(), ref.cache.tensors(), "target")
    ring = ring_reference(m4)
    advance_ring(ring, ref.drafter.hc, ref.tokens, s.drafter.cache.pos)
    assert_tensors_close(s.drafter.cache.tensors(), ring.cache.tensors(), "ring")


def test_ring_after_prefill_and_first_draft(m4):
    """After prefill the ring holds the n-1 prompt pairs (one batched catch-up) and h_{n-1} is pending;
    the first draft adds the pair (h_{n-1}, first_token) at position n-1."""
    for prompt in ([7], [7, 8], list(range(40, 52)), list(range(100, 140))):
        s = m4.engine.session(CTX)
        s.prefill(prompt)
        n = len(prompt)
        assert s.drafter.cache.pos == n - 1 and len(s.drafter.pending_hc) == 1
        ref = sequential_session(m4, prompt)
        ring = ring_reference(m4)
        advance_ring(ring, ref.drafter.hc, ref.tokens, n - 1)
        assert_tensors_close(s.drafter.cache.tensors(), ring.cache.tensors(), "ring after prefill")
        first = s.argmax()
        assert len(s.drafter.draft(s.tokens, first, 2, 0.0, None)) == 2
        assert s.drafter.cache.pos == n and len(s.drafter.pending_hc) == 0
        ring.observe(ref.drafter.hc[n - 1][None])
        ring.catch_up(prompt + [first])
        assert_tensors_close(s.drafter.cache.tensors(), ring.cache.tensors(), "ring after first draft")


def test_ring_after_chunked_prefill(m4):
    """A prompt longer than the prefill chunk: the drafter catches up after every chunk (pairs across the
    chunk boundary included); its ring equals the T = 1 reference, and speculation then stays exact."""
    from ds4trt.runtime.session import PREFILL_CHUNK
    rng = random.Random(15)
    prompt = [rng.randrange(m4.cfg.n_vocab) for _ in range(PREFILL_CHUNK + 9)]
    ctx = PREFILL_CHUNK + 32
    s = m4.engine.session(ctx)
    s.prefill(prompt)
    assert s.drafter.cache.pos == len(prompt) - 1
    ref = sequential_session(m4, prompt, ctx)
    ring = MTPDrafter(m4.engine.mtp, ctx, torch.float64)
    advance_ring(ring, ref.drafter.hc, ref.tokens, len(prompt) - 1)
    assert_tensors_close(s.drafter.cache.tensors(), ring.cache.tensors(), "ring after chunked prefill")
    got, _ = run_spec(m4, None, 8, 3, 0.0, session=s)
    assert got == greedy(m4.engine, 8, prompt, ctx, PREFILL_CHUNK)


def test_context_bound_drafts(m4):
    """Drafts are capped by the context room (max_tokens never binds): decoding fills ctx exactly, no
    error, stream exact."""
    prompt = list(range(60, 80))
    for n in (1, 4):
        for extra in (5, 7):
            ctx = len(prompt) + extra
            full = prompt + m4.greedy(prompt, extra + MAX_N + 1)
            for d in (ScriptedDrafter(full, m4.cfg.n_vocab), None):      # oracle, then the real drafter
                s = m4.engine.session(ctx)
                s.prefill(prompt)
                while s.pos < ctx:
                    s.eval_speculative_argmax(s.argmax(), 100, None, n_draft=n, margin=0.0, drafter=d)
                assert s.tokens == full[:ctx]
                if d is not None:
                    assert all(asked == min(n, ctx - p - 1) for p, asked, _ in d.calls)
                    assert s.stats.passes == math.ceil(extra / (n + 1))


# ---------------------------------------------------------------------------------------------------
# 4. the MTP pairing (DeepSeek convention)

def test_mtp_pairing_deepseek_convention(m4, tiny_mtp_gguf):
    """The first draft of a cycle is the MTP head on (h_{n-1}, embed(first_token)) at position n-1, on a
    ring that holds the pairs (h_i, x_{i+1}) for i < n-1; it predicts the token AFTER first_token. The
    second draft feeds (head output HC, d_1) at position n. Computed here by hand with a separately built
    MTPHead and fresh caches. (ds4 pairs h_p with embed(x_p), re-predicting x_{p+1}: not used here.)"""
    e, cfg = m4.engine, m4.cfg
    _, weights = load_mtp(tiny_mtp_gguf, cfg)
    mtp = MTPHead(e.model, weights).to(torch.float64)
    target = e.model
    rng = random.Random(9)
    for n in (1, 2, 5, 9, 23):
        prompt = [rng.randrange(cfg.n_vocab) for _ in range(n)]
        s = e.session(CTX)
        s.prefill(prompt)
        first = s.argmax()
        drafts = s.drafter.draft(s.tokens, first, 2, 0.0, None)
        assert len(drafts) == 2

        with torch.no_grad():
            tc = CacheState(cfg, CTX, dtype=torch.float64)
            h = target.step(torch.tensor(prompt), tc.start(), tc.layers).hc              # h_0..h_{n-1}
            ring = CacheState(cfg, CTX, ratios=[0], dtype=torch.float64)
            for i in range(n - 1):                                                        # (h_i, x_{i+1})
                out = mtp.step(torch.tensor([prompt[i + 1]]), h[i:i + 1], ring.start(), ring.layers)
                ring.commit(out.rows, 1)
            assert ring.pos == n - 1
            out = mtp.step(torch.tensor([first]), h[n - 1:n], ring.start(), ring.layers)     # at position n-1
            ring.commit(out.rows, 1)
            top = torch.topk(mtp.head(out.hc)[0], 2)
            d1, g1 = int(top.indices[0]), float(top.values[0] - top.values[1])
            out2 = mtp.step(torch.tensor([d1]), out.hc, ring.start(), ring.layers)            # at position n
            top2 = torch.topk(mtp.head(out2.hc)[0], 2)
            d2, g2 = int(top2.indices[0]), float(top2.values[0] - top2.values[1])
            # ds4's pairing for contrast: row i from (h_i, embed(x_i)); the ring must NOT hold these
            alt = CacheState(cfg, CTX, ratios=[0], dtype=torch.float64)
            ds4 = mtp.step(torch.tensor(prompt), h, alt.start(), alt.layers)
        assert drafts[0][0] == d1 and abs(drafts[0][1] - g1) <= 1e-9
        assert drafts[1][0] == d2 and abs(drafts[1][1] - g2) <= 1e-9
        assert_tensors_close(s.drafter.cache.tensors(), ring.tensors(), "ring")
        W = ring.layers[0].raw.shape[0]
        assert not torch.allclose(s.drafter.cache.layers[0].raw[(n - 1) % W], ds4.rows[0].raw[n - 1])


def test_first_draft_is_verified_against_target_after_first_token(m4):
    """Draft 1 is compared with the target's argmax after first_token: proposing exactly the greedy token
    after first_token is accepted; proposing first_token again (a one-off re-prediction) is not."""
    prompt = list(range(200, 230))
    full = prompt + m4.greedy(prompt, 10)
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    first = s.argmax()
    assert first == full[30]
    got = s.eval_speculative_argmax(first, 10, None, n_draft=1, margin=0.0,
                                    drafter=ScriptedDrafter(full, m4.cfg.n_vocab))
    assert got == [full[30], full[31]]

    class Repeat:
        def draft(self, tokens, first_token, n, margin, eos):
            return [(first_token, 1.0)]
    assert full[31] != full[30]
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    assert s.eval_speculative_argmax(first, 10, None, n_draft=1, margin=0.0, drafter=Repeat()) == [first]
    assert s.argmax() == full[31]


# ---------------------------------------------------------------------------------------------------
# 5. margin semantics; 6. the per-cycle log

def test_margin_inf_drafts_nothing_margin_0_drafts_n(model):
    for prompt, gen in prompts_for(model, 2, seed=10):
        want = model.greedy(prompt, gen)
        log = []
        got, s = run_spec(model, prompt, gen, 4, math.inf, log=log.append)
        assert got == want
        assert s.stats.passes == gen and s.stats.drafted == []
        assert len(log) == gen and all(parse_log(line)["drafted"] == [] for line in log)
        log = []
        got, s = run_spec(model, prompt, gen, 4, 0.0, log=log.append)
        assert got == want
        done = 0
        for rec in map(parse_log, log):
            assert len(rec["drafted"]) == min(4, gen - done - 1)
            done += 1 + rec["accepted"]


def test_margin_stops_drafting_real_mtp(model):
    """The real drafter's own top1-top2 gaps: a threshold m keeps exactly the leading drafts with gap >= m
    (the same drafts as with margin 0, cut at the first gap below m)."""
    for prompt, gen in prompts_for(model, 2, seed=11):
        gaps = {}      # position -> the drafts and exact gaps at margin 0 (the log rounds them)

        class Rec:
            def __init__(self, inner):
                self.inner = inner

            def draft(self, tokens, first_token, n, margin, eos):
                gaps[len(tokens)] = out = self.inner.draft(tokens, first_token, n, margin, eos)
                return out
        s0 = model.engine.session(CTX)
        s0.prefill(prompt)
        run_spec(model, prompt, gen, 4, 0.0, drafter=Rec(s0.drafter), session=s0)
        assert len(gaps) >= gen - 1
        allg = sorted(g for out in gaps.values() for _, g in out)
        m = allg[len(allg) // 2]
        m = (m + min([g for g in allg if g > m], default=m + 1.0)) / 2      # a threshold between two gaps
        log = []
        got, s = run_spec(model, prompt, gen, 4, m, log=log.append)
        assert got == model.greedy(prompt, gen)
        seen = 0
        for rec in map(parse_log, log):
            if rec["pos"] not in gaps:
                continue
            seen += 1
            full = gaps[rec["pos"]]
            k = next((i for i, (_, g) in enumerate(full) if g < m), len(full))
            assert rec["drafted"] == [t for t, _ in full[:k]]
            assert all(g >= m - 0.005 for g in rec["margins"])      # (the log rounds to 2 decimals)
        assert seen >= len(log) // 2


def test_margin_stops_drafting_steered(m4):
    """Exact gaps through the steered head: drafting stops at the first draft whose gap < margin."""
    prompt, gen = list(range(10, 30)), 12
    full = prompt + m4.greedy(prompt, gen + MAX_N + 1)
    gap_plan = [5.0, 4.0, 2.0, 6.0]

    def plan(tokens, first_token, n):
        p = len(tokens)
        return [(full[p + 1 + k], gap_plan[k]) for k in range(n)]
    for margin, want_k in ((0.0, 4), (1.5, 4), (2.5, 2), (4.5, 1), (5.5, 0), (math.inf, 0)):
        s = m4.engine.session(CTX)
        s.drafter = SteeredDrafter(m4.engine.mtp, plan)
        s.prefill(prompt)
        log = []
        got, s = run_spec(m4, None, gen, 4, margin, log=log.append, session=s)
        assert got == full[len(prompt):len(prompt) + gen]
        done = 0
        for rec in map(parse_log, log):
            k = min(want_k, gen - done - 1)
            assert len(rec["drafted"]) == k and rec["accepted"] == k
            assert rec["margins"] == [round(g, 2) for g in gap_plan[:k]]
            done += 1 + k
        assert s.stats.passes == len(log)


def test_conf_log_lines(model):
    """One line per cycle: position, drafted tokens, their gaps, the target's argmax per verified row and
    the accepted count, consistent with what was committed."""
    for prompt, gen in prompts_for(model, 1, seed=12):
        full = prompt + model.greedy(prompt, gen + MAX_N + 1)
        for wrong_at in (None, 0, 1, 2):
            steered = SteeredDrafter(model.engine.mtp,
                                     oracle_plan(full, model.cfg.n_vocab, wrong_set(wrong_at), gap=7.25))
            s = model.engine.session(CTX)
            s.drafter = steered
            s.prefill(prompt)
            log, cycles = [], []
            run_spec(model, None, gen, 3, 0.0, log=log.append, session=s,
                     on_cycle=lambda s, got: cycles.append((s.pos - len(got), got, s.argmax())))
            assert len(log) == len(cycles) == s.stats.passes
            di = 0
            for line, (pos, got, nxt) in zip(log, cycles):
                rec = parse_log(line)
                assert rec["pos"] == pos
                k = len(rec["drafted"])
                if k:
                    assert rec["drafted"] == [t for t, _ in steered.returned[di]]
                    assert rec["margins"] == [round(g, 2) for _, g in steered.returned[di]] == [7.25] * k
                    di += 1
                assert len(rec["target"]) == 1 + k
                n_ok = rec["accepted"]
                assert rec["drafted"][:n_ok] == rec["target"][:n_ok]
                assert n_ok == k or rec["drafted"][n_ok] != rec["target"][n_ok]
                assert n_ok == (k if wrong_at is None else min(k, wrong_at))
                assert got == [full[pos]] + rec["drafted"][:n_ok]
                assert rec["target"][n_ok] == nxt                  # the correction / bonus token
            assert di == len(steered.returned)


# ---------------------------------------------------------------------------------------------------
# 7. rewind

@pytest.mark.parametrize("drafter_kind", ["mtp", "steered"])
def test_rewind_then_speculate(model, drafter_kind):
    """rewind(p) to a point inside the prompt or inside the generated tokens, then speculative decoding
    again: equal to plain greedy from that point; after every cycle the caches and the MTP ring equal a
    sequential reference of the kept tokens (the drafter is reset, then catches up)."""
    prompt, _ = prompts_for(model, 1, seed=13)[0]
    prompt = prompt + list(range(1, 9))
    gen = 12
    stream = prompt + model.greedy(prompt, gen + MAX_N + 1)
    holder = {}
    for p in (len(prompt) // 2, len(prompt) + 3, len(prompt) + 9):
        s = model.engine.session(CTX)
        if drafter_kind == "steered":
            s.drafter = SteeredDrafter(model.engine.mtp, lambda t, f, n: holder["plan"](t, f, n))
            holder["plan"] = oracle_plan(stream, model.cfg.n_vocab, wrong=(1,))
        s.prefill(prompt)
        run_spec(model, None, gen, 3, 0.0, session=s)
        assert s.tokens == stream[:len(prompt) + gen]
        s.rewind(p)
        kept = stream[:p]
        assert s.tokens == kept and s.pos == p
        assert s.drafter.cache.pos == p - 1 and len(s.drafter.pending_hc) == 1
        ref = model.seqref(kept, gen)
        if drafter_kind == "steered":
            holder["plan"] = oracle_plan(ref.tokens + [0] * MAX_N, model.cfg.n_vocab, wrong=(2,))
        ref.check(s)
        got, s = run_spec(model, None, gen, 3, 0.0, session=s, on_cycle=lambda s, got: ref.check(s))
        assert got == ref.tokens[p:p + gen] == model.greedy(kept, gen), (model.name, p)


def test_rewind_noop_and_bounds(m4):
    prompt = list(range(300, 320))
    s = m4.engine.session(CTX)
    s.prefill(prompt)
    run_spec(m4, None, 10, 2, 0.0, session=s)
    s.rewind(s.pos)                                   # a no-op rewind replays everything
    assert s.tokens == prompt + m4.greedy(prompt, 10)
    got, _ = run_spec(m4, None, 6, 2, 0.0, session=s)
    assert got == m4.greedy(prompt, 16)[10:]
    with pytest.raises(Exception):
        s.rewind(s.pos + 1)


def _write_layer_by_layer(cache: CacheState, rows, n: int, start: int) -> None:
    """The commit semantics, one layer and one row at a time (the reference for CacheState.write)."""
    for layer, r, ratio in zip(cache.layers, rows, cache.ratios):
        for name, t in layer.tensors().items():
            cap = t.shape[0]
            for i in range(n):
                p = start + i
                if name in ("comp", "index"):
                    t[(p + 1) // ratio - 1 if (p + 1) % ratio == 0 else cap - 1] = getattr(r, name)[i]
                elif i >= n - min(n, cap):
                    t[p % cap] = getattr(r, name)[i]


def test_cache_write_by_groups_matches_layer_by_layer():
    """CacheState.write commits the layers of one field, shape and ratio with one index_copy_ over their shared
    storage; the result must equal writing each layer's rows one by one, for commits shorter and longer than
    the rings, and also after a layer's tensor was replaced (as a TensorRT engine's adopt() does)."""
    cfg = tiny_config(compress_ratios=(0, 4, 128, 4, 128, 0))
    ctx, T = 300, 9
    gen = torch.Generator().manual_seed(7)
    got, want = CacheState(cfg, ctx, dtype=torch.float64), CacheState(cfg, ctx, dtype=torch.float64)
    assert any(len(g.members) > 1 for g in got.groups)
    replaced = got.layers[3].index_kv.clone()
    got.layers[3].index_kv = replaced                  # no longer a view of its group's storage
    pos = 0
    for n in (1, 3, 9, 2, 9, 9, 1, 5, 9, 9, 9, 7):   # crosses positions 4k-1, 127 and the 8-slot rings
        rows = [LayerRows(**{name: torch.randn(T, t.shape[1], dtype=torch.float64, generator=gen)
                             for name, t in layer.tensors().items()}) for layer in got.layers]
        got.write(rows, n, torch.tensor(pos))
        _write_layer_by_layer(want, rows, n, pos)
        pos += n
        for (name, a), b in zip(got.tensors().items(), want.tensors().values()):
            if name.endswith(("comp", "index")):       # the spare last row takes every non-emitting row
                a, b = a[:-1], b[:-1]
            assert torch.equal(a, b), (n, pos, name)
    assert got.layers[3].index_kv is replaced and not torch.equal(replaced, torch.zeros_like(replaced))
