"""`redrafter-mlx serve`'s prompt cache as chat clients use it: conversations of three turns,
each turn resending the model's answers as text through chat completions, one after another
and interleaved, on an attention demo model and a hybrid one (Gated DeltaNet, whose state is
kept only at some offsets). Every follow-up must find its own conversation's cache: at least
half of its prompt cached. One server per family (tiny random models: fast to load)."""

from __future__ import annotations

import pytest
from support.serving import Served, serving

from redrafter_mlx.io.demo import write_demo_model

pytestmark = pytest.mark.slow  # a real server per family (about 30 s here)
TOPICS = ["cats", "the sea", "trains", "bread", "music", "rain"]
ANSWER_TOKENS = 24  # noise to the budget: longer than the template's tail


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def chat_server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"conversations-{request.param}")
    model = write_demo_model(root / "model", family=request.param)
    args = ["--model", str(model), "--drafter", "none", "--max-tokens", str(ANSWER_TOKENS)]
    with serving(root / "server.log", *args) as served:
        yield served


def turn(served: Served, messages: list[dict]) -> tuple[str, int, int]:
    """One greedy chat turn -> (answer text, prompt tokens, cached tokens)."""
    status, _, body = served.request(
        "/v1/chat/completions", {"model": "m", "messages": messages, "temperature": 0}
    )
    assert status == 200, body
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return body["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


def converse(served: Served, order: list[tuple[str, int]]) -> list[tuple]:
    """Run ``order``'s (topic, turn) requests -> per follow-up (topic, turn, prompt tokens,
    cached tokens, its previous prompt's tokens, whether the previous answer's text can
    carry its tokens)."""
    histories = {
        topic: [{"role": "user", "content": f"Tell me about {topic}."}] for topic, _ in order
    }
    previous: dict[str, tuple[int, bool]] = {}
    follow_ups = []
    for topic, number in order:
        text, prompt, cached = turn(served, histories[topic])
        if number:
            follow_ups.append((topic, number, prompt, cached, *previous[topic]))
        # a byte-level token that is part of a character comes back as U+FFFD: lost to text
        previous[topic] = (prompt, "\ufffd" not in text)
        histories[topic] += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And more about {topic}, turn {number}?"},
        ]
    return follow_ups


def assert_each_found_its_own(follow_ups: list[tuple]) -> None:
    for topic, number, prompt, cached, last_prompt, carried in follow_ups:
        assert cached >= last_prompt, (topic, number, prompt, cached)
        if carried:  # the previous prompt, and the answer where it came back as generated
            assert 2 * cached >= prompt, (topic, number, prompt, cached)


@pytest.mark.soak
def test_six_conversations_one_after_another_each_reuse_their_own(chat_server):
    order = [(topic, number) for topic in TOPICS for number in range(3)]
    assert_each_found_its_own(converse(chat_server, order))


@pytest.mark.soak
def test_three_interleaved_conversations_each_reuse_their_own(chat_server):
    """a b c, c b a, a b c: another conversation always came between (the default cache
    keeps four)."""
    topics = ["a dragon", "a castle", "a river"]
    order = [(t, n) for n in range(3) for t in (topics if n % 2 == 0 else topics[::-1])]
    assert_each_found_its_own(converse(chat_server, order))
