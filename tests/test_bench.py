"""The benchmark harness on a tiny random model: files, fields, statistics, prompt loading."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections import Counter

import pytest
from support import make_runtime, toy_tokenizer

from redrafter_mlx.backend.plan import plan_for
from redrafter_mlx.cli import bench
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.drafters.beam_search import BeamDrafter
from redrafter_mlx.io.prompts import load_prompts
from redrafter_mlx.tuning import measure
from redrafter_mlx.tuning.measure import BenchConfig, Method, Record, Run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runtime(target, drafter):
    return make_runtime(
        target,
        toy_tokenizer(),
        {"max_position_embeddings": 4096},
        BeamDrafter(drafter, target.model.embed_tokens),
        "tiny-llama",
        "tiny-drafter",
    )


@pytest.fixture(scope="module")
def result(runtime):
    cfg = BenchConfig(
        [BeamShape(1, 2), BeamShape(2, 3)],
        [["w5 w6 w7", "w8 w9"], ["w10 w11"]],
        max_tokens=12,
        repetitions=2,
    )
    return measure.run_bench(runtime, cfg)


def test_result_fields(result):
    env = result["environment"]
    for key in (
        "device",
        "backend",
        "blas",
        "dtype",
        "quantization",
        "mlx",
        "mlx_lm",
        "model",
        "drafter",
    ):
        assert key in env
    assert env["backend"] in ("CPU", "Metal", "CUDA", "GPU")
    assert result["settings"]["cases"] == 3  # two turns + one turn
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == ["mlx-lm", "autoregressive", "W1L2", "W2L3"]
    for name in ("W1L2", "W2L3"):
        row = rows[name]
        assert row["exact"] is True  # greedy ReDrafter == autoregressive, every run
        assert row["runs"] == 6
        assert row["generation_tps"] > 0 and row["prompt_tps"] > 0
        assert row["speedup_vs_mlx-lm"] > 0 and row["speedup_vs_autoregressive"] > 0
        assert row["speedup_vs_mlx-lm_median_of_ratios"] > 0
        assert 1 <= row["tokens_per_step"] <= row["beam_length"]
        assert 0 < row["compression_p1"] <= row["compression_p99"] <= 1
        assert row["verify_cost_ratio"] > 0 and row["draft_cost_ratio"] > 0
        assert row["speedup_bound"] == pytest.approx(
            row["tokens_per_step"] / row["verify_cost_ratio"]
        )
        assert set(row["phase_fraction"]) == {"draft", "pack", "verify", "accept", "compact"}
        assert sum(row["phase_fraction"].values()) == pytest.approx(1.0)
        assert row["syncs_per_step"] == pytest.approx(1.0)
        assert row["latency_p95_ms"] >= row["latency_p50_ms"] > 0
    assert rows["autoregressive"]["tokens_per_step"] == 1.0
    assert rows["autoregressive"]["speedup_vs_autoregressive"] == pytest.approx(1.0)
    headers = [c.header for c in bench.results_table(result).columns]
    assert "x stock" not in headers and "x mlx-lm" in headers  # no kernel: no stock baseline
    assert all(row["time_to_first_token_s"] > 0 for row in rows.values())


def test_long_prompts_get_a_time_to_first_token_column(result):
    """Short prompts: no column (the JSON and CSV hold it); a median prompt of 1,024 tokens
    or more: the column, each method's median seconds to its first token."""
    assert "TTFT s" not in [c.header for c in bench.results_table(result).columns]
    long = result | {"settings": result["settings"] | {"prompt_tokens": [900, 1024, 5000]}}
    table = bench.results_table(long)
    headers = [c.header for c in table.columns]
    cells = list(table.columns[headers.index("TTFT s")].cells)
    expected = [f"{row['time_to_first_token_s']:.2f}" for row in result["results"]]
    assert cells == expected


