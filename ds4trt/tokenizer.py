"""Byte-level BPE tokenizer for ds4 GGUFs (spec ds4_architecture.md §5.1-5.2), on HF `tokenizers`.

The vocabulary (`tokenizer.ggml.tokens`, id = index) and merges (`tokenizer.ggml.merges`, rank = index)
come from the GGUF. The pre-tokenizer is the one in DeepSeek V4's tokenizer.json, hard-coded below:
those regexes are the model's, and where ds4's hand-written splitter disagrees, tokenizer.json wins.

Two encodings:
  encode(text)                plain text: special strings are BPE'd like any other text (ds4 does the same
                              for user prompts), so a user cannot inject `<｜User｜>`.
  encode(text, special=True)  rendered chat text: the special strings split the text first and become
                              their own ids; the pieces between them are BPE'd as plain text.
BOS is never added automatically.
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N

# Special strings ds4 finds by string (spec §5.1). The bars are U+FF5C, the spaces U+2581.
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "\uff5cDSML\uff5c"

# Vocab entries that `encode(..., special=True)` splits on: every `<｜...｜>` plus these.
_SPECIAL_FORM = re.compile("<\uff5c.*\uff5c>", re.DOTALL)
_SPECIAL_EXTRA = (THINK, END_THINK, DSML)

# DeepSeek V4 tokenizer.json's pre-tokenizer, written with the same escapes as the JSON so the strings
# are identical (tests compare them): digits in runs of <= 3; CJK ideographs + kana runs; then words,
# punctuation runs with trailing newlines, and whitespace.
_SPLIT_REGEXES = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
)

# GGUF value type ids (the container's numbering).
_GGUF_ARRAY, _GGUF_STRING = 9, 8


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The DeepSeek V4 pre-tokenizer: three isolating regex splits, then byte-level mapping (no regex)."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in _SPLIT_REGEXES]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_decoder() -> dict[str, int]:
    """GPT-2's unicode symbol -> byte map: printable bytes stand for themselves, the other 68 map to 256+n."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


_U2B = _byte_decoder()


