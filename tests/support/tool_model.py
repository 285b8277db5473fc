"""A tiny model that calls a tool: no model here emits tool calls by itself, so this one is
overfit for a few seconds on two turns rendered by a Qwen/Hermes-style chat template:

1. the user asks for the weather in Paris, the weather tool offered -> the template's own
   rendering of an assistant turn calling ``get_weather({"city": "Paris"})``;
2. the same, with that call and its result fed back -> a final answer.

The tokenizer is the embedded SmolLM2's (its files, a real BPE vocabulary) with the template
below, in which mlx-lm finds its ``json_tools`` parser (``<tool_call>`` and
``tool_call.name``). What the model learns is what the template renders for a call, so the
server's parsing is tested on real template output.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from redrafter_mlx.io.demo import AGENT_TEMPLATE
from support import tiny_llama
from support.families import save

TEMPLATE = AGENT_TEMPLATE  # the package's own: demo-model --agent writes it

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris"}
RESULT = "sunny, 22 C"
FINAL = "It is sunny in Paris, 22 C."


def called(call_id: str = "call_1") -> dict:
    """The assistant turn that calls the tool, as the server hands it to the template."""
    function = {"name": "get_weather", "arguments": ARGUMENTS}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def answered(call_id: str = "call_1") -> list[dict]:
    """The conversation after the call's result came back."""
    return [
        *QUESTION,
        called(call_id),
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


def build(out: Path, embedded: Path, *, seconds: float = 20.0) -> Path:
    """The tiny model's folder: overfit until it answers both turns, at most ``seconds``."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from redrafter_mlx.io.templates import apply_chat_template

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(embedded / name, out / name)
    config = json.loads((embedded / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    tokenizer = load_tokenizer(out)
    assert tokenizer.has_tool_calling, "mlx-lm found no tool parser in the template"
    turns = [
        (QUESTION, called()),
        (answered(), {"role": "assistant", "content": FINAL}),
    ]
    rows = []
    for messages, reply in turns:
        prompt = apply_chat_template(tokenizer, messages, tools=[WEATHER])
        whole = apply_chat_template(
            tokenizer, [*messages, reply], tools=[WEATHER], add_generation_prompt=False
        )
        assert whole[: len(prompt)] == prompt
        end = whole.index(tokenizer.eos_token_id, len(prompt)) + 1  # the reply, its EOS
        rows.append((whole[:end], len(prompt)))
    model = tiny_llama(vocab=tokenizer.vocab_size, hidden=64, layers=2, tie=True, scale=1.0)
    fit(model, rows, seconds)
    cfg = {**dict(vars(model.args)), "architectures": ["LlamaForCausalLM"], "eos_token_id": 2}
    cfg["max_position_embeddings"] = 2048
    return save(model, cfg, out)


def fit(model, rows: list[tuple[list[int], int]], seconds: float) -> None:
    """Adam on the replies' tokens (a prompt's own tokens are not learned) until each
    reply is the greedy continuation of its prompt over the whole vocabulary, or
    ``seconds`` pass. The loss's softmax runs over the tokens the turns use only (the
    49152-row head would take most of the time): the other rows stay small at random."""
    width = max(len(ids) for ids, _ in rows)
    tokens = mx.array([ids + [0] * (width - len(ids)) for ids, _ in rows])
    weights = mx.array(
        [[float(start <= i < len(ids)) for i in range(1, width)] for ids, start in rows]
    )
    used = sorted({t for ids, _ in rows for t in ids} | {0})
    index = {t: i for i, t in enumerate(used)}
    targets = mx.array([[index[t] for t in row] for row in tokens[:, 1:].tolist()])
    used = mx.array(used)

    def loss(model):
        hidden = model.model(tokens[:, :-1])
        logits = hidden @ model.model.embed_tokens.weight[used].T
        losses = nn.losses.cross_entropy(logits, targets, reduction="none")
        return (losses * weights).sum() / weights.sum()

    optimizer = optim.Adam(learning_rate=3e-3)
    step = nn.value_and_grad(model, loss)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(10):
            _, grads = step(model)
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state)
        if learned(model, tokens, weights):
            return
    raise AssertionError(f"the tool model did not learn its replies in {seconds} s")


def learned(model, tokens: mx.array, weights: mx.array, margin: float = 2.0) -> bool:
    """Every reply token is the model's greedy choice after its prefix, by ``margin`` over
    every other token of the vocabulary (a bare win could flip in the server's forward,
    whose float32 sums run in another order)."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:, None]
    wanted = mx.take_along_axis(logits, targets, axis=-1)[..., 0]
    others = mx.put_along_axis(logits, targets, mx.array(-mx.inf), axis=-1).max(axis=-1)
    return not ((wanted - others < margin) * weights).any().item()


def agent_model(out: Path, *, family: str = "llama") -> Path:
    """``demo-model --agent``'s folder (random weights, a tools chat template, a 128K context):
    what the coding agents' test points them at."""
    from redrafter_mlx.io.demo import write_demo_model

    return write_demo_model(out, family=family, force=True, agent=True)
