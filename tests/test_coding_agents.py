"""The coding agents people point at a local server, as their users install them (npm, pinned
versions), each run once non-interactively against `redrafter-mlx serve` on a tiny random
model with a tools chat template and a 128k context (tests/support/tool_model.py): Claude Code
(Anthropic's Messages API), Codex CLI (OpenAI's Responses API), opencode, Qwen Code and
Continue's `cn` (chat completions). A run passes when the server answered every request with
a 200 and no client left mid-answer: the model's noise ends by length (the agent's own output
limit for Claude Code and Codex, which then say so and exit 1; Qwen Code's and cn's cap from
their settings).

Marked ``coding_agents`` and skipped unless ``-m`` names it: .ci/run runs them after
`make test` (npm installs take a minute the first time, into ``$REDRAFTER_NPM_CACHE`` or
~/.cache/redrafter-mlx/coding-agents, reused after). Skipped, in one line, without npm or
its registry.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import tool_model

pytestmark = pytest.mark.coding_agents

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = {  # npm package -> its command
    "@anthropic-ai/claude-code@2.1.337": "claude",
    "@openai/codex@0.171.0": "codex",
    "opencode-ai@1.18.33": "opencode",
    "@qwen-code/qwen-code@0.24.4": "qwen",
    "@continuedev/cli@1.5.47": "cn",
}
OUTPUT_TOKENS = 48  # each answer's budget: noise until then
# Qwen Code's and cn's caps in their settings: not the server's default, so seen in its log
QWEN_MAX_TOKENS = 40
CN_MAX_TOKENS = 36
RUN_SECONDS = 600


@pytest.fixture(scope="module")
def bin_dir(request) -> Path:
    """The clients' commands, installed by npm once into the cache."""
    if "coding_agents" not in request.config.getoption("markexpr"):
        pytest.skip("coding agents run only when asked: pytest -m coding_agents (.ci/run does)")
    cache = Path(
        os.environ.get("REDRAFTER_NPM_CACHE")
        or Path.home() / ".cache" / "redrafter-mlx" / "coding-agents"
    )
    stamp = cache / "installed.json"
    if stamp.exists() and json.loads(stamp.read_text()) == sorted(CLIENTS):
        return cache / "node_modules" / ".bin"
    try:
        done = subprocess.run(
            ["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", *CLIENTS],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"coding agents not tried: npm could not run ({type(e).__name__})")
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        pytest.skip(f"coding agents not tried: npm install failed ({(errors or ['?'])[0]})")
    stamp.write_text(json.dumps(sorted(CLIENTS)))
    return cache / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, log) of `serve` on the agent model; stopped after the module."""
    yield from agent_server(tmp_path_factory.mktemp("coding-agents"), "llama")


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    """(url, log) of `serve` on the agent model as a Gated DeltaNet hybrid (qwen3_5)."""
    yield from agent_server(tmp_path_factory.mktemp("coding-agents-hybrid"), "qwen3_5")


def agent_server(root: Path, family: str):
    """Yield (url, log) of `serve` on a ``family`` agent model in ``root``; stop it after."""
    model = tool_model.agent_model(root / "model", family=family)
    log = root / "server.log"
    command = [sys.executable, "-m", "redrafter_mlx", "serve", "--port", "0", "--model"]
    command += [str(model), "--drafter", "none", "--max-tokens", str(OUTPUT_TOKENS)]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 180
        while not (found := re.findall(r"Messages API at (http://[^/\s]+)", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield found[0], log
    finally:
        process.terminate()
        process.wait(timeout=30)


def run_client(command: list[str], home: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """A client run with its own home (no user's config), stdin closed."""
    home.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), **env)
    env.update(XDG_DATA_HOME=str(home / ".local/share"), XDG_CACHE_HOME=str(home / ".cache"))
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )


def served(log: Path, path: str, since: int) -> list[str]:
    """The log's lines after ``since`` characters: each ``path`` request's status, and
    the lines saying a client left or a request was refused."""
    text = log.read_text()[since:]
    statuses = re.findall(rf'"POST {re.escape(path)}\S* HTTP/1.1" (\d+)', text)
    trouble = [line for line in text.splitlines() if "client left" in line or "Traceback" in line]
    return statuses + trouble


