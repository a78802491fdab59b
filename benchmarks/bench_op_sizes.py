"""Build and step time of shape-dependent ops at a realistic size (4x3x64x64), against eager.

OpInfo's samples (``bench_opinfo.py``) are too small to show a decomposition whose size grows with
the input's shape (issue 24 §4: adaptive pools, im2col, cdist). Each case: the first ortwrap
forward+backward minus a later one (``build_s``), the median step of both, the pre-gradient graph's
node count and commonest op types, and the build stages above 0.3 s. Timing only::

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/bench_op_sizes.py dynamo [unfold,cdist]
"""

import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import interleaved  # noqa: E402

from ortwrap import ORTWrap  # noqa: E402


def x4():
    return torch.randn(4, 3, 64, 64, requires_grad=True)


def x5():
    return torch.randn(2, 3, 16, 24, 24, requires_grad=True)


def x3():
    return torch.randn(4, 3, 256, requires_grad=True)


CASES = {
    "adaptive_avg_pool2d(5,7)": (lambda x: F.adaptive_avg_pool2d(x, (5, 7)), x4),
    "adaptive_max_pool2d(5,7)": (lambda x: F.adaptive_max_pool2d(x, (5, 7)), x4),
    "adaptive_avg_pool1d(7)": (lambda x: F.adaptive_avg_pool1d(x, 7), x3),
    "adaptive_max_pool1d(7)": (lambda x: F.adaptive_max_pool1d(x, 7), x3),
    "adaptive_avg_pool3d(3,5,7)": (lambda x: F.adaptive_avg_pool3d(x, (3, 5, 7)), x5),
    "adaptive_max_pool3d(3,5,7)": (lambda x: F.adaptive_max_pool3d(x, (3, 5, 7)), x5),
    "interpolate_bilinear": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), x4),
    "interpolate_bicubic": (lambda x: F.interpolate(x, size=(50, 70), mode="bicubic"), x4),
    "interpolate_nearest": (lambda x: F.interpolate(x, size=(50, 70), mode="nearest"), x4),
    "interpolate_area": (lambda x: F.interpolate(x, size=(50, 70), mode="area"), x4),
    "unfold": (lambda x: F.unfold(x, 3, padding=1), x4),
    "fold": (lambda x: F.fold(F.unfold(x, 3, padding=1), (64, 64), 3, padding=1), x4),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(torch.cat([x, x, x, x], 1), 2), x4),
    "avg_pool2d_ceil": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), x4),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), x4),
    "lp_pool2d": (lambda x: F.lp_pool2d(x, 2, 3), x4),
    "pad_reflect": (lambda x: F.pad(x, (3, 3, 3, 3), mode="reflect"), x4),
    "pad_circular": (lambda x: F.pad(x, (3, 3, 3, 3), mode="circular"), x4),
    "tensor.unfold": (lambda x: x.unfold(3, 8, 4), x4),
    "cumsum": (lambda x: x.cumsum(3), x4),
    "cumprod": (lambda x: x.cumprod(3), x4),
    "logcumsumexp": (lambda x: x.logcumsumexp(3), x4),
    "sort": (lambda x: x.sort(3)[0], x4),
    "topk": (lambda x: x.topk(5, 3)[0], x4),
    "roll": (lambda x: x.roll(5, 3), x4),
    "grid_sample": (lambda x: F.grid_sample(x, torch.rand(4, 32, 32, 2) * 2 - 1, align_corners=False), x4),
    "group_norm": (lambda x: F.group_norm(x, 3), x4),
    "instance_norm": (lambda x: F.instance_norm(x), x4),
    "local_response_norm": (lambda x: F.local_response_norm(x, 2), x4),
    "embedding_bag": (lambda x: F.embedding_bag(torch.randint(0, 64, (40,)), x[0, 0], torch.arange(0, 40, 4)), x4),
    "kthvalue": (lambda x: x.kthvalue(5, 3)[0], x4),
    "median_dim": (lambda x: x.median(3)[0], x4),
    "cdist": (lambda x: torch.cdist(x[:, 0], x[:, 1]), x4),
    "triu": (lambda x: x.triu(1), x4),
    "max_unpool2d": (lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2), x4),
}


class _Op(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _step(mod, x):
    def f():
        y = mod(x)
        (y * y).sum().backward()

    return f


def run(name: str, fn, make_input, exp: str) -> dict:
    torch.manual_seed(0)
    m, x = _Op(fn), make_input()
    w = ORTWrap(_Op(fn), fallback=False, exporter=exp, build_cache=False)
    try:
        t0 = time.perf_counter()
        _step(w, x)()
        first = time.perf_counter() - t0
    except Exception as e:
        return {"case": name, "error": str(e)[:150]}
    t = interleaved({"e": _step(m, x), "o": _step(w, x)}, warmup=1, iters=5)
    e, o = statistics.median(t["e"]), statistics.median(t["o"])
    a = w.last_artifacts
    nodes = a.pre_grad.graph.node if a else []
    return {
        "case": name,
        "exp": exp,
        "build_s": round(first - o, 2),
        "eager_ms": round(e * 1e3, 2),
        "ortwrap_ms": round(o * 1e3, 2),
        "ratio": round(o / e, 2),
        "nodes": len(nodes),
        "top": Counter(n.op_type for n in nodes).most_common(3),
        "stages": {k: round(v, 2) for k, v in (a.stage_seconds.items() if a else []) if v > 0.3},
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    exp = sys.argv[1] if len(sys.argv) > 1 else "dynamo"
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for name, (fn, make_input) in CASES.items():
        if not only or name in only:
            print(json.dumps(run(name, fn, make_input, exp)), flush=True)
