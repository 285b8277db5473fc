"""`redrafter-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server that decodes with
ReDrafter (docs/serving.md). This module is the command: its flags, the model's loading on the
service's worker, and the server's start (the HTTP layer and the three APIs are
:mod:`redrafter_mlx.server`).

Endpoints as mlx-lm's server and the OpenAI API define them: ``POST /v1/chat/completions``,
``POST /v1/completions`` (whole answers, or server-sent events with ``"stream": true``),
``GET /v1/models`` and ``GET /health``; Anthropic's ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``; OpenAI's ``POST /v1/responses``. Tool calls on all three,
log-probs on chat and text completions. The model, drafter, autotune profile and sampling
flags are chat's; a request's own fields (temperature, top_p, top_k, seed, max_tokens) win.
Generation runs on one worker thread
(:class:`~redrafter_mlx.core.serving.service.GenerationService`): up to ``--max-batch`` requests are
answered at once in arrival order (one at a time with ``--shard``), at most ``--queue-size``
more wait (more get 503 with ``Retry-After``), a client that leaves stops its generation
before the next step or prompt chunk, and the KV caches of up to ``--prompt-cache-size``
conversations are kept, each reused by a request that extends it. SIGINT and SIGTERM stop it
alike (docs/server.md): the running answers get 5 s, then end with their last event; exit 0.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from redrafter_mlx.cli import flags, sharding
from redrafter_mlx.core.decode.shape import BeamShape
from redrafter_mlx.core.errors import ConfigError, ReDrafterError
from redrafter_mlx.core.serving.service import Chat, Engine, GenerationService, Sampling
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.io.embedded import DEFAULT_NAME
from redrafter_mlx.io.templates import apply_chat_template, reasoning_tags, tool_format
from redrafter_mlx.server import anthropic, openai, responses
from redrafter_mlx.server import app as server_app
from redrafter_mlx.server import protocol as api
from redrafter_mlx.server.app import HEADER_SECONDS, IDLE_SECONDS, MAX_BODY_BYTES, App
from redrafter_mlx.tuning.profiles import context_bands, resolve_shape

MAX_BATCH = 8  # requests answered at once by default: the one size the serving runs measured

EXAMPLES = """examples:
  redrafter-mlx serve
  redrafter-mlx serve --port 8080 --queue-size 4 --max-tokens 256
  redrafter-mlx serve --model models/demo --drafter drafters/demo   # see train --help
  redrafter-mlx serve --host 0.0.0.0   # every network interface: anyone who can reach it

  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
  curl http://127.0.0.1:8080/v1/messages -H 'Content-Type: application/json' \\
    -d '{"max_tokens": 64, "messages": [{"role": "user", "content": "Name a colour."}]}'
  ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=none your-agent
"""

# ---------------------------------------------------------------- command entry


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Serve the OpenAI API (chat and text completions) and Anthropic's Messages "
        "API with ReDrafter decoding, tool calls and log-probs (docs/serving.md). "
        "--max-tokens, --temp, --top-p, --top-k and --seed are the defaults of requests that do "
        "not set their own.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model_args(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: this machine only)"
    )
    parser.add_argument(
        "--port", type=flags.at_least(0), default=8080, help="port (0: any free one)"
    )
    parser.add_argument(
        "--queue-size",
        type=flags.at_least(1),
        default=8,
        help="requests that may wait behind the --max-batch answered; more get 503 (default: 8)",
    )
    parser.add_argument(
        "--max-batch",
        type=flags.at_least(1),
        default=MAX_BATCH,
        help="requests answered at once, their decode steps batched into one forward; 1 "
        f"answers one at a time, as --shard does (default: {MAX_BATCH})",
    )
    parser.add_argument(
        "--max-batch-bytes",
        type=flags.byte_size,
        default=None,
        help="a request joins the batch only while the KV caches of the requests being "
        "answered hold less than this, e.g. 4GB (default: no bound; one request is always "
        "answered)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=flags.at_least(1),
        default=4,
        help="conversations whose KV caches are kept between requests, least recently used "
        "dropped first (default: 4)",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=flags.byte_size,
        default=None,
        help="most bytes those KV caches may hold, e.g. 2GB or 512MB (default: no bound; the "
        "conversation in use is always kept)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=flags.at_least(1),
        default=MAX_BODY_BYTES,
        help=f"largest request body read (default: {MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEADER_SECONDS,
        help="seconds a request's head may take from its first byte, and a body between two "
        f"of its bytes; past it a 408 and the connection closes (default: {HEADER_SECONDS:g})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=seconds,
        default=IDLE_SECONDS,
        help="seconds a connection may wait for its next request before it is closed "
        f"(default: {IDLE_SECONDS:g})",
    )
    flags.add_decode_args(parser, max_tokens=512)
    flags.add_speculation_args(parser)
    sharding.add_shard_arg(parser)
    return parser


def seconds(text: str) -> float:
    """A timeout flag: a number of seconds above 0 (0 would close every connection)."""
    value = flags.non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on this machine
        return False


@dataclass
class Loaded:
    """What the worker's setup found, for the handlers: the runtime and where shapes came from."""

    runtime: rt.Runtime | None = None
    shape_sources: dict[bool, str] | None = None


