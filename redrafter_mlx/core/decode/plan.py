"""How the verify forward and the decode loop run on one device: a small frozen record that
``backend.plan_for`` fills in per device. The defaults are the generic path, the one Metal and
CUDA run: mlx-lm's modules and MLX's fused kernels, exact tree sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from redrafter_mlx.core.decode.shape import BeamShape

if TYPE_CHECKING:
    from redrafter_mlx.core.decode.source import Source

# Each drafter type's beam shape on a GPU, from its authors' or serving engines' published
# settings: EAGLE-3 as SGLang's EAGLE-3 example runs it (``--speculative-eagle-topk 4
# --speculative-num-steps 3``: 4 beams of 3 drafted tokens); DFlash verifying its whole block
# as z-lab's model cards do (``--speculative-num-draft-tokens 16``, its block size: 15 drafted
# tokens, here the best-first tree of 15 nodes; a drafter with a smaller block fits it down,
# ``Source.fit_default``); DFlash2 at the 5 rows a step mlx-vlm verifies it with at most
# (``runtime_block_size``, ``min(5, block_size)``); an MTP head (Qwen3.5's, Nemotron-H's) as
# SGLang's MTP example (``--speculative-num-steps 1 --speculative-eagle-topk 1``). ReDrafter's
# RNN, lookup beams alone and types with no published setting take ``default_shape``. P-EAGLE
# drafts as EAGLE-3 does here, DSpark as DFlash (its block forward, run by mlx-vlm's DFlash loop).
GPU_TYPE_SHAPES = (
    ("eagle3", BeamShape(width=4, length=4)),
    ("peagle", BeamShape(width=4, length=4)),
    ("dflash", BeamShape(width=15, length=16)),
    ("dspark", BeamShape(width=15, length=16)),
    ("dflash2", BeamShape(width=4, length=5)),
    ("mtp", BeamShape(width=1, length=2)),
    ("nemotron_h_mtp", BeamShape(width=1, length=2)),
)


@dataclass(frozen=True)
class Plan:
    # Plain Llama/Qwen2 layers run the forward's own compiled, fused blocks instead of the
    # model's own modules (``llm.has_llama_layers``); the other fields below tune that path.
    llama_layers: bool = False
    # Row counts T whose projections run as ``W @ x.T`` instead of ``x @ W.T``.
    transposed_rows: tuple[int, ...] = ()
    # RoPE's cos/sin computed once per forward and shared by the layers, instead of each
    # layer's RoPE module with the tokens on the batch axis (one offset per token).
    rope_tables: bool = False
    # Attention as one matmul per K/V head's query group instead of MLX's fused SDPA kernel.
    grouped_attention: bool = False
    # With grouped attention, attention by primitives of our own (``backend.cpu.kernels``, built on
    # first use; MLX ops where they cannot be built).
    cpu_kernels: bool = False
    # Hand the graph to MLX after the first layer and every this many layers (``mx.async_eval``)
    # while Python builds the rest, and a tree step's verify forward, then its acceptance and
    # next draft, before its read; 0: never. A tree step's graph depends on the last step's
    # read, so it cannot be pipelined whole as a one-token step is: without this the device
    # waited for all of its host work (benchmarks/README.md, "Per-step ledger for a Mac").
    async_layers: int = 5
    # Forwards of up to this many tokens run compiled per-layer blocks (traced once per T).
    compiled_max_rows: int = 32
    # Tree sizes a step pads its tree to (the smallest that fits); (): verify the exact size.
    tree_sizes: tuple[int, ...] = ()
    # Prompt tokens per prefill forward (mlx-lm's prefill step size).
    prefill_chunk: int = 2048
    # With a path-probability floor, read the best beam's score after each drafted depth and
    # stop when nothing deeper can be verified (host reads that save drafter passes); else
    # draft every depth and prune on the host after the step's one read.
    draft_early_stop: bool = False
    # The drafter (and the LM-head rows it scores) in float32 instead of the target's dtype.
    drafter_float32: bool = False
    # A batch step's verified rows, shared by its members (None: no bound): where a joint
    # forward over more rows costs more per token than the trees save (a CPU's products turn
    # compute-bound), members whose trees would not fit verify smaller ones, down to their
    # root alone (plain decoding), while the batch is that large (``batch.fitted``).
    batch_rows: int | None = None
    # The beam shape when no autotune profile or flag gives one (ReDrafter's RNN, or lookup
    # beams alone), and each other drafter type's (``Source.kind``) where it differs.
    default_shape: BeamShape = BeamShape(width=2, length=4)
    type_shapes: tuple[tuple[str, BeamShape], ...] = GPU_TYPE_SHAPES
    # With that default shape: the context length (tokens before the answer) from which a
    # verified tree's attention over the long cache may cost more than its drafts save, so
    # an answer decodes plainly, one token per step, except in the blocks of steps where a
    # session has measured the tree faster (``core/decode/adaptive.py``; a server's batch decodes
    # plainly there); None: the default shape at every length.
    plain_from: int | None = None

    def shape_for(self, drafter: Source | None) -> BeamShape:
        """The default beam shape of ``drafter``'s type on this plan, fitted to ``drafter``
        (None: no drafter, lookup beams alone: ``default_shape``)."""
        if drafter is None:
            return self.default_shape
        shape = dict(self.type_shapes).get(drafter.kind, self.default_shape)
        return drafter.fit_default(shape)
