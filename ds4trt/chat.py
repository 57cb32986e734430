"""The DS4 prompt format (spec ds4_architecture.md §5.3), as token ids.

Single turn (ds4's CLI), built id by id; the system and prompt text are BPE'd as plain text:
    BOS, [system], <｜User｜>, prompt, <｜Assistant｜>, <think> (thinking on) or </think> (off)

Multi-turn (ds4's server), rendered as text, then encoded with the special strings split out:
    <｜begin▁of▁sentence｜>{system}
    user:       <｜User｜>{content}
    assistant:  <｜Assistant｜></think>{content}<｜end▁of▁sentence｜>
                (<think>{reasoning}</think> instead of </think> when thinking is on and the message
                comes after the last user turn)
    finally:    <｜Assistant｜><think>  or  <｜Assistant｜></think>
System and developer messages, wherever they appear, are gathered into {system}, joined by "\n\n".
Tools and DSML tool calls are not supported. Think-Max is not supported.

For text without special strings, render_single(tok, p, s, think) == Conversation([("system", s),
("user", p)]).render(tok, think).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from ds4trt.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, Tokenizer

ROLES = ("system", "developer", "user", "assistant")


def render_single(tok: Tokenizer, prompt: str, system: str = "", think: bool = False) -> list[int]:
    """One user turn, ready for generation: the model's next token starts the answer (or its thinking)."""
    tok.require_chat_ids()
    ids = [tok.bos_id]
    if system:
        ids += tok.encode(system)
    ids += [tok.user_id] + tok.encode(prompt) + [tok.assistant_id]
    ids.append(tok.think_id if think else tok.end_think_id)
    return ids


class Message(NamedTuple):
    role: str  # one of ROLES
    content: str
    reasoning: str = ""  # an assistant message's thinking; kept only when thinking is on and after the last user turn


@dataclass
class Conversation:
    """A chat history; `messages` accepts (role, content) or (role, content, reasoning) tuples."""

    messages: list[Message] = field(default_factory=list)

    def __post_init__(self):
        self.messages = [self._check(Message(*m)) for m in self.messages]

    def append(self, role: str, content: str, reasoning: str = "") -> "Conversation":
        self.messages.append(self._check(Message(role, content, reasoning)))
        return self

    def extend(self, messages: Iterable) -> "Conversation":
        for m in messages:
            self.append(*m)
        return self

    def render_text(self, think: bool = False) -> str:
        system = "\n\n".join(m.content for m in self.messages if m.role in ("system", "developer"))
        last_user = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=-1)
        parts = [BOS, system]
        for i, m in enumerate(self.messages):
            if m.role == "user":
                parts += [USER, m.content]
            elif m.role == "assistant":
                opened = f"{THINK}{m.reasoning}{END_THINK}" if think and i > last_user else END_THINK
                parts += [ASSISTANT, opened, m.content, EOS]
        parts += [ASSISTANT, THINK if think else END_THINK]
        return "".join(parts)

    def render(self, tok: Tokenizer, think: bool = False) -> list[int]:
        """Token ids of the rendered conversation, ending with the assistant's opening."""
        tok.require_chat_ids()
        return tok.encode(self.render_text(think), special=True)

    @staticmethod
    def _check(m: Message) -> Message:
        if m.role not in ROLES:
            raise ValueError(f"message role {m.role!r}: expected one of {', '.join(ROLES)}")
        return m
