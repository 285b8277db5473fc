"""What one decode step asks of the host and the device, counted from outside the code that runs
it: a :class:`Tracer` wraps MLX's evaluation calls and host reads for the span of a step.

Nothing in the package changes: ``mx.eval``, ``mx.async_eval``, ``mx.array.item``,
``mx.array.tolist`` and ``np.array`` / ``np.asarray`` (of an MLX array) are replaced while a
tracer is installed, and every caller looks them up at call time (``mx.eval(...)``,
``np.array(...)``), so mlx-lm's loops and ours are traced alike.

Per step it records:

- ``host_s``: this Python thread's CPU time (``time.thread_time``) outside blocking calls:
  building graphs, packing trees on the host, and the ``async_eval`` calls themselves. CPU
  time, not wall time, so that neither the computation (on MLX's CPU stream thread here) nor
  other processes on a shared machine inflate it. Split into ``exposed_s`` (no dispatched
  work was outstanding: the device had nothing to do) and ``overlapped_s`` (an
  ``async_eval``'s work was still outstanding: the device could compute meanwhile). Work stops
  being outstanding when a blocking call waits for it (MLX's stream runs in order, so waiting
  for the last dispatched batch waits for every earlier one).
- ``dispatch_s``: this thread's CPU time inside blocking calls (``mx.eval`` building the tape
  and handing it to the stream; the wait itself costs no CPU): the device waits for it too.
- ``blocked_s``: wall time inside blocking calls (``mx.eval`` and reads of arrays not yet
  evaluated): the host waiting for the device.
- ``syncs``: blocking calls: each ``mx.eval`` of something not evaluated yet, and each read of an
  array that no ``mx.eval`` of this step has already evaluated (a read after an ``mx.eval`` of
  the same array is a copy, not a sync).
- with ``count_kernels``: the primitives of every graph handed to MLX (``mx.export_to_dot`` of
  the evaluated arrays, before evaluation; ``async_eval`` then evaluates at once so that no
  graph is counted twice), and a Metal estimate of the kernels they launch: primitives less
  views (no kernel: :data:`VIEWS`) less the primitives of the CPU fallbacks of ``mx.fast`` ops
  called outside compiled functions, plus one kernel per such call (Metal runs them as one).
"""

from __future__ import annotations

import collections
import os
import re
import tempfile
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# Primitives Metal runs without a kernel (a view of their input's buffer).
VIEWS = frozenset(
    {
        "Broadcast",
        "Reshape",
        "Slice",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "StopGradient",
        "AsStrided",
        "Depends",
        "Flatten",
        "Unflatten",
    }
)
FAST_OPS = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
_LABEL = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


@dataclass
class StepCounts:
    """What one step did (seconds, counts)."""

    wall_s: float = 0.0
    exposed_s: float = 0.0
    overlapped_s: float = 0.0
    blocked_s: float = 0.0
    dispatch_s: float = 0.0  # this thread's CPU time inside blocking calls
    syncs: int = 0
    evals: int = 0
    async_evals: int = 0
    primitives: int = 0
    views: int = 0
    fast_calls: int = 0
    fallback_primitives: int = 0  # of which no views
    by_primitive: collections.Counter = field(default_factory=collections.Counter)

    @property
    def host_s(self) -> float:
        return self.exposed_s + self.overlapped_s

    @property
    def kernels(self) -> int:
        """The Metal estimate: primitives less views less fast-op fallbacks, plus one per op."""
        return self.primitives - self.views - self.fallback_primitives + self.fast_calls


def _arrays(args) -> list[mx.array]:
    """The MLX arrays in ``args`` (nested lists, tuples and dicts, as ``mx.eval`` takes)."""
    out: list[mx.array] = []
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, mx.array):
            out.append(a)
        elif isinstance(a, list | tuple):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return out


def primitives_of(arrays: list[mx.array]) -> collections.Counter:
    """The primitives (by name) of the unevaluated graph behind ``arrays``."""
    if not arrays:
        return collections.Counter()
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return collections.Counter(_LABEL.findall(f.read()))
    finally:
        os.unlink(path)


