"""Run 121 (#45): where the batching service's time goes, in process (no HTTP): ``CLIENTS``
client threads send 16 MT-Bench first turns (chat template, greedy, 64 tokens) to a
``GenerationService`` with ``--max-batch`` 8 (or ``MAX_BATCH``); the scheduler's prompt
chunks and batch steps are timed, batch steps counted by their members, and each request's
prompt and cached tokens listed.

    PYTHONPATH=. .venv/bin/python benchmarks/lab/batch/service_profile.py 4
"""

import collections
import sys
import threading
import time
from pathlib import Path

from redrafter_mlx.backend.cpu.blas import reexec_with_blas

reexec_with_blas()  # before MLX is imported: OpenBLAS and the small-row kernel

from redrafter_mlx.cli import serve  # noqa: E402
from redrafter_mlx.core.serving import scheduler  # noqa: E402
from redrafter_mlx.core.serving.service import GenerationService, Request  # noqa: E402
from redrafter_mlx.io.prompts import load_prompts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from serve_concurrency import run_clients  # noqa: E402

REQUESTS, MAX_TOKENS = 16, 64
seconds: collections.Counter = collections.Counter()
members: collections.Counter = collections.Counter()  # batch steps by their members


def timed(name: str, method):
    def wrapper(self, *args):
        tic = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            seconds[name] += time.perf_counter() - tic

    return wrapper


def counted(step):
    def wrapper(decoder, batch):
        tic = time.perf_counter()
        try:
            return step(decoder, batch)
        finally:
            seconds[f"batch steps of {len(batch)}"] += time.perf_counter() - tic
            members[len(batch)] += 1

    return wrapper


def main() -> None:
    clients = int(sys.argv[1])
    max_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    scheduler.batch_step = counted(scheduler.batch_step)
    for name in ("_prefill_chunk", "_step"):
        setattr(scheduler.Scheduler, name, timed(name, getattr(scheduler.Scheduler, name)))
    args = serve.setup_arg_parser().parse_args([])
    setup = serve.engine_setup(args, serve.Loaded())
    service = GenerationService(setup, max_batch=max_batch, queue_size=REQUESTS)
    service.start()
    prompts = [turns[0] for turns in load_prompts(None, REQUESTS, 1)]
    lock, tokens, started = threading.Lock(), [0], []

    def answer(i: int) -> None:
        job = service.submit(Request([{"role": "user", "content": prompts[i]}], MAX_TOKENS))
        first = job.start(timeout=600)
        with lock:
            started.append((first.prompt_tokens, first.cached_tokens))
        for step in job.steps(timeout=600):
            with lock:
                tokens[0] += len(step.tokens)

    seconds.clear()
    members.clear()
    wall = run_clients(REQUESTS, clients, answer)
    print(
        f"clients {clients} max_batch {max_batch}: {tokens[0]} tokens {wall:.1f}s "
        f"{tokens[0] / wall:.1f} tok/s"
    )
    for name, value in sorted(seconds.items()):
        print(f"  {name:22s} {value:6.2f} s")
    print(f"  batch steps by members {dict(sorted(members.items()))}")
    prompt, cached = sum(p for p, _ in started), sum(c for _, c in started)
    print(f"  prompt tokens {prompt}, from the cache {cached}: {started}")
    service.close()


if __name__ == "__main__":
    main()
