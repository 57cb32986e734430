"""The reference model against transformers' DeepseekV4ForCausalLM, and incremental decoding against
the full-sequence forward.

Tolerances: logits vs HF in float32, max |ours - HF| / max |HF| <= 1e-4 (both fp32; different op orders);
incremental vs full in float64, <= 1e-5 relative (observed ~1e-14)."""

from __future__ import annotations

import pytest
import torch

from ds4trt.model.layout import target_layout
from ds4trt.model.weights import load_target
from ds4trt.runtime.session import Engine
from ds4trt.testing.tiny_gguf import tiny_config, write_model_gguf
from hf_reference import hf_greedy, hf_logits, hf_model_from_gguf_tensors

torch.set_num_threads(1)

# Each covers every layer kind (sliding, ratio 4 + indexer, another ratio; hash layers) with prompts longer
# than the window and several compression blocks, and an indexer top-k below the number of visible rows.
CONFIGS = {
    "default": (tiny_config(), 72),
    # ratio 128 layer as in Flash; 300 tokens = 2 full 128-blocks, 75 ratio-4 rows against top-k 3
    "ratio128": (tiny_config(compress_ratios=(0, 0, 4, 128), n_layer=4), 300),
    # another window, top-k, head count and hash-layer count; ratio 16
    "wide": (tiny_config(n_layer=5, compress_ratios=(0, 4, 16, 4, 16), n_hash_layer=1, window=16,
                         index_top_k=5, index_n_head=8, n_head=8, o_groups=4, n_expert_used=3), 90),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg, n_prompt = CONFIGS[request.param]
    path = tmp_path_factory.mktemp("hf") / f"{request.param}.gguf"
    write_model_gguf(path, cfg, seed=7)
    gguf_file, _, weights = load_target(path)
    tensors = {s.name: weights.get(s.name) for s in target_layout(cfg) if weights.has(s.name)}
    hf = hf_model_from_gguf_tensors(cfg, tensors)
    prompt = torch.randint(0, cfg.n_vocab, (n_prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    return cfg, path, hf, prompt


def test_logits_match_transformers(case):
    cfg, path, hf, prompt = case
    engine = Engine.open(path, numerics="float")
    s = engine.session(len(prompt))
    logits, _, _ = s.target_step(prompt)
    ref = hf_logits(hf, prompt)
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel
    # the indexer really selected: more compressed rows were visible than top-k on some ratio-4 layer
    assert any(r == 4 for r in cfg.compress_ratios) and len(prompt) // 4 > cfg.index_top_k


def test_greedy_matches_transformers(case):
    cfg, path, hf, prompt = case
    n_new = 32
    engine = Engine.open(path, numerics="float")
    s = engine.session(len(prompt) + n_new)
    s.prefill(prompt, chunk=37)          # chunk boundaries that do not line up with any ratio
    ours = []
    for _ in range(n_new):
        ours.append(s.argmax())
        s.eval(ours[-1])
    assert ours == hf_greedy(hf, prompt, n_new)


@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_incremental_equals_full_forward(numerics, tmp_path):
    """Token-by-token decode and uneven chunked prefill equal one full-sequence step at every position,
    so at every residue modulo 4 and modulo 128 (the sequence spans 2 blocks of 128)."""
    cfg = tiny_config(compress_ratios=(0, 0, 4, 128), n_layer=4)
    path = tmp_path / "m.gguf"
    write_model_gguf(path, cfg, seed=11)
    engine = Engine.open(path, numerics=numerics, dtype=torch.float64)
    tokens = torch.randint(0, cfg.n_vocab, (262,), generator=torch.Generator().manual_seed(5)).tolist()

    full = engine.session(len(tokens))
    ref, _, _ = full.target_step(tokens)                       # [T, V], nothing committed
    seq = engine.session(len(tokens))
    rows = []
    for t in tokens:
        rows.append(seq.eval(t))
    got = torch.stack(rows)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5

    chunked = engine.session(len(tokens))
    at, outs = 0, []
    for n in (3, 1, 4, 7, 113, 2, 128, 4):                    # straddles 4- and 128-boundaries
        logits, hc, r = chunked.target_step(tokens[at:at + n])
        chunked.commit(tokens[at:at + n], hc, r, logits[-1], n)
        outs.append(logits)
        at += n
    assert at == len(tokens)
    assert ((torch.cat(outs) - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    a, b = seq.cache.live_tensors(), chunked.cache.live_tensors()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-9), k


@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_step_does_not_depend_on_capacity(numerics, tmp_path, monkeypatch):
    """A verify step of 4 tokens gives the same logits in a 32-token cache and a 400-token one, with the indexer
    layers attending over each row's gathered top-k rows and (GATHER_T = 0) over the whole masked cache; 6-7
    compressed rows are visible against top-k 3."""
    import ds4trt.model.attention as attention

    cfg = tiny_config()
    assert 4 in cfg.compress_ratios and cfg.index_top_k == 3
    path = tmp_path / "m.gguf"
    write_model_gguf(path, cfg, seed=13)
    engine = Engine.open(path, numerics=numerics, dtype=torch.float64)
    tokens = torch.randint(0, cfg.n_vocab, (28,), generator=torch.Generator().manual_seed(8)).tolist()
    outs = []
    for gather_t in (attention.GATHER_T, 0):
        monkeypatch.setattr(attention, "GATHER_T", gather_t)
        for ctx in (32, 400):
            s = engine.session(ctx)
            s.prefill(tokens[:24])
            logits, _, _ = s.target_step(tokens[24:])              # [4, V], nothing committed
            outs.append(logits)
    for other in outs[1:]:
        assert ((outs[0] - other).abs().max() / outs[0].abs().max()).item() <= 1e-9


@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_indexer_skipped_only_where_it_keeps_every_row(numerics, tmp_path):
    """Where no token of a step sees more than top-k compressed rows (indexer_needed false), the ratio-4 layers without
    the indexer (attending every visible row) give the indexer's logits; one position later the indexer drops rows and
    the two differ, so the bound is tight. Steps picks the flag from the cache's position."""
    from ds4trt.model.attention import indexer_needed

    cfg = tiny_config()
    k = cfg.index_top_k
    path = tmp_path / "m.gguf"
    write_model_gguf(path, cfg, seed=17)
    engine = Engine.open(path, numerics=numerics, dtype=torch.float64)
    tokens = torch.randint(0, cfg.n_vocab, (4 * k + 8,), generator=torch.Generator().manual_seed(4)).tolist()
    last = 4 * k + 3                                  # the last end (start + T) at which the indexer keeps every row
    assert not indexer_needed(cfg, last) and indexer_needed(cfg, last + 1)
    for T in (1, 3):
        for end, same in ((T + 4, True), (last, True), (last + 1, False), (last + 4, False)):
            s = engine.session(64)
            s.prefill(tokens[:end - T])
            assert s.target.indexer(T) == (not same)
            t = torch.tensor(tokens[end - T:end])
            with torch.no_grad():
                on, off = (s.model(t, s.cache.start(), s.cache.layers, indexer=flag)[0] for flag in (True, False))
            rel = ((on - off).abs().max() / on.abs().max()).item()
            assert (rel <= 1e-12) if same else (rel > 1e-6), (T, end, rel)


def test_rewind_replays_exactly(tiny_gguf):
    engine = Engine.open(tiny_gguf, dtype=torch.float64)
    tokens = torch.randint(0, engine.cfg.n_vocab, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    a = engine.session(64)
    a.prefill(tokens)
    a.rewind(17)
    assert a.pos == 17 and a.tokens == tokens[:17]
    a.prefill(tokens[17:])
    b = engine.session(64)
    b.prefill(tokens)
    assert torch.allclose(a.logits, b.logits, rtol=0, atol=1e-12)
    la, lb = a.cache.live_tensors(), b.cache.live_tensors()
    assert all(torch.allclose(la[k], lb[k], rtol=0, atol=1e-12) for k in la)


def test_prefill_runs_in_the_engines_chunks(tiny_gguf):
    """Session.prefill steps through the prompt in chunks of engine.prefill_chunk (the CUDA backend's is larger
    than the CPU's) and ends on the same logits as another chunking."""
    engine = Engine.open(tiny_gguf, dtype=torch.float64)
    prompt = torch.randint(0, engine.cfg.n_vocab, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    engine.prefill_chunk = 5
    s = engine.session(32)
    seen = []
    chunk = s.target.prefill
    s.target.prefill = lambda tokens, *a, **k: seen.append(len(tokens)) or chunk(tokens, *a, **k)
    got = s.prefill(prompt).clone()
    assert seen == [5, 5, 2]
    ref = engine.session(32).prefill(prompt, chunk=12)
    assert torch.allclose(got, ref, rtol=0, atol=1e-9 * ref.abs().max().item())


@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_long_chunks_in_query_blocks_equal_one_block(tiny_gguf, monkeypatch, numerics):
    """A chunk longer than QUERY_BLOCK is scored in blocks of queries, each against only the keys it can see
    (window rows, compressed rows emitted by then; the indexer in blocks too): with blocks of 5 queries, a 37-token
    chunk after 13 committed tokens gives the logits and cache rows of the same chunk scored in one block."""
    from ds4trt.model import attention

    engine = Engine.open(tiny_gguf, numerics=numerics, dtype=torch.float64)
    tokens = torch.randint(0, engine.cfg.n_vocab, (50,), generator=torch.Generator().manual_seed(4)).tolist()

    def chunk_after_prefix():
        s = engine.session(64)
        s.prefill(tokens[:13])
        logits, _, rows = s.target_step(tokens[13:])
        return logits, rows

    one_logits, one_rows = chunk_after_prefix()
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    got_logits, got_rows = chunk_after_prefix()
    scale = one_logits.abs().max().item()
    assert torch.allclose(got_logits, one_logits, rtol=0, atol=1e-12 * scale)
    for a, b in zip(got_rows, one_rows):
        for name, t in vars(a).items():
            if isinstance(t, torch.Tensor):
                assert torch.allclose(t, getattr(b, name), rtol=0, atol=1e-12 * max(1.0, t.abs().max().item())), name


@pytest.mark.parametrize("query_block", [None, 5])
def test_attend_top_hook_gets_each_querys_own_keys(tiny_gguf, monkeypatch, query_block):
    """A backend's attend_top (Attention's hook for steps of more than GATHER_T rows with the indexer), here a float64
    reference attending each query over its raw keys and its own top rows comp[top[t]], gives the logits of the
    masked attention over the whole compressed cache: a 40-token chunk after 9 committed tokens (positions 16.. need
    the indexer), also with queries in blocks of 5 (the chunk's new compressed rows cut to the emitting tokens)."""
    from ds4trt.model import attention

    if query_block:
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    engine = Engine.open(tiny_gguf, numerics="ds4", dtype=torch.float64)
    tokens = torch.randint(0, engine.cfg.n_vocab, (49,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []

    def own_keys(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin):
        T, k = top.shape
        assert all(len(set(row.tolist())) == k for row in top), "a query's top rows repeat"
        calls.append(int(top_vis.sum()))
        return torch.cat([attention.attend_unrotate(q[t:t + 1], torch.cat([raw, comp[top[t]]]),
                                                    torch.cat([raw_mask[t], top_vis[t]])[None], sinks, cos[t:t + 1],
                                                    sin[t:t + 1]) for t in range(T)])

    def chunk_logits():
        s = engine.session(64)
        s.prefill(tokens[:9])
        return s.target_step(tokens[9:])[0]                    # [40, V]

    want = chunk_logits()
    for m in engine.model.modules():
        if isinstance(m, attention.Attention):
            m.attend_top = own_keys
    got = chunk_logits()
    n_index_layers = sum(r == 4 for r in engine.cfg.compress_ratios)
    assert len(calls) == n_index_layers and min(calls) > 0
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * want.abs().max().item())
