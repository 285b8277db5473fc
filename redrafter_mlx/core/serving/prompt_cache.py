"""Several conversations' KV caches for one server: a :class:`Session` per conversation, kept
in least-recently-used order and bounded by count and bytes, each request answered by the
session whose cached tokens it continues.

Agents and chat front ends interleave conversations (an agent and its sub-agent, two tabs);
with one cache every switch re-read the whole history. A request *continues* a session when
(:func:`follows`):

- it begins with that session's last prompt (it extends it);
- it begins with that prompt but for a few tokens at its end (:data:`TAIL`) and a new turn
  follows: a client resends the answer's text, which the tokenizer need not split into the
  tokens generated (a token that is only part of a character cannot come back; a random
  model's tokens often do not), and a template may end the answer differently;
- the prompt's last message grew: the request is that prompt with text put in where they part,
  the prompt's rest (but for its first token, which the new text may merge with) ending it
  (Claude Code's ``--continue`` appends its new text to the last user message);
- it shares nearly all of what the session caches (:data:`LOSS_SHARE`): reusing that saves far
  more than the session's own conversation could lose, whatever the request's length.

Another conversation whose first message differs only in its last words (the same length, no
new turn) shares neither so much nor in that way: it must not take (and rewind) the session of
the one it resembles. Of the sessions a request continues, the one sharing most is taken. A
request that continues none gets a fresh session while there is room, else the least recently
used one's cache (rewound to the prefix it shares, if any: an agent's turn must not cost the
conversation just used).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from redrafter_mlx.core.decode.cache import common_prefix
from redrafter_mlx.core.serving.session import Session

TAIL = 8  # tokens at a prompt's end a resent history may spell differently (template tails)
# A request sharing this much of a session's cached tokens takes it whatever follows: the
# tokens it would cost the session's conversation are at most a quarter of those reused.
LOSS_SHARE = 4


class PromptCache:
    """Sessions by recency (most recent last), at most ``max_sessions`` and, after each
    request, at most ``max_bytes`` of KV cache (None: no byte bound; the session in use is
    never dropped)."""

    def __init__(
        self,
        new_session: Callable[[], Session],
        *,
        max_sessions: int = 4,
        max_bytes: int | None = None,
    ):
        check_bounds(max_sessions, max_bytes)
        self._new_session = new_session
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.sessions: list[Session] = []
        self._prompts: dict[int, int] = {}  # id(session) -> its last prompt's length

    def take(self, ids: list[int], busy: Collection[Session] = ()) -> Session:
        """The session to answer the prompt ``ids`` with (now the most recently used), never
        one of ``busy`` (sessions answering other requests now: a batch's)."""
        free = [s for s in self.sessions if s not in busy]
        session = self._extended(ids, free)
        if session is None and (len(self.sessions) < self.max_sessions or not free):
            session = self._new_session()
        elif session is None:  # the least recently used one: not a conversation just used
            session = free[0]
        if session in self.sessions:
            self.sessions.remove(session)
        self.sessions.append(session)
        self._prompts[id(session)] = len(ids)
        return session

    def trim(self) -> None:
        """Drop least recently used sessions until the caches fit ``max_bytes`` and (sessions
        made while all were busy) ``max_sessions``; the most recent one stays, whatever its
        size."""
        while len(self.sessions) > 1:
            over_bytes = self.max_bytes is not None and self.cached_bytes > self.max_bytes
            if not over_bytes and len(self.sessions) <= self.max_sessions:
                return
            self._prompts.pop(id(self.sessions.pop(0)), None)

    def _extended(self, ids: list[int], sessions: list[Session]) -> Session | None:
        """The session whose last prompt ``ids`` begins with (but for its last
        :data:`TAIL` tokens, at most half of it, where ``ids`` goes on for at least
        :data:`TAIL` more; its answer need not match) sharing the most tokens, the most
        recent of equals."""
        found, most = None, 0
        for session in sessions:
            cached = session.sequence.ids
            shared = common_prefix(cached, ids)
            prompt = min(len(cached), self._prompts.get(id(session), len(cached)))
            if shared and shared >= most and follows(cached, prompt, ids, shared):
                found, most = session, shared
        return found

    @property
    def cached_bytes(self) -> int:
        return sum(session_bytes(s) for s in self.sessions)


def follows(cached, prompt: int, ids: list[int], shared: int) -> bool:
    """Whether the request ``ids``, sharing its first ``shared`` tokens with a session's
    ``cached`` ids, whose last prompt was their first ``prompt``, continues that conversation
    (the module's rules): it extends the prompt, or resends it with another tail and a new
    turn, or grew its last message, or shares nearly all of ``cached``. A short prompt's tail
    may not be most of it: a shared BOS is no conversation."""
    if shared >= prompt:
        return True
    length = len(ids)
    if shared >= prompt - min(TAIL, prompt // 2) and length >= prompt + TAIL:
        return True
    if shared * 2 >= prompt and grew(cached[shared + 1 : prompt], ids, prompt):
        return True
    return (len(cached) - shared) * LOSS_SHARE <= shared


def grew(rest, ids: list[int], prompt: int) -> bool:
    """Whether ``ids`` is a prompt of ``prompt`` tokens with text put in where the two part:
    longer, and ending with ``rest``, the prompt's tokens after that point but the first (the
    template's end of the message and start of the answer)."""
    return len(ids) > prompt and tuple(ids[len(ids) - len(rest) :]) == tuple(rest)


def check_bounds(max_sessions: int, max_bytes: int | None) -> None:
    """ValueError for bounds no cache can keep."""
    if max_sessions < 1:
        raise ValueError(f"prompt cache size {max_sessions}: need at least 1")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"prompt cache bytes {max_bytes}: need at least 0")


def session_bytes(session: Session) -> int:
    """Bytes of a session's KV cache (its allocated capacity)."""
    return sum(a.nbytes for a in session.sequence.arrays())
