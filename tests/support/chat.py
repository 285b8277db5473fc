"""A toy chat for the tests: a tokenizer whose ids round-trip to characters, a template of
role tokens, and a chat session over a tiny target built with them."""

from __future__ import annotations

from redrafter_mlx.cli.chat import ChatSession
from redrafter_mlx.core.decode.shape import BeamShape
from support import chat_session

EOS, USER, ASSISTANT, SYSTEM = 1, 2, 3, 4
ROLE = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}
BASE = 0x100  # token id t <-> character chr(BASE + t): exact round trip for generated text


def encode_text(text: str) -> list[int]:
    return [ord(c) - BASE if BASE <= ord(c) < BASE + 64 else ord(c) % 59 + 5 for c in text]


def toy_template(messages: list[dict]) -> list[int]:
    """<role> text <eos> per message, then the generation prompt <assistant>."""
    ids = []
    for m in messages:
        ids += [ROLE[m["role"]], *encode_text(m["content"]), EOS]
    return ids + [ASSISTANT]


class ToyDetokenizer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.seen = [], 0

    def add_token(self, token):
        self.tokens.append(token)

    def finalize(self):
        pass

    @property
    def text(self):
        return "".join(chr(BASE + t) for t in self.tokens)

    @property
    def last_segment(self):
        segment = self.text[self.seen :]
        self.seen = len(self.text)
        return segment


class ToyTokenizer:
    eos_token_ids = [EOS]

    def __init__(self):
        self.detokenizer = ToyDetokenizer()


def session(target, drafter=None, **kwargs) -> ChatSession:
    return chat_session(
        target, drafter, BeamShape(2, 3), toy_template, tokenizer=ToyTokenizer(), **kwargs
    )


def ask(chat: ChatSession, text: str) -> str:
    return "".join(r.text for r in chat.reply(text))