def test_writes_json_csv_and_plots(result, tmp_path):
    paths = bench.write_outputs([result], tmp_path / "out")
    names = {p.name for p in paths}
    assert {
        "bench.json",
        "bench.csv",
        "speedup_heatmap.png",
        "speedup_heatmap_plain.png",
        "phases.png",
        "tokens_per_step.png",
    } <= names
    loaded = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert loaded["plans"][0]["results"][2]["method"] == "W1L2"
    with open(tmp_path / "out" / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["mlx-lm", "autoregressive", "W1L2", "W2L3"]
    assert {r["plan"] for r in rows} == {result["plan"]}
    assert float(rows[3]["verify_cost_ratio"]) > 0
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC


def test_stock_mlx_lm_baseline_when_the_kernel_is_loaded(runtime, monkeypatch):
    """With the small-row kernel preloaded, mlx-lm also runs with it switched off
    (``mlx-lm-stock``), interleaved like every method, and each row gets its ratio to it."""
    switched_off = []

    @contextlib.contextmanager
    def off():
        switched_off.append(True)
        yield

    monkeypatch.setattr(measure, "smallrows_loaded", lambda: True)
    monkeypatch.setattr(measure, "smallrows_off", off)
    cfg = BenchConfig([BeamShape(1, 2)], [["w5 w6 w7"]], max_tokens=8, repetitions=2)
    result = measure.run_bench(runtime, cfg)
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == ["mlx-lm", "mlx-lm-stock", "autoregressive", "W1L2"]
    assert rows["mlx-lm-stock"]["runs"] == 2 and rows["mlx-lm-stock"]["exact"] is True
    assert len(switched_off) == 3  # warm-up + two repetitions
    assert rows["W1L2"]["speedup_vs_mlx-lm-stock"] > 0
    assert rows["mlx-lm-stock"]["speedup_vs_mlx-lm-stock"] == pytest.approx(1.0)
    columns = [c.header for c in bench.results_table(result).columns]
    assert columns[2:5] == ["x plain", "x mlx-lm", "x stock"]  # our own plain loop first


def test_greedy_runs_match_across_methods(runtime):
    prompt = runtime.tokenizer.encode("w5 w6 w7")
    ar = measure.measure(runtime, Method("autoregressive"), prompt, max_tokens=16)
    rd = measure.measure(runtime, Method("redrafter", BeamShape(3, 4)), prompt, max_tokens=16)
    ref = measure.measure(runtime, Method("mlx-lm"), prompt, max_tokens=16)
    assert rd.tokens == ar.tokens
    assert len(ref.tokens) == len(ar.tokens)
    assert sum(rd.accept_histogram.values()) == rd.steps


def record(method: str, case: int, tps: float) -> Record:
    return Record(method, case, 0, Run([], "", 1, 1.0, tps, []))


def test_draft_cost_times_the_shapes_own_search(runtime):
    """The draft cost of a wide-search shape times that search (it used to time a plain
    W-beam search), to full depth whatever the floor."""
    from dataclasses import replace

    calls = []

    def drafter(context, pending, **options):
        calls.append(options)
        return runtime.drafter(context, pending, **options)

    shape = BeamShape(2, 3, min_prob=0.3, search_width=8)
    assert measure.draft_cost_ratio(replace(runtime, drafter=drafter), shape, repetitions=1) > 0
    assert calls == 2 * [{"width": 2, "length": 3, "min_prob": 0.0, "search_width": 8}]


def test_per_phase_runs_sample_like_the_measured_runs(runtime, monkeypatch):
    """With --temp the per-phase timed runs sample too, reseeded per prompt as the measured
    runs are (they used to run greedy)."""
    seen = []
    real = measure.measure

    def spy(*args, **kwargs):
        seen.append((kwargs["temp"], kwargs["seed"], kwargs["timing"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "measure", spy)
    methods = [Method(measure.AUTOREGRESSIVE), Method(measure.REDRAFTER, BeamShape(2, 3))]
    phases = measure.timed_runs(
        runtime, methods, [[5, 6, 7], [8, 9]], max_tokens=6, temp=0.7, seed=3
    )
    assert seen == [(0.7, 3, True), (0.7, 4, True)]
    assert set(phases) == {"W2L3"} and sum(phases["W2L3"].values()) > 0


def test_speedups_ratio_of_medians_and_median_of_ratios():
    records = [record("a", c, t) for c, t in enumerate([10, 20, 30])]
    records += [record("b", c, t) for c, t in enumerate([5, 20, 10])]
    sp = measure.speedups(records, "a", "b")
    assert sp["ratio_of_medians"] == pytest.approx(20 / 10)
    assert sp["median_of_ratios"] == pytest.approx(2.0)  # ratios 2, 1, 3


def test_uniform_tokens_per_second():
    events = [(0.0, [7], ""), (1.0, [1, 2, 3], ""), (2.0, [4], "")]
    tps, latencies = measure.tps_and_latencies(events)
    assert tps == pytest.approx(4 / 2.0)
    assert latencies == pytest.approx([1 / 3] * 3 + [1.0])


def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"turns": ["a", "b", "c"]}\n')
    assert load_prompts(path, None, 2) == [["hello"], ["a", "b"]]
    assert load_prompts(path, 1, 1) == [["hello"]]
    path.write_text('{"question": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        load_prompts(path, None, 1)


def test_mt_bench_is_the_default():
    convs = load_prompts(None, 3, 2)
    assert len(convs) == 3 and all(len(c) == 2 for c in convs)


def test_grid_flags(runtime):
    k = plan_for().default_shape.lookup  # the flags not given come from the default shape

    def grid(argv):
        return bench.shapes_from_args(bench.setup_arg_parser().parse_args(argv), runtime)

    assert grid(["--beam-width", "1,2", "--beam-length", "3,4,5"]) == [
        BeamShape(w, n, lookup=k) for w in (1, 2) for n in (3, 4, 5)
    ]
    assert grid(["--beam-length", "3", "--min-prob", "0,0.3"]) == [
        BeamShape(1, 3, lookup=k),
        BeamShape(1, 3, 0.3, lookup=k),
    ]
    assert grid(["--beam-width", "1,4", "--beam-length", "5", "--search-width", "1,4,16"]) == [
        BeamShape(1, 5, lookup=k),  # S <= W is the plain search, once
        BeamShape(1, 5, search_width=4, lookup=k),
        BeamShape(1, 5, search_width=16, lookup=k),
        BeamShape(4, 5, lookup=k),
        BeamShape(4, 5, search_width=16, lookup=k),
    ]
    for bad in (["--beam-width", "1,x"], ["--min-prob", "0,x"]):
        with pytest.raises(SystemExit):
            bench.setup_arg_parser().parse_args(bad)
    with pytest.raises(SystemExit):  # a floor outside [0, 1)
        bench.shapes_from_args(bench.setup_arg_parser().parse_args(["--min-prob", "1"]), runtime)
    default = bench.shapes_from_args(bench.setup_arg_parser().parse_args([]), runtime)
    assert plan_for().default_shape in default and len(set(default)) == len(default)


def test_rotation_interleaves():
    methods = [Method("a"), Method("b"), Method("c")]
    firsts = Counter(measure.rotated(methods, rep)[0].kind for rep in range(3))
    assert firsts == Counter("abc")


def test_lookup_rows_per_category_and_the_sources_of_accepted_tokens(runtime, tmp_path):
    """``--lookup 0,3``: the drafter alone, drafter + lookup, and lookup alone, all exact,
    with where the accepted tokens came from and one row per method in each category."""
    cfg = BenchConfig(
        [BeamShape(2, 3), BeamShape(2, 3, lookup=3)],
        [["w5 w6 w5 w6 w5 w6"], ["w7 w8 w7 w8"], ["w9 w10"]],
        max_tokens=16,
        repetitions=1,
        categories=["rag", "summarization", "rag"],
    )
    result = measure.run_bench(runtime, cfg)
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows) == ["mlx-lm", "autoregressive", "W2L3", "W2L3k3", "lookup-L3k3"]
    for name in ("W2L3", "W2L3k3", "lookup-L3k3"):
        assert rows[name]["exact"] is True
        assert set(rows[name]["accepted_from"]) == {"drafter", "lookup", "both"}
    assert rows["W2L3"]["accepted_from"]["lookup"] == rows["W2L3"]["accepted_from"]["both"] == 0
    alone = rows["lookup-L3k3"]
    assert alone["beam_width"] is None and alone["lookup"] == 3
    assert alone["accepted_from"]["drafter"] == alone["accepted_from"]["both"] == 0
    assert alone["draft_cost_ratio"] == 0.0
    accepted = sum(alone["accepted_from"].values())
    steps = sum(int(k) * v for k, v in alone["accept_histogram"].items())
    assert accepted == steps - sum(alone["accept_histogram"].values())  # tokens - steps
    per = result["per_category"]
    assert list(per) == ["rag", "summarization"]
    assert [r["prompts"] for r in (per["rag"][0], per["summarization"][0])] == [2, 1]
    assert [r["method"] for r in per["rag"]] == list(rows)
    for category in per.values():
        for row in category:
            assert row["tokens_per_step"] >= 1 and row["generation_tps"] > 0
    table = bench.category_table(per)
    assert [c.header for c in table.columns] == ["method", "rag (2)", "summarization (1)"]
    bench.write_outputs([result], tmp_path)
    with open(tmp_path / "bench.csv") as f:
        csv_rows = {r["method"]: r for r in csv.DictReader(f)}
    assert int(csv_rows["lookup-L3k3"]["accepted_lookup"]) == alone["accepted_from"]["lookup"]


def test_lookup_flags_make_the_grid_and_sources_read_as_percentages(runtime):
    args = bench.setup_arg_parser().parse_args(["--beam-width", "2", "--lookup", "0,4"])
    d = plan_for().default_shape
    width_two = [BeamShape(2, d.length, d.min_prob, d.search_width, k) for k in (0, 4)]
    assert bench.shapes_from_args(args, runtime) == width_two
    args = bench.setup_arg_parser().parse_args(["--lookup", "4"])
    assert {s.lookup for s in bench.shapes_from_args(args, runtime)} == {4}
    assert bench.sources_cell({"drafter": 6, "lookup": 3, "both": 1}) == "60/30/10"
    assert bench.sources_cell(None) == "-"
    with pytest.raises(SystemExit):
        bench.setup_arg_parser().parse_args(["--lookup", "-1"])


def test_prompt_categories_are_read_with_the_turns(tmp_path):
    from redrafter_mlx.io.prompts import load_conversations

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "category": "rag"}\n\n{"turns": ["b"], "category": 3}\n')
    loaded = load_conversations(path, None, 1)
    assert [(c.turns, c.category) for c in loaded] == [(["a"], "rag"), (["b"], None)]


def test_quick_measures_the_picked_shape_alone(runtime):
    args = bench.with_presets(bench.setup_arg_parser().parse_args(["--quick"]))
    assert bench.shapes_from_args(args, runtime) == [plan_for().default_shape]
    assert (args.num_prompts, args.max_tokens, args.timed_prompts) == (3, 48, 0)
    args = bench.with_presets(bench.setup_arg_parser().parse_args(["--quick", "--max-tokens", "9"]))
    assert args.max_tokens == 9 and args.repetitions == 2  # a flag given wins over the preset
    k1 = [BeamShape(1, 2, lookup=1)]
    assert [m.kind for m in measure.bench_methods(k1, lookup_alone=False)][-1] == "redrafter"
    assert measure.bench_methods(k1)[-1].kind == "lookup"
    assert measure.bench_methods(k1, drafter=False, lookup_alone=False)[-1].kind == "lookup"
    full = bench.with_presets(bench.setup_arg_parser().parse_args([]))
    assert (full.num_prompts, full.max_tokens, full.timed_prompts) == (2, 128, 1)


def test_every_column_is_explained_in_the_output_and_the_docs(result):
    """``x stock``, ``verify x``, ``bound``, ``from d/l/b`` and ``p50 ms`` were explained
    nowhere: each column shown has a line in the printed legend and in docs/usage.md."""
    from pathlib import Path

    from rich.console import Console

    every = result | {"settings": result["settings"] | {"prompt_tokens": [2048]}}
    every = every | {"results": [r | {"speedup_vs_mlx-lm-stock": 1.0} for r in result["results"]]}
    headers = [c.header for c in bench.results_table(every).columns]
    assert headers[:4] == ["method", "tok/s", "x plain", "x mlx-lm"]
    assert set(headers) == set(bench.COLUMNS)
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(bench.legend([every]))
    printed = console.export_text()
    docs = " ".join((Path(__file__).parents[1] / "docs" / "usage.md").read_text().split())
    for column, meaning in bench.COLUMNS.items():
        assert any(
            line.split() == [*column.split(), *meaning.split()] for line in printed.splitlines()
        )
        assert f"`{column}`: {meaning}" in docs, column


def test_summary_says_plainly_when_a_shape_is_slower_than_plain_decoding(result):
    rows = [dict(r) for r in result["results"]]
    by = {r["method"]: r for r in rows}
    by["W1L2"]["speedup_vs_autoregressive"], by["W1L2"]["speedup_vs_mlx-lm"] = 0.94, 1.56
    by["W2L3"]["speedup_vs_autoregressive"] = 1.2
    generic = result | {"plan": "generic", "results": rows, "picked": "W1L2"}
    lines = bench.summary([generic])
    assert lines[0] == (
        "generic plan, the code a Mac runs: W1L2 (the shape the command picks) ran 0.94x our "
        "plain loop and 1.56x mlx-lm"
    )
    assert "SLOWER than plain decoding here: W1L2 (0.94x);" in lines[1]
    assert "W2L3" not in lines[1]
    by["W1L2"]["speedup_vs_autoregressive"] = 1.01
    assert len(bench.summary([generic])) == 1


def test_the_generic_plans_child_gets_the_same_blas_without_the_cpu_plans_kernel():
    env = {
        "LD_PRELOAD": "/cache/libsmallrows-ab12.so:/usr/lib/libopenblas.so.0",
        "REDRAFTER_SMALLROWS_NEXT": "/usr/lib/libopenblas.so.0",
        "PATH": "/bin",
    }
    child = bench.generic_env(env)
    assert child["LD_PRELOAD"] == "/usr/lib/libopenblas.so.0"
    assert child["REDRAFTER_CPU_TUNING"] == "0" and child["PATH"] == "/bin"
    assert "REDRAFTER_SMALLROWS_NEXT" not in child