class Tracer:
    """Installed (``with Tracer() as t``), it counts each step between :meth:`begin` and
    :meth:`end`; outside a step it only passes calls through."""

    def __init__(self, *, count_kernels: bool = False):
        self.count_kernels = count_kernels
        self.steps: list[StepCounts] = []
        self._now: StepCounts | None = None
        self._saved: list[tuple[object, str, object]] = []
        self._fallbacks: dict[tuple, int] = {}
        self._batch = 0  # async_eval batches so far
        self._dispatched: dict[int, tuple[int, mx.array]] = {}  # id -> (batch, array)
        self._outstanding = False
        self._depth = 0  # nested hooked calls (np.array inside tolist, say) count once

    # -- the step's span

    def begin(self) -> None:
        self._now = StepCounts()
        self._start = time.perf_counter()
        self._last = time.thread_time()
        self._first = self._batch  # the last batch before this step
        self._done: dict[int, mx.array] = {}  # evaluated by an mx.eval of this step

    def end(self) -> StepCounts:
        counts = self._now
        self._host(time.thread_time())
        counts.wall_s = time.perf_counter() - self._start
        self.steps.append(counts)
        self._now = None
        self._done = {}
        # keep this step's dispatches: a pipelined loop reads them in the next step
        self._dispatched = {k: v for k, v in self._dispatched.items() if v[0] > self._first}
        return counts

    def _host(self, now: float) -> None:
        """Book the host time since the last hooked call (``now``: this thread's CPU time)."""
        span = now - self._last
        if self._outstanding:
            self._now.overlapped_s += span
        else:
            self._now.exposed_s += span

    # -- the hooks

    def __enter__(self) -> Tracer:
        self._patch(mx, "eval", self._eval)
        self._patch(mx, "async_eval", self._async_eval)
        self._patch(mx.array, "item", self._read_method("item"))
        self._patch(mx.array, "tolist", self._read_method("tolist"))
        self._patch(np, "array", self._read_function(np.array))
        self._patch(np, "asarray", self._read_function(np.asarray))
        if self.count_kernels:
            for name in FAST_OPS:
                self._patch(mx.fast, name, self._fast(name, getattr(mx.fast, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []

    def _patch(self, owner, name: str, hook) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, hook)

    def _original(self, owner, name: str):
        for o, n, original in self._saved:
            if o is owner and n == name:
                return original
        raise KeyError(name)

    def _blocking(self, arrays: list[mx.array], run, *, count: bool):
        """Run a blocking call on ``arrays``: book the host time before it and the wait."""
        if self._now is None or self._depth:
            return run()
        cpu = time.thread_time()
        self._host(cpu)
        if count:
            self._count(arrays)
        tic = time.perf_counter()
        self._depth += 1
        try:
            result = run()
        finally:
            self._depth -= 1
        self._now.blocked_s += time.perf_counter() - tic
        self._last = time.thread_time()
        self._now.dispatch_s += self._last - cpu  # building the tape, handing it to the stream
        self._waited(arrays)
        return result

    def _waited(self, arrays: list[mx.array]) -> None:
        """After waiting for ``arrays``: is any dispatched batch still outstanding?"""
        batches = [self._dispatched.get(id(a), (None,))[0] for a in arrays]
        if all(b is not None for b in batches) and max(batches, default=0) < self._batch:
            return  # waited for an earlier batch: later ones still compute
        self._outstanding = False

    def _count(self, arrays: list[mx.array]) -> None:
        if not self.count_kernels:
            return
        counted = primitives_of(arrays)
        self._now.by_primitive.update(counted)
        self._now.primitives += sum(counted.values())
        self._now.views += sum(n for p, n in counted.items() if p in VIEWS)

    def _eval(self, *args):
        original = self._original(mx, "eval")
        arrays = _arrays(args)
        if self._now is None or self._depth:
            return original(*args)
        fresh = [a for a in arrays if id(a) not in self._done]
        if fresh:
            self._now.syncs += 1
            self._now.evals += 1
        result = self._blocking(fresh, lambda: original(*args), count=True)
        self._done.update((id(a), a) for a in arrays)
        return result

    def _async_eval(self, *args):
        original = self._original(mx, "async_eval")
        if self._now is None or self._depth:
            return original(*args)
        arrays = _arrays(args)
        tic = time.thread_time()
        self._host(tic)
        self._now.async_evals += 1
        if self.count_kernels:  # evaluate now: a later graph must not count this one again
            self._count(arrays)
            self._original(mx, "eval")(*args)
            self._done.update((id(a), a) for a in arrays)
        else:
            original(*args)
        toc = time.thread_time()
        self._book_dispatch(toc - tic)
        self._last = toc
        self._batch += 1
        self._outstanding = not self.count_kernels
        self._dispatched.update((id(a), (self._batch, a)) for a in arrays)
        return None

    def _book_dispatch(self, seconds: float) -> None:
        """A dispatch call is host work; the device is busy during it only with earlier work."""
        if self._outstanding:
            self._now.overlapped_s += seconds
        else:
            self._now.exposed_s += seconds

    def _read(self, array: mx.array, run):
        if self._now is None or self._depth or id(array) in self._done:
            return run()
        self._now.syncs += 1
        counted = id(array) not in self._dispatched  # a dispatched graph was counted then
        return self._blocking([array], run, count=counted)

    def _read_method(self, name: str):
        original = getattr(mx.array, name)
        tracer = self

        def read(array, *args, **kwargs):
            return tracer._read(array, lambda: original(array, *args, **kwargs))

        return read

    def _read_function(self, original):
        tracer = self

        def read(obj, *args, **kwargs):
            if isinstance(obj, mx.array):
                return tracer._read(obj, lambda: original(obj, *args, **kwargs))
            return original(obj, *args, **kwargs)

        return read

    def _fast(self, name: str, original):
        """``mx.fast.<name>`` counting each call and the primitives of its CPU fallback."""
        tracer = self

        def fast(*args, **kwargs):
            if tracer._now is not None:
                tracer._now.fast_calls += 1
                tracer._now.fallback_primitives += tracer._fallback(original, args, kwargs)
            return original(*args, **kwargs)

        fast.__name__ = name
        return fast

    def _fallback(self, original, args, kwargs) -> int:
        """Primitives one call of ``original`` adds to a graph, on evaluated stand-in inputs of
        the same shapes (cached per signature)."""

        def key(v):
            return ("array", v.shape, str(v.dtype)) if isinstance(v, mx.array) else repr(v)

        sig = (original, tuple(key(a) for a in args), tuple((k, key(v)) for k, v in kwargs.items()))
        if sig not in self._fallbacks:

            def stand_in(v):
                return mx.zeros(v.shape, v.dtype) if isinstance(v, mx.array) else v

            inputs = [stand_in(a) for a in args]
            named = {k: stand_in(v) for k, v in kwargs.items()}
            self._original(mx, "eval")(*_arrays(inputs), *_arrays(list(named.values())))
            out = original(*inputs, **named)
            counted = primitives_of(_arrays([out]))  # its views are subtracted as views
            self._fallbacks[sig] = sum(n for p, n in counted.items() if p not in VIEWS)
        return self._fallbacks[sig]
