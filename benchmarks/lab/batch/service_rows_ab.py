"""Run 95b (#45): the batching service's throughput in process (no HTTP), with and without
the CPU plan's bound on a batch's rows: ``CLIENTS`` client threads send 16 MT-Bench first turns
(chat template, greedy, 64 tokens) to a ``GenerationService`` with ``--max-batch`` 8, each
taking the next prompt when its answer ends. ``ROWS=none`` runs the plan without the bound
(every member verifies its own tree), ``ROWS=8`` with it.

    ROWS=8 PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/service_rows_ab.py 4
"""

import dataclasses
import os
import sys
import threading
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()

from redrafter_mlx.backend import plan  # noqa: E402
from redrafter_mlx.cli import serve  # noqa: E402
from redrafter_mlx.core.serving.service import GenerationService, Request  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from serve_concurrency import run_clients  # noqa: E402

REQUESTS, MAX_BATCH, MAX_TOKENS = 16, 8, 64


def main() -> None:
    clients = int(sys.argv[1])
    rows = os.environ.get("ROWS")
    if rows:  # the plan the service's decoder is built with
        bound = None if rows == "none" else int(rows)
        plan.CPU_PLAN = dataclasses.replace(plan.CPU_PLAN, batch_rows=bound)
    args = serve.setup_arg_parser().parse_args([])
    setup = serve.engine_setup(args, serve.Loaded())
    service = GenerationService(setup, max_batch=MAX_BATCH, queue_size=REQUESTS)
    service.start()
    prompts = [turns[0] for turns in load_prompts(None, REQUESTS, 1)]
    lock, tokens = threading.Lock(), [0]

    def answer(i: int) -> None:
        messages = [{"role": "user", "content": prompts[i]}]
        job = service.submit(Request(messages, max_tokens=MAX_TOKENS))
        job.start(timeout=600)
        for step in job.steps(timeout=600):
            with lock:
                tokens[0] += len(step.tokens)

    wall = run_clients(REQUESTS, clients, answer)
    print(
        f"rows {rows} clients {clients} max_batch {MAX_BATCH}: {tokens[0]} tokens "
        f"{wall:.1f}s {tokens[0] / wall:.1f} tok/s"
    )
    service.close()


if __name__ == "__main__":
    main()
