"""What a distillation run is told: the settings of its two phases as frozen values (the
``train`` command builds them from its flags; field names are the flags', ``--max-seq-len`` ->
``max_seq_len``). See ``redrafter-mlx train --help`` for each one's meaning."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtractOptions:
    """Phase 1: which conversations become cache records, and how."""

    source: str  # "data": teacher-force the conversations' answers; "self": the target answers
    max_seq_len: int  # tokens per record at most
    topk: int  # top-k next-token log-probs stored per token (0: none; --source data only)
    gen_tokens: int  # --source self: answer length cap
    gen_batch: int  # --source self: prompts per batch
    self_prompts: str  # --source self: "first" user turn of each conversation, or "all"
    skip_prompts: int  # training conversations (prompts) left out at the start
    heldout: int  # held-out conversations (pool)
    heldout_tokens: int  # held-out split budget
    max_tokens: int  # training split budget
    cache_max_gb: float  # no new shard once the cache holds this
    seed: int  # the held-out / training split
    quiet: bool = False  # no progress bars or notes
    stop_at: float = 0.0  # time.time() after which no record is added (--minutes); 0: none
    context_layers: tuple[int, ...] = ()  # target layers whose outputs each record keeps


@dataclass(frozen=True)
class TrainOptions:
    """Phase 2: the drafter's shape and its optimisation."""

    # drafter shape
    head: str  # "own" projection or "target" (the target's LM head scores a hidden vector)
    draft_vocab: int  # K most frequent target-predicted tokens (0: full vocabulary)
    exit_dim: int  # drafter width E (0: 2H)
    num_draft_layers: int | None  # None: 2, or with ``init`` its own
    init: str | None  # start from this drafter folder
    identity_init: bool  # head "target": start as the target's LM head applied to h
    # optimisation
    positions: int  # future positions trained (P)
    batch_size: int
    lr: float
    weight_decay: float
    epochs: float
    max_minutes: float  # 0: no time limit
    soft_weight: float
    hidden_weight: float
    eval_every: int
    patience: int
    seed: int
    max_tokens: int  # training tokens read from the cache
    extra_cache: tuple[str, ...] = ()  # more cache folders to train on (same target)
    context_layers: tuple[int, ...] = ()  # new drafter: target layers fused with the final hidden
    own_drafts: float = 0.0  # share of rows whose later inputs are the drafter's own drafts
    resume: bool = False  # continue from ``out/checkpoint``
    quiet: bool = False
