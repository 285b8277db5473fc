"""A target sharded over 2 ranks (``mlx.launch``, ring backend, localhost) decodes what one
process decodes: tensor and pipeline parallel (a tiny Qwen2, which mlx-lm splits both ways),
greedy with drafter beams, with lookup beams alone and autoregressive; seeded sampling the same
on every rank; `serve` answers on two ranks; and a killed rank ends the run.

Every process imports this checkout (``PYTHONPATH``, ``cwd``).
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support import shared_data
from support.distributed import LAUNCH, free_ports, rank_pid
from support.families import model_folder

from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240
CHAT = ["--beam-width", "2", "--beam-length", "3", "--max-tokens", "12"]


def launched(ranks: int, argv: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, *argv]
    port = str(free_ports(ranks))
    launch = ["--hosts", "127.0.0.1", "-n", str(ranks), "--backend", "ring", "-p", port]
    return [sys.executable, "-c", LAUNCH, *launch, "--", sys.executable, *argv]


def env(marker: str = "") -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "REDRAFTER_TEST_RUN": marker}


def run(ranks: int, argv: list[str]) -> str:
    """Run to the end: its stdout (stdout and stderr checked). stdin stays an open pipe:
    mlx.launch spins a core polling a closed one."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            launched(ranks, argv), cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=out,
            stderr=err, text=True,
        )  # fmt: skip
        try:
            proc.wait(TIMEOUT)
        finally:
            proc.kill()
            proc.stdin.close()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    text = stdout + stderr
    assert proc.returncode == 0 and "Traceback" not in text and "WARN" not in text, text
    return stdout


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Qwen2 (SentencePiece tokenizer, ChatML template) and a random drafter."""
    root = tmp_path_factory.mktemp("shard")
    model = model_folder("qwen2", root / "model", shared_data("vicuna-7b-v1.3-tokenizer"))
    config = json.loads((model / "config.json").read_text())
    save_drafter(random_drafter(config["hidden_size"], config["vocab_size"], seed=1), root / "d")
    return root, model, root / "d"


def test_two_ranks_decode_what_one_process_decodes(folders):
    """Both shardings in one launch; the one-process answers in this process."""
    import shard_worker

    from redrafter_mlx.io.runtime import load_runtime

    root, model, drafter = folders
    one = shard_worker.lead(load_runtime(str(model), str(drafter), need_drafter=True))
    worker = str(ROOT / "tests" / "shard_worker.py")
    run(2, [worker, str(model), str(drafter), "tensor,pipeline", str(root)])
    for sharding in ("tensor", "pipeline"):
        lead = json.loads((root / f"rank0-{sharding}.json").read_text())
        follower = json.loads((root / f"rank1-{sharding}.json").read_text())
        greedy = {k: v for k, v in one.items() if not k.startswith("sampled")}
        assert {k: lead[k] for k in greedy} == greedy, sharding
        # rank 1 decoded every answer rank 0 did, the stopped one to its end
        answers = list(lead.values())
        stopped = list(lead).index("stopped")
        assert len(follower) == len(answers)
        assert follower[stopped][:3] == answers[stopped] and len(follower[stopped]) == 12
        assert [a for i, a in enumerate(follower) if i != stopped] == [
            a for i, a in enumerate(answers) if i != stopped
        ], sharding
        assert lead["sampled"] != lead["drafter"]  # it did sample
    assert len(set(map(tuple, one.values()))) > 3  # the cases differ


def in_process(argv: list[str], capsys, monkeypatch, stdin: str = "") -> str:
    """One process's stdout, the command run here (no process to start)."""
    from redrafter_mlx.cli import main

    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    main(argv)
    return capsys.readouterr().out


def test_generate_on_two_ranks_prints_one_answer_the_one_process_answer(
    folders, capsys, monkeypatch
):
    _, model, drafter = folders
    argv = ["generate", "--model", str(model), "--drafter", str(drafter)]
    argv += [*CHAT, "--lookup", "1", "--prompt", "Hello there", "--json"]
    one = json.loads(in_process(argv, capsys, monkeypatch))
    out = run(2, ["-m", "redrafter_mlx", *argv, "--shard", "pipeline"]).strip().splitlines()
    assert len(out) == 1  # rank 0 alone prints
    assert json.loads(out[0])["tokens"] == one["tokens"]
    assert one["steps"] < len(one["tokens"])  # drafts were accepted


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
@pytest.mark.soak
def test_chat_on_two_ranks_then_a_killed_rank_ends_the_run(folders, tmp_path, capsys, monkeypatch):
    """Rank 0 reads the lines and answers as one process does; SIGKILL rank 1 and the run
    ends (mlx.launch ends rank 0) with a line naming it, no traceback."""
    _, model, drafter = folders
    argv = ["chat", "--model", str(model), "--drafter", str(drafter), *CHAT]
    expected = in_process(argv, capsys, monkeypatch, stdin="Hello there\n")
    argv = ["-m", "redrafter_mlx", *argv]
    marker, log = uuid.uuid4().hex, tmp_path / "chat.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            launched(2, [*argv, "--shard", "tensor"]), cwd=ROOT, env=env(marker),
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        proc.stdin.write("Hello there\n")
        proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT
        while expected.strip() not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        proc.wait(60)  # it ends by itself, nobody closed its input
    finally:
        proc.kill()
        proc.stdin.close()
    text = log.read_text()
    assert "rank 1" in text and "Traceback" not in text, text


