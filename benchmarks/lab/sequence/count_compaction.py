"""How many speculative steps move accepted K/V (run 93): the default decoding of the
embedded model over the first 4 Spec-Bench dev prompts, 96 tokens each, counting the steps
whose accepted nodes were not already after the prefix (``speculative.accepted_nodes``)."""

from __future__ import annotations

import json
from pathlib import Path

from redrafter_mlx import generate, load  # first: it preloads the CPU kernels
from redrafter_mlx.core.decode import speculative

PROMPTS = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "specbench_dev.jsonl"


def main() -> None:
    counts = {"moved": 0, "in_place": 0}
    real = speculative.accepted_nodes

    def counted(*args):
        nodes = real(*args)
        counts["moved" if nodes is not None else "in_place"] += 1
        return nodes

    speculative.accepted_nodes = counted
    model, tokenizer = load()
    for line in PROMPTS.read_text().splitlines()[:4]:
        generate(model, tokenizer, prompt=json.loads(line)["turns"][0], max_tokens=96)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
