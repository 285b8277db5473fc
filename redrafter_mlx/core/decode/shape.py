"""The beam shape of a ReDrafter step: W beams of L tokens, an optional path-probability floor
and search width, and K prompt-lookup beams.

Legend: W beam width, L beam length, S search width, K lookup beams, T tree nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from redrafter_mlx.core.decode.tree import verified_size


@dataclass(frozen=True)
class BeamShape:
    """W beams of L tokens; with ``min_prob`` > 0 each step verifies only the tree nodes whose
    drafter path probability reaches it (:func:`redrafter_mlx.tree.prune`); with
    ``search_width`` S > W the drafter searches with S beams and the step verifies the W of them
    that promise the most accepted tokens (:func:`redrafter_mlx.draft.select_paths`); with
    ``lookup`` K > 0 up to K beams copied from the context join them in the tree
    (:mod:`redrafter_mlx.core.decode.lookup`)."""

    width: int = 1
    length: int = 4
    min_prob: float = 0.0
    search_width: int = 0  # 0: plain beam search with W beams (any S <= W is stored as 0)
    lookup: int = 0  # K prompt-lookup beams per step (0: none)

    def __post_init__(self):
        if self.width < 1 or self.length < 2:
            raise ValueError(f"beam shape W={self.width} L={self.length}: need W >= 1 and L >= 2")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"min path probability {self.min_prob}: need 0 <= p < 1")
        if self.search_width < 0:
            raise ValueError(f"search width {self.search_width}: need S >= 0")
        if self.lookup < 0:
            raise ValueError(f"lookup beams {self.lookup}: need K >= 0")
        if self.search_width <= self.width:  # the plain search: one spelling, equal shapes
            object.__setattr__(self, "search_width", 0)

    @property
    def searched(self) -> int:
        """Beams the drafter keeps while searching: ``max(W, search_width)``."""
        return max(self.width, self.search_width)

    @property
    def label(self) -> str:
        """``W2L4``; ``W2L4s8`` when searched with 8 beams, ``W2L4p0.3`` with a floor,
        ``W2L4k4`` with 4 lookup beams."""
        search = f"s{self.search_width}" if self.search_width else ""
        floor = f"p{self.min_prob:g}" if self.min_prob else ""
        lookup = f"k{self.lookup}" if self.lookup else ""
        return f"W{self.width}L{self.length}{search}{floor}{lookup}"

    def search_options(self) -> dict:
        """The drafter's keyword options: ``BeamDrafter(context, pending, **options)``."""
        return {
            "width": self.width,
            "length": self.length,
            "min_prob": self.min_prob,
            "search_width": self.search_width,
        }  # the lookup beams are the decoder's, not the drafter's

    def describe(self) -> str:
        """``W=2 L=4``, plus `` search 8``, `` min-prob 0.3`` and `` lookup 4`` when set."""
        search = f" search {self.search_width}" if self.search_width else ""
        floor = f" min-prob {self.min_prob:g}" if self.min_prob else ""
        lookup = f" lookup {self.lookup}" if self.lookup else ""
        return f"W={self.width} L={self.length}{search}{floor}{lookup}"

    def describe_lookup_only(self) -> str:
        """``L=4 lookup 4``: the shape of a decoder with lookup beams and no drafter."""
        return f"L={self.length} lookup {self.lookup}"


def shape_grid(widths, lengths, floors=(0.0,), search_widths=(0,), lookups=(0,)) -> list[BeamShape]:
    """Every (W, L, min_prob, S, K) combination once, in that order (a search width S <= W is
    the plain search); ValueError for an invalid one."""
    shapes = (
        BeamShape(w, n, p, s, k)
        for w in widths
        for n in lengths
        for p in floors
        for s in search_widths
        for k in lookups
    )
    return list(dict.fromkeys(shapes))


def verified_sizes(
    shape: BeamShape, tree_sizes: tuple[int, ...] = (), *, drafted: bool = True
) -> list[int]:
    """Every tree size T a step of ``shape`` can verify: W drafted beams (``drafted``) and up
    to K lookup beams merge into L nodes (all alike) up to 1 + (W + K) (L - 1) (no shared
    prefix); a probability floor can cut a tree to the root, and so can a lookup step that
    found no match and has no drafted beam."""
    beams = (shape.width if drafted else 0) + shape.lookup
    smallest = shape.length if drafted and not shape.min_prob else 1
    largest = 1 + beams * (shape.length - 1)
    return sorted({verified_size(n, tree_sizes) for n in range(smallest, largest + 1)})


# width, length, min_prob, search_width, lookup
SHAPE_FIELDS = tuple(f.name for f in fields(BeamShape))
