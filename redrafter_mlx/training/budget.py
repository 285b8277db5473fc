"""What ``train --minutes N`` uses: the recipe measured best for a time budget, and the
tokens/step it reached, from a table measured on this project's machine.

Legend: n the target's layer count.

Each row is one budget measured from scratch (the training time curve in
``benchmarks/HISTORY.md``): the recipe kept is the one with the best held-out agreement on the
training corpus's own held-out split (what training may be tuned on); ``tokens_per_step`` is
what that drafter reached on 40 MT-Bench first turns (W4 L5, no lookup, greedy, 128 tokens),
reported to the user as an expectation, never used to choose. A budget between rows takes the
row below it (a longer budget buys at least as much); one below the first row takes the first.
"""

from __future__ import annotations

from dataclasses import dataclass

# --minutes N without a measured row: the share of N extraction may use.
EXTRACT_SHARE = 0.4


@dataclass(frozen=True)
class Budget:
    """One measured budget: ``minutes``, the recipe (``layered``: read the target's low,
    middle and high layers, :func:`fused_layers`; ``own_drafts``: the share of examples fed
    the drafter's own drafts; ``extract_share``: the share of the minutes extraction may
    use, training taking the rest; ``soft_weight`` and ``hidden_weight``: the loss's soft
    targets and hidden-state regression, as ``train``'s flags of those names; ``width``: the
    drafter's width as a multiple of the target's hidden size, 0 for ``train``'s default),
    what it reached and what its run extracted and trained."""

    minutes: float
    layered: bool
    own_drafts: float
    tokens_per_step: float
    measured: str
    extract_share: float = EXTRACT_SHARE
    soft_weight: float = 0.0
    hidden_weight: float = 0.0
    width: float = 0.0


# Why these recipes: trained side by side from scratch at each budget, soft targets (the
# target's distribution over the draft vocabulary) plus the hidden-state regression beat the
# plain recipe on held-out agreement at every budget, as the plain recipe had beaten reading
# three more target layers; at the shortest budget the default width (2H) beat H.
TABLE: tuple[Budget, ...] = (
    Budget(
        15,
        False,
        0.0,
        1.34,
        "16,201 training tokens extracted, 232 steps",
        soft_weight=1.0,
        hidden_weight=1.0,
    ),
    Budget(
        30,
        False,
        0.0,
        1.38,
        "35,103 training tokens extracted, 448 steps",
        soft_weight=1.0,
        hidden_weight=1.0,
    ),
    Budget(
        60,
        False,
        0.0,
        1.46,
        "75,872 training tokens extracted, 632 steps",
        soft_weight=1.0,
        hidden_weight=1.0,
    ),
)


def budget_for(minutes: float, table: tuple[Budget, ...] | None = None) -> Budget | None:
    """The row of ``table`` (default :data:`TABLE`) for a budget of ``minutes``: the longest
    measured one not above it (the shortest when all are); None when nothing is measured."""
    table = TABLE if table is None else table
    if not table:
        return None
    rows = sorted(table, key=lambda b: b.minutes)
    below = [b for b in rows if b.minutes <= minutes]
    return below[-1] if below else rows[0]


def exit_dim(row: Budget, hidden: int) -> int:
    """The ``--exit-dim`` of ``row`` for a target of ``hidden`` width (0: the default)."""
    return round(row.width * hidden) if row.width else 0


def fused_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a layered drafter reads besides the final hidden state: a low, a
    middle and a high one (EAGLE-3's choice, layer 2, n/2 and n - 3), fewer on shallow
    targets (distinct, in range)."""
    picks = (min(2, num_layers - 1), num_layers // 2, num_layers - 3)
    return tuple(sorted({i for i in picks if 0 <= i < num_layers}))
