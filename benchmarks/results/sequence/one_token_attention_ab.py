"""In-process A/B: the CPU plan's one-token attention as split_attention (now) vs softmax_attention
(the pre-#46 arithmetic) for mask-None small score counts; our AR decode tok/s, interleaved."""
import time, statistics
import redrafter_mlx  # noqa: F401  (BLAS first)
from redrafter_mlx.backend import fused
from redrafter_mlx.io import runtime as rt
from redrafter_mlx.core.mode import Mode
from redrafter_mlx.core.session import Session
from redrafter_mlx.core.shape import BeamShape
runtime = rt.load_runtime(None, None, need_drafter=True)
split = fused.split_attention
def softmax_small(q, k, v, scale, mask):
    if mask is None:
        return fused.softmax_attention(q, k, v, scale, mask)
    return split(q, k, v, scale, mask)
ids = rt.encode_chat(runtime, [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}])
def run(mode, shape):
    d = rt.decoding(runtime, shape, mode=mode)
    s = Session(runtime.verifier, runtime.tokenizer, d)
    t = time.perf_counter(); n = 0
    for r in s.generate(ids, max_tokens=128):
        n += len(r.tokens)
    return n / (time.perf_counter() - t)
res = {}
for rep in range(4):
    for name, fn in (("split", split), ("softmax", softmax_small)):
        fused.split_attention = fn
        for mode, shape in ((Mode.AUTOREGRESSIVE, BeamShape(1, 2)), (Mode.REDRAFTER, BeamShape(1, 2, lookup=1))):
            res.setdefault((name, mode.value), []).append(run(mode, shape))
for k, v in res.items():
    print(k, round(statistics.median(v[1:]), 1), [round(x, 1) for x in v])
