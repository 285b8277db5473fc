"""Prompt sets shipped with the package.

``mt_bench.jsonl``: the 80 MT-Bench questions (two user turns each) of FastChat's LLM judge
(Apache-2.0), the default prompts of ``bench`` and ``eval-drafter``. Benchmark only: never
train or tune on them.
"""

from pathlib import Path

MT_BENCH = Path(__file__).with_name("mt_bench.jsonl")
