"""Effect of ORT's thread settings on a training step.

ORT's default lets idle intra-op threads spin; between ORT runs they compete with PyTorch's OpenMP
threads (optimizer step, loss, autograd) for the same cores. ortwrap turns spinning off and uses
as many intra-op threads as torch. Each configuration runs in its own process (thread pools of
several sessions in one process would disturb each other), with its own interleaved eager baseline:

    python benchmarks/bench_threads.py            # all configurations, MLP (a) and LM (b)
    python benchmarks/bench_threads.py --one mlp 2 0   # one: model, intra-op threads, spinning
    python benchmarks/bench_threads.py --load     # the LM at 1 thread, all cores, all cores + a busy process

``--load`` (issue 26 item 4) runs the LM with ortwrap's defaults at 1 thread (torch and ORT), at all
cores, and at all cores while a second process on the machine runs a Python busy loop; under that
load also with ``OMP_WAIT_POLICY=PASSIVE`` (PyTorch's OpenMP workers sleep instead of spinning),
with ORT's spinning on, and with 1 ORT intra-op thread, to tell which pool loses the time. Wall
clock (the busy process's share of the machine is the point); each row its own process.
"""

from __future__ import annotations

import copy
import os
import statistics
import subprocess
import sys

CONFIGS = [
    (0, 0, "ortwrap default: spinning off, threads = torch's"),
    (0, 1, "spinning on (ORT's default)"),
    (1, 0, "1 intra-op thread, spinning off"),
]


def one(which: str, threads: int, spin: bool, iters: int | None = None) -> None:
    import torch
    from _harness import interleaved, train_step
    from tiny_gpt import GPTConfig, TinyGPT, batch
    from torch import nn

    from ortwrap import ORTWrap

    torch.manual_seed(0)
    if which == "mlp":
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
        lossf = nn.CrossEntropyLoss()
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
        make_loss, iters, warmup = (lambda m: lossf(m(x), y)), 200, 20
    else:
        cfg = GPTConfig(layers=4, d=256, heads=4, max_len=128)
        ids, tgt = batch(cfg, 8, 128, torch.Generator().manual_seed(0))
        model = TinyGPT(cfg)
        make_loss, iters, warmup = (lambda m: m(ids, tgt)[0]), iters or 12, 2
    w = ORTWrap(copy.deepcopy(model), fallback=False, intra_op_threads=threads, allow_spinning=spin)
    steps = {
        "eager": train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), make_loss),
        "ortwrap": train_step(w, torch.optim.SGD(w.parameters(), lr=0.01), make_loss),
    }
    t = interleaved(steps, warmup=warmup, iters=iters)
    e, o = statistics.median(t["eager"]), statistics.median(t["ortwrap"])
    print(f"{e * 1e3:.3f} {o * 1e3:.3f}")


def main() -> None:
    for which, title in (("mlp", "(a) MLP"), ("lm", "(b) GPT LM")):
        print(f"\n== threads: {title}")
        for threads, spin, label in CONFIGS:
            out = subprocess.run(
                [sys.executable, __file__, "--one", which, str(threads), str(spin)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            e, o = float(out[-2]), float(out[-1])
            print(f"  {label:<48} eager {e:8.3f} ms  ortwrap {o:8.3f} ms  ratio ortwrap/eager = {o / e:.2f}x")


#: --load rows: (label, torch threads (0: all cores), ORT intra-op threads (0: torch's), spinning, busy process, env)
LOAD_ROWS = [
    ("1 thread", 1, 0, 0, False, {}),
    ("all cores", 0, 0, 0, False, {}),
    ("all cores + busy process", 0, 0, 0, True, {}),
    ("  + OMP_WAIT_POLICY=PASSIVE", 0, 0, 0, True, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("  + ORT spinning on", 0, 0, 1, True, {}),
    ("  + 1 ORT intra-op thread", 0, 1, 0, True, {}),
]


def load(iters: int) -> None:
    print(f"\n== threads under load: (b) GPT LM, ortwrap defaults unless noted, {os.cpu_count()} cores, wall ms")
    for label, torch_threads, threads, spin, busy, env in LOAD_ROWS:
        child_env = dict(os.environ, **env)
        if torch_threads:
            child_env["OMP_NUM_THREADS"] = str(torch_threads)
        else:
            child_env.pop("OMP_NUM_THREADS", None)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--one", "lm", str(threads), str(spin), str(iters)],
                capture_output=True,
                text=True,
                check=True,
                env=child_env,
            ).stdout.split()
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        e, o = float(out[-2]), float(out[-1])
        print(f"  {label:<32} eager {e:9.1f} ms  ortwrap {o:9.1f} ms  ratio ortwrap/eager = {o / e:.2f}x", flush=True)


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]) if len(sys.argv) == 6 else None)
    elif len(sys.argv) >= 2 and sys.argv[1] == "--load":
        load(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    else:
        main()
