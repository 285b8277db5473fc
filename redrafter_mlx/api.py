"""The Python API, in mlx-lm's call shapes: code written against ``from mlx_lm import load,
generate, stream_generate`` switches by changing the import.

    from redrafter_mlx import load, generate
    model, tokenizer = load()                       # the embedded model and its drafter
    text = generate(model, tokenizer, "Hello", max_tokens=32, verbose=True)

``load`` returns a :class:`Model`: the target, its drafter (found as chat finds it, or given)
and the decoder built once from them. ``stream_generate`` and ``generate`` also take a plain
mlx-lm model (no drafter: prompt-lookup beams where the shape has them, else plain decoding).
The beam shape comes from keywords, else this chip's autotune profile, else the device plan's
default: the same rule as the command line's.

Imported before MLX, this module loads the CPU backend's fast BLAS into the process (the console
script's re-exec does the same for the command line), compiling nothing: the small-row kernel
comes where a decoder built it earlier; imported after MLX, it warns once with the fix.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref

from redrafter_mlx.backend.cpu.blas import preload_in_process

_TOO_LATE = preload_in_process()  # before MLX is imported: the BLAS it will multiply with
if _TOO_LATE:
    warnings.warn(_TOO_LATE, RuntimeWarning, stacklevel=2)

from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402

from redrafter_mlx.backend.plan import build_decoder  # noqa: E402
from redrafter_mlx.core.decode.accept import Sampler, greedy, temperature  # noqa: E402
from redrafter_mlx.core.decode.decoder import Decoder  # noqa: E402
from redrafter_mlx.core.decode.mode import Mode  # noqa: E402
from redrafter_mlx.core.decode.shape import BeamShape  # noqa: E402
from redrafter_mlx.core.decode.source import Source  # noqa: E402
from redrafter_mlx.core.decode.step import Decoding  # noqa: E402
from redrafter_mlx.core.decode.stream import GenerationResponse, token_responses  # noqa: E402
from redrafter_mlx.core.serving.scheduler import answer_together  # noqa: E402
from redrafter_mlx.core.serving.session import Session  # noqa: E402
from redrafter_mlx.io import runtime as rt  # noqa: E402
from redrafter_mlx.tuning.profiles import follow_context, resolve_shape  # noqa: E402

__all__ = [
    "BatchResponse",
    "GenerationResponse",
    "Model",
    "batch_generate",
    "generate",
    "load",
    "stream_generate",
]

log = logging.getLogger(__name__)  # "redrafter_mlx.api": set "redrafter_mlx" to INFO to see it


@dataclass(frozen=True)
class Model:
    """What :func:`load` returns as its model: the loaded :class:`~redrafter_mlx.io.runtime.
    Runtime` (target, drafter, config, ids) and its decoder. Calling it runs the target as
    an mlx-lm model (``model(inputs, cache=...)``)."""

    runtime: rt.Runtime

    @property
    def target(self) -> nn.Module:
        return self.runtime.model

    @property
    def decoder(self) -> Decoder:
        return self.runtime.decoder

    @property
    def drafter_source(self) -> str | None:
        """Which drafter :func:`load` chose and why, in the command line's words
        (``drafter: PATH (why)`` or ``drafter: none (why): lookup beams only``); None for a
        runtime built without a choice."""
        choice = self.runtime.drafter_choice
        return None if choice is None else choice.describe()

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)


def load(
    path_or_hf_repo: str | None = None, *, drafter: str | None = None
) -> tuple[Model, TokenizerWrapper]:
    """Load a target (a folder, a Hugging Face id or a ``.gguf`` file; None: the embedded
    SmolLM2-135M-Instruct) and its drafter (``drafter``: a folder; when None, the one
    discovery finds: the shipped one for the embedded model and its copies) -> ``(model,
    tokenizer)``, parameters evaluated."""
    runtime = rt.load_runtime(path_or_hf_repo, drafter, need_drafter=False)
    model = Model(runtime)
    _log_drafter(runtime.drafter_choice)
    return model, runtime.tokenizer


def _log_drafter(choice) -> None:
    """The drafter choice on this module's logger, as the command line says it on stderr
    (``DrafterChoice.describe``); what discovery skipped, as a warning."""
    if choice is None:
        return
    log.info(choice.describe())
    skipped = choice.skipped_line()
    if skipped is not None:
        log.warning(skipped)


_PLAIN: dict[tuple[int, int], Decoder] = {}  # plain models' decoders, while each lives


def _decoder(model: Model | nn.Module, drafter: Source | None) -> Decoder:
    """The decoder of ``model``: a loaded one's, or built on a plain model's first call with
    ``drafter`` (or none)."""
    if isinstance(model, Model):
        if drafter is not None:
            raise ValueError("drafter=: a loaded model has its drafter (load(..., drafter=DIR))")
        return model.decoder
    key = (id(model), id(drafter))
    if key not in _PLAIN:
        context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        _PLAIN[key] = build_decoder(model, drafter, max_context=context)
        weakref.finalize(model, _PLAIN.pop, key, None)  # the copy holds arrays, not the model
    return _PLAIN[key]


def _shape(
    model: Model | nn.Module, decoder: Decoder, overrides: dict, temp: float
) -> tuple[BeamShape, str]:
    """The keywords' shape fields over this chip's profile (a loaded model) or the plan's
    default for the drafter's type, and where it came from: the command line's rule."""
    if isinstance(model, Model):
        return resolve_shape(model.runtime, overrides=overrides, temp=temp)
    given = {k: v for k, v in overrides.items() if v is not None}
    default = decoder.plan.shape_for(decoder.drafter)
    return BeamShape(**{**default.__dict__, **given}), "given" if given else "default"


def _overrides(width, length, min_prob, search_width, lookup) -> dict:
    """The shape keywords as :class:`BeamShape` fields (None: not given)."""
    return {
        "width": width,
        "length": length,
        "min_prob": min_prob,
        "search_width": search_width,
        "lookup": lookup,
    }


def _decoding(model, decoder: Decoder, overrides: dict, sampler, autoregressive, logprobs):
    """The decoding of a call's keywords (the shape: :func:`_shape`, the mode, the sampler)
    and where its shape came from."""
    shape, source = _shape(model, decoder, overrides, temperature(sampler))
    mode = Mode.choose(
        drafter=decoder.drafter is not None,
        shape=shape,
        autoregressive=autoregressive,
        plain_fallback=True,
    )
    return Decoding(mode, shape, sampler or greedy, logprobs=logprobs), source


def _prompt_ids(tokenizer: TokenizerWrapper, prompt) -> list[int]:
    """Token ids of ``prompt`` (text, encoded as mlx-lm encodes it, or ids)."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special_tokens = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return [int(t) for t in prompt]


