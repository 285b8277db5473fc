"""`demo-model --agent`: a model coding agents can be pointed at offline."""

from __future__ import annotations

import json

from mlx_lm.tokenizer_utils import load as load_tokenizer

from redrafter_mlx.cli import main
from redrafter_mlx.io.templates import apply_chat_template, tool_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_demo_model_agent_takes_tools_and_a_long_context(tmp_path, capsys):
    plain, agent = tmp_path / "plain", tmp_path / "agent"
    main(["demo-model", "--out", str(plain)])
    main(["demo-model", "--out", str(agent), "--agent"])
    assert "tools chat template" in capsys.readouterr().out
    assert tool_format(load_tokenizer(plain)) is None  # the embedded template takes none
    tokenizer = load_tokenizer(agent)
    assert tool_format(tokenizer) is not None and tokenizer.has_tool_calling
    config = json.loads((agent / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tokenizer.decode(apply_chat_template(tokenizer, messages, tools=[WEATHER]))
    assert "get_weather" in prompt and "<tool_call>" in prompt