class Tokenizer:
    """DeepSeek V4 byte-level BPE. Special ids are found by string and are None when absent."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], source: str = ""):
        self.source = source or "<vocab>"
        self.tokens = list(tokens)
        self.n_vocab = len(self.tokens)
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)  # a duplicated string keeps its first id
        self._vocab = vocab
        pairs = []
        for rank, m in enumerate(merges):
            left, sep, right = m.partition(" ")
            if not sep or left not in vocab or right not in vocab or left + right not in vocab:
                raise Ds4Error(f"{self.source}: {N.KEY_MERGES}[{rank}]: expected 'left right' with left, right "
                               f"and their merge in {N.KEY_TOKENS}, got {m!r}")
            pairs.append((left, right))

        # plain: no added tokens, so special strings are BPE'd as text; chat: splits on special strings.
        self._plain = self._build(vocab, pairs)
        self._chat = self._build(vocab, pairs)
        self.special_tokens = [t for t in vocab if _SPECIAL_FORM.fullmatch(t) or t in _SPECIAL_EXTRA]
        self._chat.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.special_tokens])

        self.bos_id = self.token_id(BOS)
        self.eos_id = self.token_id(EOS)
        self.user_id = self.token_id(USER)
        self.assistant_id = self.token_id(ASSISTANT)
        self.think_id = self.token_id(THINK)
        self.end_think_id = self.token_id(END_THINK)
        self._bytes: Optional[list[bytes]] = None

    def _build(self, vocab: dict[str, int], pairs: list[tuple[str, str]]) -> HFTokenizer:
        # merges are checked by the caller: tokenizers panics on a merge whose result is not in the vocab
        bpe = models.BPE(vocab, pairs, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False,
                         ignore_merges=False)
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        return tok

    @classmethod
    def from_vocab(cls, tokens: Sequence[str], merges: Sequence[str], source: str = "") -> "Tokenizer":
        return cls(tokens, merges, source)

    @classmethod
    def from_gguf(cls, gguf_file) -> "Tokenizer":
        """From a GGUFFile (or a path to one): reads tokenizer.ggml.tokens and tokenizer.ggml.merges."""
        if not hasattr(gguf_file, "metadata"):
            from ds4trt.gguf_io.reader import GGUFFile
            with GGUFFile(gguf_file) as f:
                return cls.from_gguf(f)
        path = str(getattr(gguf_file, "path", "<gguf>"))
        return cls(_string_array(gguf_file.metadata, N.KEY_TOKENS, path),
                   _string_array(gguf_file.metadata, N.KEY_MERGES, path), path)

    def save(self, path) -> None:
        """Write a Hugging Face tokenizer.json (byte-level BPE, this pre-tokenizer, the special strings as added
        tokens); `from_file` reads it back. Needs distinct token strings (a JSON vocab maps string -> id)."""
        if len(self._vocab) != self.n_vocab:
            raise Ds4Error(f"{self.source}: {N.KEY_TOKENS} has duplicate strings; tokenizer.json cannot hold them")
        self._chat.save(str(path))

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        """Read a tokenizer.json written by `save` (model.vocab: string -> id for ids 0..n-1; model.merges)."""
        try:
            model = json.loads(Path(path).read_text(encoding="utf-8"))["model"]
            vocab, merges = model["vocab"], model["merges"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise Ds4Error(f"{path}: expected a tokenizer.json with model.vocab and model.merges ({e})") from e
        tokens = [None] * len(vocab)
        for text, i in vocab.items():
            if not (isinstance(i, int) and 0 <= i < len(tokens)) or tokens[i] is not None:
                raise Ds4Error(f"{path}: model.vocab: expected ids 0..{len(tokens) - 1} once each, got {i} for "
                               f"{text!r}")
            tokens[i] = text
        merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
        return cls(tokens, merges, str(path))

    # --- ids ---

    def token_id(self, text: str) -> Optional[int]:
        """The id of a vocab entry by its exact string, or None."""
        return self._vocab.get(text)

    def require_chat_ids(self) -> None:
        """Raise Ds4Error unless the vocab has every special token the DS4 chat format uses."""
        need = {BOS: self.bos_id, EOS: self.eos_id, USER: self.user_id, ASSISTANT: self.assistant_id,
                THINK: self.think_id, END_THINK: self.end_think_id}
        missing = [s for s, i in need.items() if i is None]
        if missing:
            raise Ds4Error(f"{self.source}: {N.KEY_TOKENS}: expected the chat tokens "
                           f"{', '.join(missing)} in the vocab, but they are missing")

    # --- encode / decode ---

    def encode(self, text: str, special: bool = False) -> list[int]:
        tok = self._chat if special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token sequence; an incomplete or invalid UTF-8 sequence becomes U+FFFD."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        return self._plain.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. Tokens outside the byte alphabet (`<｜User｜>`) stand for their UTF-8."""
        self._check_id(token_id)
        if self._bytes is None:
            self._bytes = [_token_to_bytes(t) for t in self.tokens]
        return self._bytes[token_id]

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} outside the vocab [0, {self.n_vocab})")

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, n_vocab={self.n_vocab}, n_special={len(self.special_tokens)})"


class StreamDecoder:
    """Turns generated ids into text as whole UTF-8 characters become available.

    push(id) returns the newly complete text (possibly ""); a character split across tokens is held
    back until its last byte arrives. flush() returns what is left (U+FFFD for a truncated character).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def decode_stream(tokenizer: Tokenizer, ids: Iterable[int]) -> Iterator[str]:
    """Yield non-empty text pieces for `ids` as complete UTF-8 characters become available."""
    dec = StreamDecoder(tokenizer)
    for i in ids:
        piece = dec.push(i)
        if piece:
            yield piece
    tail = dec.flush()
    if tail:
        yield tail


def _token_to_bytes(token: str) -> bytes:
    try:
        return bytes(_U2B[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _string_array(metadata: dict, key: str, path: str) -> list[str]:
    f = metadata.get(key)
    if f is None:
        raise Ds4Error(f"{path}: metadata key {key} is missing")
    value, elem = f.value, getattr(f, "array_type", None)
    if not (int(f.type) == _GGUF_ARRAY and elem is not None and int(elem) == _GGUF_STRING
            and isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)):
        raise Ds4Error(f"{path}: metadata {key}: expected an array of strings, got {_describe(f)}")
    if not value:
        raise Ds4Error(f"{path}: metadata {key}: expected a non-empty array of strings, got an empty one")
    return list(value)


_GGUF_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool",
                    8: "string", 9: "array", 10: "u64", 11: "i64", 12: "f64"}


def _describe(f) -> str:
    elem = getattr(f, "array_type", None)
    if int(f.type) == _GGUF_ARRAY and elem is not None:
        return f"an array of {_GGUF_TYPE_NAMES.get(int(elem), elem)}"
    return f"a {_GGUF_TYPE_NAMES.get(int(f.type), f.type)}"
