"""`redrafter-mlx train` under `mlx.launch` (2 ranks, ring backend, localhost) against one
process: the same self-generated cache, the same training, and a resume after a killed rank.

Every process imports this checkout (``PYTHONPATH``, ``cwd``): the console script and
``mlx.launch`` on ``PATH`` may belong to another one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import shared_data, write_conversations
from support.distributed import LAUNCH, free_ports, rank_pid
from support.families import model_folder

from redrafter_mlx.cli import main
from redrafter_mlx.training.cache import Cache
from redrafter_mlx.training.ranks import Ranks
from redrafter_mlx.training.sharded import BOUNDARY, NEXT, TOKENS, cut

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = "vicuna-7b-v1.3-tokenizer"
TIMEOUT = 240


def command(ranks: int, flags: list[str]) -> list[str]:
    """``redrafter-mlx train`` alone, or under ``mlx.launch`` on ``ranks`` local ranks."""
    train = [sys.executable, "-m", "redrafter_mlx", "train", *flags]
    if ranks == 1:
        return train
    port = str(free_ports(ranks))
    launch = ["--hosts", "127.0.0.1", "-n", str(ranks), "--backend", "ring", "-p", port]
    return [sys.executable, "-c", LAUNCH, *launch, "--", *train]


def start(ranks: int, flags: list[str], logs: Path, marker: str = "") -> subprocess.Popen:
    """Start a run; its output goes to ``logs``. stdin stays an open pipe: mlx.launch
    spins a core polling a closed one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REDRAFTER_TEST_RUN": marker}
    with open(logs, "w") as out:
        return subprocess.Popen(
            command(ranks, flags), cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def run(ranks: int, flags: list[str], logs: Path) -> str:
    """Run to the end; its output."""
    proc = start(ranks, flags, logs)
    try:
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
        proc.stdin.close()
    text = logs.read_text()
    assert proc.returncode == 0, text
    assert "exited with code" not in text, text  # mlx.launch ends 0 when every rank failed
    return text


def flags(root: Path, model: Path, data: Path, name: str) -> list[str]:
    """A self-distillation run small enough for seconds: generation windows of 4 x 4
    prompts, held-out in one unit (rank 1's is empty), the training budget met inside a
    round; then 54 steps with an evaluation and checkpoint every 10, of a drafter reading a
    target layer besides the last, half its examples fed its own drafts."""
    return [
        *("--model", str(model), "--data", str(data), "--source", "self"),
        *("--out", str(root / f"out-{name}"), "--cache-dir", str(root / f"cache-{name}")),
        *("--max-seq-len", "96", "--gen-tokens", "24", "--gen-batch", "4"),
        *("--heldout", "8", "--heldout-tokens", "200", "--max-tokens", "3000"),
        *("--head", "own", "--draft-vocab", "64", "--exit-dim", "64", "--num-draft-layers", "1"),
        *("--batch-size", "32", "--epochs", "1", "--eval-every", "10", "--lr", "3e-3"),
        *("--patience", "100", "--seed", "0", "--quiet", "--json"),
        *("--context-layers", "0", "--own-drafts", "0.5"),  # a layered drafter, own drafts
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run in one process and on two ranks: ``(root, flags of each)``."""
    root = tmp_path_factory.mktemp("dist")
    model = model_folder("llama", root / "model", shared_data(TOKENIZER))
    write_conversations(root / "data.json", 160, seed=1)
    one, two = (
        flags(root, model, root / "data.json", "one"),
        flags(root, model, root / "data.json", "two"),
    )
    run(1, one, root / "one.log")
    out = run(2, two, root / "two.log")
    assert out.count('"best"') == 1, out  # rank 0 alone prints the result
    return root, one, two


def log(root: Path, name: str) -> list[dict]:
    return [
        json.loads(x)
        for x in (root / f"out-{name}" / "train_log.jsonl").read_text().split("\n")
        if x
    ]


def weights(root: Path, name: str) -> dict[str, np.ndarray]:
    saved = mx.load(str(root / f"out-{name}" / "checkpoint" / "model.safetensors"))
    return {k: np.array(v) for k, v in saved.items()}


def assert_same_cache(first: Path, second: Path) -> None:
    """Both caches hold the same records in the same order (however they are sharded)."""
    one, two = Cache.existing(first), Cache.existing(second)
    assert one.manifest["next"] == two.manifest["next"]
    for split in ("heldout", "train"):
        a, b = one.load(split), two.load(split)
        assert set(a) == set(b) and a["tokens"].shape == b["tokens"].shape
        for key in ("tokens", "mask", "doc", "argmax", "hidden", "taps"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{split} {key}")


def test_two_ranks_generate_the_cache_one_process_does(runs):
    root, _, _ = runs
    assert_same_cache(root / "cache-one", root / "cache-two")
    one, two = Cache.existing(root / "cache-one"), Cache.existing(root / "cache-two")
    assert len(two.manifest["shards"]) > len(one.manifest["shards"])  # a shard per unit
    assert one.tokens("train") >= 3000 and one.tokens("heldout") >= 200


@pytest.mark.slow  # two more launches: about 30 s here
def test_two_ranks_teacher_force_the_cache_one_process_does(runs):
    """--source data: units of 32 conversations, every record a boundary (the budget is met
    inside rank 1's unit of the second round)."""
    root, one, _ = runs

    def teacher(name: str) -> list[str]:
        flags = [f.replace("cache-one", f"cache-{name}") for f in one]
        flags[flags.index("self")] = "data"
        flags[flags.index("--max-tokens") + 1] = "10500"
        return [*flags, "--extract-only"]

    run(1, teacher("tf1"), root / "tf1.log")
    run(2, teacher("tf2"), root / "tf2.log")
    assert_same_cache(root / "cache-tf1", root / "cache-tf2")
    assert 3 * 32 < Cache.existing(root / "cache-tf2").manifest["next"]["train"] < 4 * 32


def test_two_ranks_train_what_one_process_trains(runs):
    """The same global batches; each rank's slice loss is divided by half the batch's
    weight, so the averaged gradient is the whole batch's up to float32 summation order
    (measured here: weights within 1.2e-7 after these 54 steps and 7e-7 after 216, losses
    within 1e-7 relative)."""
    root, _, _ = runs
    one, two = log(root, "one"), log(root, "two")
    assert [e["step"] for e in one] == [e["step"] for e in two] == [10, 20, 30, 40, 50, 54]
    assert {e["ranks"] for e in one} == {1} and {e["ranks"] for e in two} == {2}
    assert all(e["exchange_ms_per_step"] > 0 for e in two)
    np.testing.assert_allclose([e["loss"] for e in two], [e["loss"] for e in one], rtol=1e-6)
    assert [e["agreement"] for e in two] == [e["agreement"] for e in one]
    a, b = weights(root, "one"), weights(root, "two")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=5e-6, err_msg=name)


@pytest.mark.slow  # two more launches: about 45 s here
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
@pytest.mark.soak
def test_a_rank_killed_mid_training_resumes_to_the_uninterrupted_result(runs):
    """SIGKILL rank 1 right after the first checkpoint (mlx.launch then ends rank 0); the
    checkpoint stays whole and ``--resume`` ends where the uninterrupted run did, exactly."""
    root, _, two = runs
    again = [f.replace("out-two", "out-kill") for f in two]  # the cache is complete: reused
    marker = uuid.uuid4().hex
    proc = start(2, again, root / "kill.log", marker)
    state = root / "out-kill" / "checkpoint" / "state.json"
    deadline = time.monotonic() + TIMEOUT
    try:
        while not state.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                root / "kill.log"
            ).read_text()
            time.sleep(0.02)
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
        proc.stdin.close()
    killed = json.loads(state.read_text())["step"]
    assert 10 <= killed < 54, "the run ended before the kill"
    assert "rank 1" in (root / "kill.log").read_text()
    run(2, [*again, "--resume"], root / "resume.log")

    def same(entries):
        return [
            {k: v for k, v in e.items() if k not in ("seconds", "exchange_ms_per_step")}
            for e in entries
        ]

    assert same(log(root, "kill")) == same(log(root, "two"))
    a, b = weights(root, "two"), weights(root, "kill")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not list((root / "out-kill").glob(".checkpoint.*"))  # no staged leftovers


def units(*records: list[tuple[int, int, bool]]) -> np.ndarray:
    """A round's record tables ``(N, U, 4)`` from each unit's (tokens, next, boundary)."""
    table = np.zeros((len(records), 4, 4), np.int64)
    for r, unit in enumerate(records):
        for k, (tokens, nxt, boundary) in enumerate(unit):
            table[r, k, [TOKENS, NEXT, BOUNDARY]] = (tokens, nxt, boundary)
            table[r, k, 3] = 100 * tokens  # bytes
    return table


def test_a_round_is_cut_where_one_process_would_stop():
    # --source self: a unit's only boundary is its last record (a whole window)
    windows = units([(10, 4, 0), (10, 4, 0), (10, 4, 1)], [(10, 8, 0), (10, 8, 1)], [])
    ends = [4, 8, 12]
    assert cut(windows, ends, have=0, budget=35, nbytes=0, limit=1e9) == ([3, 2, 0], True, 8)
    assert cut(windows, ends, have=0, budget=99, nbytes=0, limit=1e9) == ([3, 2, 0], False, 12)
    # the budget is met inside unit 0's window: the window is kept whole, as one process does
    assert cut(windows, ends, have=0, budget=15, nbytes=0, limit=1e9) == ([3, 0, 0], True, 4)
    # --source data: every record is a boundary, so a unit is cut mid-way
    convs = units([(10, 1, 1), (10, 2, 1)], [(10, 5, 1), (10, 7, 1)])
    assert cut(convs, [4, 8], have=5, budget=30, nbytes=0, limit=1e9) == ([2, 1], True, 5)
    # --cache-max-gb: after the first unit that reaches it; a rerun starts after that unit
    assert cut(convs, [4, 8], have=0, budget=99, nbytes=0, limit=1500) == ([2, 0], True, 4)


class RankOneOfTwo:
    """The group of rank 1 of 2, for what a rank does before any exchange."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


def test_a_failing_rank_names_itself_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(Ranks, "launched", classmethod(lambda cls: cls(RankOneOfTwo())))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--batch-size", "33", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 1
    assert capsys.readouterr().err == (
        "error: rank 1 of 2: --batch-size 33 does not split over 2 ranks: use a multiple of 2\n"
    )