def engine_setup(args: argparse.Namespace, loaded: Loaded):
    """The service's setup (runs on its worker thread): load as chat does, pick the greedy and
    the sampling shape (flags, else this chip's profiles), build the decoder."""

    def setup() -> Engine:
        # without a drafter (none found, or --drafter none): lookup beams alone
        runtime = sharding.load_runtime(args, need_drafter=False)
        overrides = flags.shape_overrides(args)
        greedy, greedy_source = flags.lookup_when_no_drafter(
            runtime, *resolve_shape(runtime, overrides=overrides, temp=0.0)
        )
        sampled, sampled_source = flags.lookup_when_no_drafter(
            runtime, *resolve_shape(runtime, overrides=overrides, temp=1.0)
        )
        mode = runtime.mode(greedy, autoregressive=args.autoregressive)
        rt.decoding(runtime, greedy, top_k=args.top_k, mode=mode)  # checks top-k and shape
        rt.decoding(runtime, sampled, mode=mode)
        loaded.runtime = runtime
        loaded.shape_sources = {False: greedy_source, True: sampled_source}
        bands = {}
        if mode.speculative:  # plain decoding past the lengths where a tree stops paying
            for samples, shape, source, temp in (
                (False, greedy, greedy_source, 0.0),
                (True, sampled, sampled_source, 1.0),
            ):
                if (found := context_bands(runtime, shape, source, temp=temp)) is not None:
                    bands[samples] = found
        return Engine(
            runtime.decoder, runtime.tokenizer, encoder(runtime), mode, greedy, sampled, bands
        )

    return setup


def encoder(runtime: rt.Runtime):
    """A service prompt -> token ids: messages through the chat template, text as it is."""

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(runtime.tokenizer.encode(prompt))
        if isinstance(prompt, Chat):
            ids = apply_chat_template(
                runtime.tokenizer,
                prompt.messages,
                model_path=Path(runtime.model_id),
                tools=prompt.tools,
                thinking=prompt.thinking,
            )
            prefix = prompt.answer_prefix
            return ids + (
                runtime.tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
            )
        if prompt and isinstance(prompt[0], dict):
            return list(rt.encode_chat(runtime, prompt))
        return list(prompt)

    return encode


def limits(args: argparse.Namespace, runtime: rt.Runtime) -> api.Limits:
    served = args.model or DEFAULT_NAME
    return api.Limits(
        model_ids=tuple(dict.fromkeys((short_name(served), served, runtime.model_id))),
        max_context=runtime.max_context,
        vocab_size=runtime.config.get("vocab_size"),
        max_tokens=args.max_tokens,
        sampling=Sampling(args.temp, args.top_p, args.top_k, args.seed),
        tools=tool_format(runtime.tokenizer),
        reasoning=reasoning_tags(runtime.tokenizer),
    )


def short_name(model: str) -> str:
    """The served name: a folder's or a Hub id's last part (``models/qwen3-4b/`` ->
    ``qwen3-4b``, ``mlx-community/Qwen3-4B-4bit`` -> ``Qwen3-4B-4bit``)."""
    return Path(model.rstrip("/\\")).name or model