def wrapped(ranks: int, argv: list[str]) -> list[str]:
    """``redrafter-mlx launch`` (mlx.launch with an exit status) of ``argv`` on ``ranks``."""
    port = str(free_ports(ranks))
    launch = ["--hosts", "127.0.0.1", "-n", str(ranks), "--backend", "ring", "-p", port]
    return [sys.executable, "-m", "redrafter_mlx", "launch", *launch, "--", sys.executable, *argv]


RANK_1_FAILS = (
    "import os, sys, time; time.sleep(0 if os.environ['MLX_RANK'] == '1' else 60); sys.exit(3)"
)


def test_a_failed_rank_makes_launch_exit_non_zero_where_mlx_launch_exits_0():
    """mlx.launch ends the other ranks when one fails, then exits 0 itself: a script reads the
    failure as success. `redrafter-mlx launch` exits with the failed rank's status."""
    statuses = []
    for command in (wrapped(2, ["-c", RANK_1_FAILS]), launched(2, ["-c", RANK_1_FAILS])):
        done = subprocess.run(
            command, cwd=ROOT, env=env(), input="", capture_output=True, text=True, timeout=120
        )
        assert "Node with rank 1 exited with code 3" in done.stderr, done.stderr
        statuses.append(done.returncode)
    assert statuses == [3, 0]  # ours, mlx.launch's


def test_shard_outside_a_launched_group_says_it_runs_as_one_process(folders, capsys, monkeypatch):
    _, model, drafter = folders
    argv = ["generate", "--model", str(model), "--drafter", str(drafter), *CHAT]
    argv += ["--prompt", "Hello there", "--json"]
    one = in_process(argv, capsys, monkeypatch)
    sharded = in_process([*argv, "--shard", "tensor"], capsys, monkeypatch)
    assert json.loads(sharded)["tokens"] == json.loads(one)["tokens"]
    from redrafter_mlx.cli import main

    main([*argv, "--shard", "pipeline"])
    notes = [x for x in capsys.readouterr().err.splitlines() if "one process" in x]
    assert notes == [
        "note: --shard pipeline: one process (not started by mlx.launch or redrafter-mlx "
        "launch), so the whole model loads and runs here"
    ]


@pytest.mark.slow  # a launch of two ranks and a chat: about 35 s here
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
@pytest.mark.soak
def test_a_hung_rank_ends_every_rank_with_a_line_naming_it_and_a_failed_status(
    folders, tmp_path, capsys, monkeypatch
):
    """SIGSTOP rank 1 of a chat (alive, not answering: the others used to wait for it for
    ever): rank 0 hears no heartbeat for --rank-timeout seconds, says so naming rank 1, ends
    it (a stopped process ignores the launcher's SIGTERM) and the launch exits non-zero."""
    _, model, drafter = folders
    argv = ["chat", "--model", str(model), "--drafter", str(drafter), *CHAT]
    expected = in_process(argv, capsys, monkeypatch, stdin="Hello there\n")
    argv = ["-m", "redrafter_mlx", *argv, "--shard", "tensor", "--rank-timeout", "2"]
    marker, log = uuid.uuid4().hex, tmp_path / "chat.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            wrapped(2, argv), cwd=ROOT, env=env(marker), stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    stopped = None
    try:
        proc.stdin.write("Hello there\n")
        proc.stdin.flush()
        deadline = time.monotonic() + TIMEOUT
        while expected.strip() not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        stopped = rank_pid(marker, 1)
        os.kill(stopped, signal.SIGSTOP)
        proc.wait(60)  # ends by itself, its input still open
    finally:
        proc.kill()
        proc.stdin.close()
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode != 0, text
    line = "error: rank 0 of 2: rank 1 has not answered for 2 s (stopped or hung; --rank-timeout)"
    assert line in text and "Traceback" not in text, text


@pytest.mark.slow  # a launch of two ranks serving: 80 s to over 3 min here
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
@pytest.mark.soak
def test_serve_on_two_ranks_with_the_default_max_batch_answers_then_stops_cleanly(
    folders, tmp_path, capsys, monkeypatch
):
    """`launch -- serve --shard tensor` with the default --max-batch (8) used never to say
    "serving": rank 0 warmed up batch steps the other rank never joined. It serves one
    request at a time, says so once, answers as `generate` does, and SIGTERM to rank 0 ends
    every rank (the launch exits 0)."""
    _, model, drafter = folders
    folders_args = ["--model", str(model), "--drafter", str(drafter), *CHAT[:4]]
    argv = ["generate", *folders_args, "--max-tokens", "12", "--prompt", "Hello there", "--json"]
    one = json.loads(in_process(argv, capsys, monkeypatch))
    serve = ["-m", "redrafter_mlx", "serve", *folders_args, "--port", "0", "--shard", "tensor"]
    marker, log = uuid.uuid4().hex, tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            wrapped(2, serve), cwd=ROOT, env=env(marker), stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline, url = time.monotonic() + TIMEOUT, None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            found = re.findall(r"serving the OpenAI API at (http://[^/\s]+)", log.read_text())
            url = found[0] if found else None
            time.sleep(0.1)
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12}
        conn.request("POST", "/v1/chat/completions", json.dumps(body))
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        os.kill(rank_pid(marker, 0), signal.SIGTERM)
        proc.wait(60)  # rank 0 stops rank 1, and the launch ends
    finally:
        proc.kill()
        proc.stdin.close()
    text = log.read_text()
    assert response.status == 200, answer
    assert answer["choices"][0]["message"]["content"] == one["text"]
    note = "note: --shard tensor: requests are answered one at a time (--max-batch 1"
    assert text.count(note) == 1, text
    assert proc.returncode == 0 and "Traceback" not in text and "stopped" in text, text
