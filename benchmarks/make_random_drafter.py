"""Write the seeded random drafter used for benchmarks before a trained one exists.

Its drafts are essentially never accepted (about 1.0 tokens/step), so the figures it gives are
the *cost* side of ReDrafter: the overhead of drafting, packing and verifying a tree that buys
nothing. Greedy output stays exact, as with any drafter.

    .venv/bin/python benchmarks/make_random_drafter.py /tmp/rd/drafter
"""

from __future__ import annotations

import argparse

from redrafter_mlx.core.drafters.redrafter import random_drafter, save_drafter

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="/tmp/rd/drafter", help="drafter folder")
    out = parser.parse_args().out
    # SmolLM2-135M: hidden 576, vocab 49,152; the shipped drafter's cheap head shape.
    save_drafter(random_drafter(576, 49152, seed=0, head="target", draft_vocab_size=4096), out)
    print(out)