def stream_generate(
    model: Model | nn.Module,
    tokenizer,
    prompt: str | list[int],
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    beam_width: int | None = None,
    beam_length: int | None = None,
    min_prob: float | None = None,
    search_width: int | None = None,
    lookup: int | None = None,
    autoregressive: bool = False,
    stop_strings: tuple[str, ...] = (),
    seed: int | None = None,
    drafter: Source | None = None,
    logprobs: bool = False,
) -> Iterator[GenerationResponse]:
    """mlx-lm's ``stream_generate``: one :class:`GenerationResponse` per token, with mlx-lm's
    fields plus ``stats`` (tokens/step, accepted drafts, tree sizes, host reads).

    ``sampler``: e.g. ``mlx_lm.sample_utils.make_sampler(0.7)`` (None: greedy). The beam shape
    keywords override this chip's autotune profile or the default; ``autoregressive`` decodes
    one token per step. ``drafter``: a plain mlx-lm model's drafter (as mlx-lm's
    ``draft_model``), any ``core/decode/source.py: Source``: a folder's from
    ``io.field_drafters.create_drafter(folder, model)``, or a ReDrafter module bound to the
    model's embedding (``BeamDrafter(drafter, llm.embedding(model))``).
    ``logprobs``: each response carries the target's log-probs ``(V,)`` its token was chosen
    from, as mlx-lm's do (off by default: a log-softmax per token). The output is the
    target's own: greedy token for token, sampled from the same distribution.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    decoder = _decoder(model, drafter)
    overrides = _overrides(beam_width, beam_length, min_prob, search_width, lookup)
    decoding, source = _decoding(model, decoder, overrides, sampler, autoregressive, logprobs)
    session = Session(decoder, tokenizer, decoding, seed=seed)
    if isinstance(model, Model):  # a shape no keyword chose follows the context, as in chat
        follow_context(session, model.runtime, source, temp=temperature(sampler))
    steps = session.generate(
        _prompt_ids(tokenizer, prompt), max_tokens=max_tokens, stop_strings=stop_strings
    )
    yield from token_responses(steps)


def generate(
    model: Model | nn.Module, tokenizer, prompt: str | list[int], verbose: bool = False, **kwargs
) -> str:
    """The whole answer of :func:`stream_generate` (same keywords); ``verbose`` prints the text
    as it comes and the timings, as mlx-lm's ``generate`` does."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if not text or response is None:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        stats = response.stats
        if stats is not None and stats.steps:
            print(f"ReDrafter: {stats.tokens_per_step:.2f} tokens/step")
    return text