def listen(host: str, port: int) -> socket.socket:
    try:
        return server_app.listen(host, port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None


@flags.reports_errors
def main(args: argparse.Namespace) -> None:
    if sharding.follower(args):  # ranks but 0 of --shard: run rank 0's orders, serve nothing
        sharding.load_runtime(args, need_drafter=False)
    if not is_loopback(args.host):
        print(
            f"warning: --host {args.host} listens beyond this machine: anyone on the network "
            "who can reach it can use the model (there is no authentication)",
            file=sys.stderr,
        )
    sock = listen(args.host, args.port)  # first: a taken port fails before the model loads
    loaded = Loaded()
    service = GenerationService(
        engine_setup(args, loaded),
        queue_size=args.queue_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        max_batch=args.max_batch,
        max_batch_bytes=args.max_batch_bytes,
    )
    engine = start_or_exit(service)
    if service.max_batch < args.max_batch:
        print(
            f"note: --shard {args.shard}: requests are answered one at a time (--max-batch 1; "
            "a sharded target does not batch)",
            file=sys.stderr,
        )
    checks = limits(args, loaded.runtime)
    app = App(
        service,
        checks,
        loaded.shape_sources,
        args.max_body_bytes,
        int(time.time()),
        apis={
            "openai": openai.OpenAI(checks.model_id, loaded.runtime.tokenizer),
            "anthropic": anthropic.Anthropic(checks.model_id),
            "responses": responses.Responses(checks.model_id),
        },
        count=lambda prompt: len(encoder(loaded.runtime)(prompt)),
        tail=lambda prompt: loaded.runtime.tokenizer.decode(encoder(loaded.runtime)(prompt)[-16:]),
        drafter_type=None if loaded.runtime.drafter is None else loaded.runtime.drafter.kind,
        decode=loaded.runtime.tokenizer.decode,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"model {checks.model_id}, {mode(engine, loaded)}", file=sys.stderr)
    print(f"serving the OpenAI API at {url}/v1 (Ctrl-C stops)", file=sys.stderr)
    print(f"serving OpenAI's Responses API at {url}/v1/responses", file=sys.stderr)
    print(f"serving Anthropic's Messages API at {url}/v1/messages", file=sys.stderr, flush=True)
    stopped_by = server_app.serve(
        app, sock, header_timeout=args.header_timeout, idle_timeout=args.idle_timeout
    )
    exit_stopped(service, stopped_by)


def exit_stopped(service: GenerationService, signal_number: int | None) -> None:
    """After SIGINT or SIGTERM stopped the server (every answer has ended): let the worker end,
    say so, exit 0 (1 when something else stopped it). By ``os._exit`` once the exit
    functions ran (a sharded lead's tells the other ranks to stop), as :func:`start_or_exit`
    does: MLX's teardown may abort a process whose model-loading thread has ended."""
    service.end_answers()
    service.close()
    print("\nstopped", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0 if signal_number is not None else 1)


def start_or_exit(service: GenerationService) -> Engine:
    """``service.start()``, or exit 1 with its error in one line (a traceback for a bug).

    By ``os._exit``, past the interpreter's teardown: once the worker thread that loaded the
    model has ended, MLX's teardown often aborts the process ("terminate called without an
    active exception", rc 134: 5 exits in 8 here after a refused --top-k)."""
    try:
        return service.start()
    except ReDrafterError as e:
        print(f"error: {e}", file=sys.stderr)
    except Exception:
        traceback.print_exc(file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def mode(engine: Engine, loaded: Loaded) -> str:
    """``drafter D, greedy ReDrafter W=1 L=2 (default), sampling ... (default)``, lookup
    beams alone the same way, or autoregressive."""
    if not engine.mode.speculative:
        return "autoregressive (no drafter)"
    sources, name = loaded.shape_sources, flags.drafter_name(loaded.runtime)

    def shape(samples: bool, fixed: BeamShape) -> str:
        bands = engine.bands.get(samples)
        by_length = "" if bands is None else f", by prompt length {bands.describe()}"
        return f"{engine.mode.describe(fixed, name)} ({sources[samples]}{by_length})"

    return (
        f"{_drafter_line(loaded.runtime)}, greedy {shape(False, engine.greedy_shape)}, "
        f"sampling {shape(True, engine.sampling_shape)}"
    )


def _drafter_line(runtime) -> str:
    """``drafter: PATH (why)``; a runtime without a choice (a test's) by its path alone."""
    choice = getattr(runtime, "drafter_choice", None)
    return choice.describe() if choice is not None else f"drafter {runtime.drafter_id}"
