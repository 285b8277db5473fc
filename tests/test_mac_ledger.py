"""benchmarks/mac_ledger.py: the tracer counts what it says it counts, and the ledger's cheapest
mode on tiny models gives a table whose invariants hold."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mac_ledger as ml  # noqa: E402
from ledger_trace import Tracer  # noqa: E402

from redrafter_mlx.core.drafters.beam_search import BeamDrafter  # noqa: E402


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _step(tracer: Tracer, fn):
    tracer.begin()
    fn()
    return tracer.end()


def test_a_fast_op_counts_as_one_kernel_and_views_as_none():
    x, w = mx.ones((2, 64)), mx.ones((64,))
    mx.eval(x, w)
    with Tracer(count_kernels=True) as tracer:
        norm = _step(tracer, lambda: mx.eval(mx.fast.rms_norm(x, w, 1e-5)))
        shaped = _step(tracer, lambda: mx.eval((x @ x.T).reshape(-1)))
    assert norm.fast_calls == 1 and norm.primitives > 1  # the CPU fallback's several
    assert norm.kernels == 1
    assert shaped.by_primitive["Matmul"] == 1 and shaped.by_primitive["Reshape"] == 1
    assert shaped.kernels == 1  # the matmul; the transpose and the reshape are views


def test_a_read_after_its_eval_is_no_second_sync():
    x = mx.arange(4)
    with Tracer() as tracer:

        def read_twice():
            y = x + 1
            mx.eval(y)
            np.array(y)  # a copy: evaluated already
            (x * 2).tolist()  # a fresh graph: a sync of its own

        counts = _step(tracer, read_twice)
    assert (counts.syncs, counts.evals) == (2, 1)


def test_host_work_while_dispatched_work_is_outstanding_is_overlapped():
    x = mx.ones((8,))
    with Tracer() as tracer:

        def pipelined():
            y = (x * 3).sum()
            mx.async_eval(y)
            _busy(0.02)  # builds the next step while the device computes
            y.item()

        counts = _step(tracer, pipelined)
    assert counts.overlapped_s >= 0.018
    assert counts.exposed_s < 0.01
    assert counts.syncs == 1 and counts.async_evals == 1


@pytest.fixture(scope="module")
def entries(target, drafter):
    drafters = {
        "rnn": BeamDrafter(drafter, target.model.embed_tokens),
        "lm_draft": ml.stand_in_draft(target, 1),
    }
    prompts = [list(range(3, 30 + i)) for i in range(ml.BATCH)]
    rows = [r for r in ml.ROWS if r.drafter in (None, "rnn", "lm_draft")]
    found = ml.ledger(target, drafters, prompts, rows, warm=2, reps=2, counted=1)
    units = ml.sizes(target), ml.param_bytes(drafter, ml.ids(target))
    return {e["row"]: e for e in found}, units


def test_every_row_is_measured_and_consistent(entries):
    rows, _ = entries
    assert set(rows) == {r.name for r in ml.ROWS if r.drafter in (None, "rnn", "lm_draft")}
    for e in rows.values():
        assert e["syncs"] >= 1 and e["tokens_per_step"] >= 1
        assert 0 < e["kernels"] <= e["primitives"]
        assert min(e["exposed_ms"], e["overlapped_ms"], e["wall_ms_here"]) >= 0
    for name in ("batch of 4, plain", "mlx-lm BatchGenerator, 4"):
        assert rows[name]["tokens_per_step"] == ml.BATCH


def test_bytes_follow_parameter_sizes_and_cache_lengths(entries):
    rows, (unit, drafter_bytes) = entries
    plain, tree = rows["plain"], rows["tree W2 L4"]
    assert plain["weight_mb"] == pytest.approx(unit.target / 1e6, abs=0.01)
    # a W2 L4 tree drafts 3 depths: the drafter's weights read once per depth
    assert tree["weight_mb"] == pytest.approx((unit.target + 3 * drafter_bytes) / 1e6, abs=0.01)
    assert plain["kv_mb"] == pytest.approx(unit.kv_token * plain["context"] / 1e6, abs=0.01)
    batch = rows["batch of 4, plain"]
    assert batch["kv_mb"] == pytest.approx(unit.kv_token * batch["context"] / 1e6, abs=0.01)


def test_pipelined_loops_hide_their_host_work(entries):
    rows, _ = entries
    for name in ("plain", "mlx-lm generate_step"):
        assert rows[name]["exposed_ms"] < rows[name]["overlapped_ms"]


def test_the_prediction_grows_with_bandwidth_and_is_labelled(entries):
    rows, _ = entries
    for e in rows.values():
        tps = ml.predict(e, ml.DISPATCH_US)
        by_bandwidth = sorted(ml.CHIPS, key=lambda c: ml.CHIPS[c][0])
        values = [tps[c] for c in by_bandwidth]
        assert values == sorted(values) and values[0] > 0
    report = {"ledger": {"float": []}, "dispatch_us": ml.DISPATCH_US}
    for e in rows.values():
        report["ledger"]["float"].append({**e, "predicted_tokens_per_s": ml.predict(e, 5.0)})
    assert "PREDICTED" in ml.table(report)


def test_the_command_refuses_the_cpu_plan(monkeypatch, tmp_path):
    monkeypatch.setenv("REDRAFTER_CPU_TUNING", "1")
    monkeypatch.setattr(sys, "argv", ["mac_ledger.py", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        ml.main()
    assert not (tmp_path / "x.json").exists()


def test_a_float16_row_is_derived_from_a_float32_one(entries):
    rows, _ = entries
    floats = [dict(e) for e in rows.values()]
    report = ml.predicted({"dtype": {"float": "float32"}, "ledger": {"float": floats}}, 5.0)
    for e32, e16 in zip(report["ledger"]["float"], report["ledger"]["f16 (derived)"], strict=True):
        assert e16["weight_mb"] == pytest.approx(e32["weight_mb"] / 2, abs=0.01)
        assert (e16["kernels"], e16["exposed_ms"]) == (e32["kernels"], e32["exposed_ms"])
        for chip in ml.CHIPS:  # half the bytes: never slower
            assert e16["predicted_tokens_per_s"][chip] >= e32["predicted_tokens_per_s"][chip]


def test_a_quantized_targets_drafter_reads_head_rows_in_its_own_dtype():
    """A ``head: "target"`` drafter scores with its own copy of the target's head rows, made
    float by ``bind_target``: quantizing the target does not shrink what each depth reads."""
    import mlx.nn as nn
    from support import tiny_llama

    from redrafter_mlx.core.drafters.redrafter import random_drafter

    target = tiny_llama(seed=2)
    nn.quantize(target, group_size=32, bits=4)
    drafter = random_drafter(64, 64, head="target")
    drafter.bind_target(target)
    rnn = BeamDrafter(drafter, target.model.embed_tokens)
    parts = ml.drafter_parts(target, {"rnn": rnn}, ml.stand_in_draft(target, 1), ml.NUM_DRAFT)
    assert parts["rnn"][1] == drafter._target_rows.nbytes == 64 * 64 * 4