@dataclass
class BatchStats:
    """What :func:`batch_generate` did, in mlx-lm's ``BatchStats`` terms: prompt and generated
    tokens (end tokens counted, as mlx-lm counts them), seconds and tokens/s of each phase, the
    peak memory (GB); ``answers``: each answer's own :class:`GenerationStats`."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    peak_memory: float = 0.0
    answers: list = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / max(self.prompt_time, 1e-9)

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / max(self.generation_time, 1e-9)


@dataclass
class BatchResponse:
    """mlx-lm's ``BatchResponse``: each prompt's text, the stats, and (when asked for) each
    answer's token ids (its end token left out, as mlx-lm leaves it out)."""

    texts: list[str]
    stats: BatchStats
    caches: None = None
    token_ids: list[list[int]] | None = None


def batch_generate(
    model: Model | nn.Module,
    tokenizer,
    prompts: list[list[int]] | list[str],
    max_tokens: int | list[int] = 128,
    verbose: bool = False,
    return_token_ids: bool = False,
    *,
    sampler: Sampler | None = None,
    beam_width: int | None = None,
    beam_length: int | None = None,
    min_prob: float | None = None,
    search_width: int | None = None,
    lookup: int | None = None,
    autoregressive: bool = False,
    stop_strings: tuple[str, ...] = (),
    seed: int | None = None,
    drafter: Source | None = None,
) -> BatchResponse:
    """mlx-lm's ``batch_generate``: answer every prompt (token ids, or text) at once, each
    answer speculative as :func:`stream_generate`'s (same keywords) and equal to it at
    temperature 0, every decode step of all answers one batched target forward ->
    :class:`BatchResponse`. ``max_tokens``: one budget, or one per prompt."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    decoder = _decoder(model, drafter)
    overrides = _overrides(beam_width, beam_length, min_prob, search_width, lookup)
    decoding, _ = _decoding(model, decoder, overrides, sampler, autoregressive, False)
    decoder.warm_up(decoding)
    if seed is not None:
        mx.random.seed(seed)
    ids = [_prompt_ids(tokenizer, p) for p in prompts]
    budgets = [max_tokens] * len(ids) if isinstance(max_tokens, int) else list(max_tokens)
    tic = time.perf_counter()
    answers = answer_together(
        decoder, tokenizer, ids, decoding, max_tokens=budgets, stop_strings=stop_strings
    )
    wall = time.perf_counter() - tic
    texts = ["".join(r.text for r in answer) for answer in answers]
    runs = [answer[-1].stats for answer in answers]
    prompt_time = sum(r.prompt_seconds for r in runs)  # prompts are prefilled in turn
    stats = BatchStats(
        prompt_tokens=sum(r.prompt_tokens for r in runs),
        prompt_time=prompt_time,
        generation_tokens=sum(r.completion_tokens for r in runs),
        generation_time=wall - prompt_time,
        peak_memory=mx.get_peak_memory() / 1e9,
        answers=runs,
    )
    if verbose:
        print(
            f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, "
            f"{stats.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
            f"{stats.generation_tps:.3f} tokens-per-sec"
        )
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    token_ids = [[t for r in a for t in r.tokens] for a in answers] if return_token_ids else None
    return BatchResponse(texts, stats, None, token_ids)