def answered(log: Path, since: int) -> list[tuple[str, str]]:
    """(tokens, finish reason) of each chat completion the log shows after ``since``."""
    line = r"chat: \d+ prompt tokens \(\d+ cached\), (\d+) tokens, .*, (\w+)$"
    return re.findall(line, log.read_text()[since:], re.MULTILINE)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_claude_code_answers_through_the_messages_api(bin_dir, family, request, tmp_path):
    """On an attention model and a hybrid (whose recurrent state is kept only at some
    offsets): each finds Claude Code's prefix cached on its next request."""
    url, log = request.getfixturevalue("server" if family == "llama" else "hybrid_server")
    since = len(log.read_text())
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "none",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    command = [str(bin_dir / "claude"), "-p", "Say hello.", "--max-turns", "2"]
    done = run_client(command, tmp_path / "home", env, tmp_path / "work")
    results = served(log, "/v1/messages", since)
    assert results and set(results) == {"200"}, (results, done.stdout, done.stderr)
    limit = f"exceeded the {OUTPUT_TOKENS} output token maximum"
    assert done.returncode == 0 or limit in done.stdout + done.stderr, (done.stdout, done.stderr)
    # Claude Code's 12,000-token prefix is read once: the next request finds it cached
    counts = re.findall(r"messages: (\d+) prompt tokens \((\d+) cached\)", log.read_text()[since:])
    assert len(counts) >= 2, counts
    assert all(int(cached) > int(prompt) // 2 for prompt, cached in counts[1:]), counts


def test_codex_answers_through_the_responses_api(bin_dir, server, tmp_path):
    url, log = server
    since = len(log.read_text())
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "redrafter"\n\n[model_providers.redrafter]\n'
        f'name = "redrafter-mlx serve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
    )
    command = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "Say hello."]
    done = run_client(command, home, {"CODEX_HOME": str(home / ".codex")}, tmp_path / "work")
    results = served(log, "/v1/responses", since)
    assert results and set(results) == {"200"}, (results, done.stdout, done.stderr)
    said = done.stdout + done.stderr
    assert done.returncode == 0 or "reason: max_output_tokens" in said, said
    assert "stream disconnected" not in said and "error sending request" not in said, said


def test_opencode_answers_through_chat_completions(bin_dir, server, tmp_path):
    url, log = server
    since = len(log.read_text())
    home = tmp_path / "home"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": "redrafter/any-name",
        "provider": {
            "redrafter": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "redrafter-mlx serve",
                "options": {"baseURL": f"{url}/v1", "apiKey": "none"},
                "models": {"any-name": {"limit": {"context": 131072, "output": OUTPUT_TOKENS}}},
            }
        },
    }
    (home / ".config" / "opencode").mkdir(parents=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(config))
    command = [str(bin_dir / "opencode"), "run", "Say hello."]
    env = {"OPENCODE_DISABLE_AUTOUPDATE": "1"}
    done = run_client(command, home, env, tmp_path / "work")
    results = served(log, "/v1/chat/completions", since)
    assert results and set(results) == {"200"}, (results, done.stdout, done.stderr)
    assert done.returncode == 0, (done.stdout, done.stderr)


def test_qwen_code_answers_through_chat_completions_within_its_cap(bin_dir, server, tmp_path):
    """Qwen Code as docs/serving.md sets it up: its output cap in ~/.qwen/settings.json
    (without it every request asks for 32,768 tokens), the server on its command line."""
    url, log = server
    since = len(log.read_text())
    home = tmp_path / "home"
    settings = {
        "model": {
            "generationConfig": {
                "contextWindowSize": 131072,
                "samplingParams": {"max_tokens": QWEN_MAX_TOKENS},
            }
        }
    }
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    command = [str(bin_dir / "qwen"), "--auth-type", "openai", "--openai-base-url", f"{url}/v1"]
    command += ["--openai-api-key", "none", "--model", "qwen3-4b", "Say hello."]
    done = run_client(command, home, {}, tmp_path / "work")
    results = served(log, "/v1/chat/completions", since)
    assert results and set(results) == {"200"}, (results, done.stdout, done.stderr)
    # a random model's greedy noise here is newlines only: Qwen Code retries, then says so
    empty = "Model stream ended with empty response text"
    assert done.returncode == 0 or empty in done.stderr, (done.stdout, done.stderr)
    # each answer is noise up to the cap it asked for: the settings' max_tokens, not 32,768
    answers = answered(log, since)
    assert answers and all(int(n) <= QWEN_MAX_TOKENS for n, _ in answers), answers
    assert (str(QWEN_MAX_TOKENS), "length") in answers, answers


def test_continue_cli_answers_through_chat_completions_within_its_cap(bin_dir, server, tmp_path):
    """Continue's `cn` as docs/serving.md sets it up: a config file naming the server, with
    its output cap (``maxTokens``) and context."""
    url, log = server
    since = len(log.read_text())
    home = tmp_path / "home"
    config = home / ".continue" / "redrafter.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "name: redrafter-mlx serve\nversion: 0.0.1\nschema: v1\nmodels:\n"
        "  - name: qwen3-4b\n    provider: openai\n    model: qwen3-4b\n"
        f"    apiBase: {url}/v1\n    apiKey: none\n    roles: [chat, edit, apply]\n"
        "    defaultCompletionOptions:\n      contextLength: 131072\n"
        f"      maxTokens: {CN_MAX_TOKENS}\n"
    )
    command = [str(bin_dir / "cn"), "--config", str(config), "-p", "Say hello."]
    done = run_client(command, home, {}, tmp_path / "work")
    results = served(log, "/v1/chat/completions", since)
    assert results and set(results) == {"200"}, (results, done.stdout, done.stderr)
    assert done.returncode == 0, (done.stdout, done.stderr)
    answers = answered(log, since)
    assert answers and all(int(n) <= CN_MAX_TOKENS for n, _ in answers), answers
    assert (str(CN_MAX_TOKENS), "length") in answers, answers
