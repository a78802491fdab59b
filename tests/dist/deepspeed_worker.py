"""One rank of the DeepSpeed tests (launched by tests/test_distributed.py with torchrun, 2 ranks, gloo).

For each case, trains the same model with plain DeepSpeed and with ``deepspeed.initialize(model=
ORTWrap(model))`` on per-rank data, and writes the losses, final parameters and ZeRO-3 observations
of this rank to ``$ORTWRAP_DIST_OUT/<case>.rank<r>.json``; the test compares them. ``ORTWRAP_ENGINE``
(set by the test) picks the engine of every ORTWrap here; each result says which engine ran.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from ortwrap import ORTWrap, UnsupportedInputError

STEPS = 4
BATCH = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Outer(nn.Module):
    """ZeRO-3 with ORTWrap around one submodule only: DeepSpeed's hooks manage ``pre`` and ``post``,
    ortwrap manages ``body`` (one of whose parameters is frozen)."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)
        body = Net()
        body.fc1.bias.requires_grad_(False)
        self.body = ORTWrap(body, fallback=False) if wrap else body
        self.post = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.relu(self.body(self.pre(x))))


class Deep(nn.Module):
    """Five submodules that own parameters: per-submodule gathering has something to spread out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.fc1(x)))
        h = h + torch.relu(self.fc3(torch.tanh(self.fc2(h))))
        return self.head(h)


class ScaleAndCount(torch.autograd.Function):
    """Returns a tensor and an int: ortwrap cannot bridge it, so the export fails and ORTWrap falls back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor):
        return x * 2, 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        return grad * 2


class Unexportable(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleAndCount.apply(super().forward(x))[0]


class EvalUnexportable(Unexportable):
    """Trains on ORT; only its eval-mode path cannot be built (fallback is per input signature)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Net.forward(self, x) if self.training else super().forward(x)


def config(stage: int, accumulation: int = 1) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        # Partition every parameter, however small (the default keeps small ones whole).
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(n)]


def full_params(engine) -> dict[str, list]:
    """The engine's parameters, whole (gathered under ZeRO-3), by the wrapped module's names."""
    out = {}
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        for name, p in params.items():
            out[name.removeprefix("module.").replace("body.module.", "body.")] = p.detach().clone().tolist()
    return out


def deepspeed_hooks(module: nn.Module) -> int:
    """How many forward/backward hooks DeepSpeed registered on ``module`` and its submodules."""
    n = 0
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks):
            n += sum((getattr(h, "__module__", None) or "").startswith("deepspeed.") for h in hooks.values())
    return n


def train(model: nn.Module, stage: int, wrap: bool, accumulation: int = 1, **options) -> dict:
    if wrap and not isinstance(model, Outer):
        model = ORTWrap(model, fallback=isinstance(model, Unexportable), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, accumulation))
    rank = dist.get_rank()
    ortwrap = engine.module if isinstance(engine.module, ORTWrap) else getattr(engine.module, "body", None)
    hooks_before = deepspeed_hooks(ortwrap.module) if wrap else 0
    losses, partitioned = [], []
    tracker = None
    if options.get("zero3_gather") == "submodule":
        from ortwrap.integrations import zero3_layers

        tracker = zero3_layers.GatherTracker()
    for step, (x, y) in enumerate(batches(rank, STEPS * accumulation)):
        if tracker is not None and step == 1:  # (the first step exported, with every parameter whole)
            from ortwrap.integrations.deepspeed import _state

            _state(ortwrap).table.tracker = tracker
        if stage == 3 and step == 1:
            engine(x)  # a forward whose outputs are dropped without a backward
        if isinstance(model, EvalUnexportable) and step == 2:  # (a wrapper answers its module's class)
            with torch.no_grad():  # an inference call that falls back; the next steps train on ORT
                engine.eval()
                engine(x)
                engine.train()
        out = engine(x)
        loss = ((out - y) ** 2).mean()
        engine.backward(loss)
        if stage == 3:
            # Between backward and step every parameter is partitioned again (empty data).
            partitioned.append(all(p.data.numel() == 0 for p in engine.module.parameters()))
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "params": full_params(engine), "partitioned_after_backward": partitioned}
    if tracker is not None:
        result["gathers"] = tracker.events
        result["live_layers_peak"] = tracker.live_layers_peak
        result["live_numel_peak"] = tracker.peak
        result["handed_alive_after"] = len(tracker.handed)
        result["n_layers"] = len(_state(ortwrap).table.layers)
        result["model_numel"] = sum(p.ds_numel for p in ortwrap.parameters())
    if wrap:
        # ortwrap hid DeepSpeed's hooks on the wrapped module's submodules while exporting: restored.
        result["deepspeed_hooks"] = [hooks_before, deepspeed_hooks(ortwrap.module)]
        result["fallback"] = str(ortwrap.fallback_reason) if ortwrap.fallback_reason else None
        if ortwrap._engine is not None:  # engine="onnxruntime": AOTAutograd's graphs, no export, no PythonOp
            result["engine"] = ortwrap._engine.name
            result["export_count"] = ortwrap._engine.build_count  # one build for every training step
            result["python_ops"] = 0
        else:
            result["engine"] = "training"
            result["export_count"] = ortwrap.export_count  # one graph for every training step
            result["program_runs"] = [p.runs for p in ortwrap.programs()]
            artifacts = ortwrap.last_artifacts
            result["exporter"] = artifacts.exporter if artifacts is not None else None
            result["python_ops"] = (
                sum(n.op_type == "PythonOp" for n in artifacts.pre_grad.graph.node) if artifacts is not None else None
            )
    if stage == 3:
        with torch.no_grad():  # an eval-style run: gathered for the forward, partitioned right after
            engine.eval()
            out = engine(batches(rank, 1)[0][0])
            engine.train()
        result["eval_out_shape"] = list(out.shape)
        if wrap:  # ortwrap partitions its parameters right after a run without backward
            result["gathered_after_no_grad"] = [n for n, p in ortwrap.named_parameters() if p.data.numel()]
    engine.destroy()
    return result


def build(
    init: bool, stage: int, partial: bool = False, wrap: bool = False, fallback: bool = False, deep: bool = False
) -> nn.Module:
    torch.manual_seed(0)
    if deep:
        return Deep()
    if partial:
        return Outer(wrap)
    if fallback:
        return EvalUnexportable() if fallback == "eval" else Unexportable()
    if init:
        with deepspeed.zero.Init(config_dict_or_path=config(stage)):
            return Net()
    return Net()


class GatherRows(torch.autograd.Function):
    """All-gathers rows with ``deepspeed.comm``; the backward all-reduces the gradient with it and keeps
    this rank's rows (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world = deepspeed.comm.get_world_size()
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        deepspeed.comm.allgather_fn(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        deepspeed.comm.all_reduce(grad)
        return grad.chunk(deepspeed.comm.get_world_size())[deepspeed.comm.get_rank()].contiguous()


class CommNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(GatherRows.apply(torch.tanh(self.fc1(x))))


def case_deepspeed_comm() -> dict:
    """A Function that calls deepspeed.comm collectives trains under ORTWrap like in eager PyTorch."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from parity import check_parity

    rank = dist.get_rank()

    def make_inputs(batch: int, gen: torch.Generator) -> tuple[tuple, dict]:
        for _ in range(rank + 1):
            x = torch.randn(batch, 6, generator=gen)
        return (x,), {}

    wrapped = check_parity(CommNet, make_inputs, batch_sizes=(4, 4, 3))
    return {"export_count": wrapped.export_count}


def case_zero3_leaf() -> dict:
    """A ZeRO-3 leaf module inside ORTWrap is refused with a clear error (its gradients would not be reduced)."""
    from deepspeed.utils import set_z3_leaf_modules

    model = build(False, 3)
    set_z3_leaf_modules(model, [nn.LayerNorm])
    wrapped = ORTWrap(model, fallback=False)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=opt, config=config(3))
    result: dict = {"raised": None}
    try:
        engine(batches(dist.get_rank(), 1)[0][0])
    except Exception as e:
        result = {"raised": type(e).__name__, "message": str(e)}
    try:  # the wrong wrap order
        ORTWrap(engine)
    except UnsupportedInputError as e:
        result["engine_inside"] = str(e)
    engine.destroy()
    return result


def case_zero3_submodule_gpt() -> dict:
    """A small GPT (embeddings with int64 ids as the gather anchor, SDPA attention, LayerNorm, GELU MLP,
    an untied LM head) under ZeRO-3 with ``zero3_gather="submodule"``: plain DeepSpeed, then ORTWrap
    with the default (dynamo) exporter and with the TorchScript exporter."""
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    from tiny_gpt import GPTConfig, TinyGPT

    from ortwrap.integrations import zero3_layers
    from ortwrap.integrations.deepspeed import _state

    cfg = GPTConfig(vocab=64, d=32, heads=4, layers=2, max_len=16)

    class UntiedGPT(TinyGPT):  # (a tied head is refused by zero3_gather="submodule")
        def __init__(self) -> None:
            super().__init__(cfg)
            self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

        def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def run(**options) -> dict:
        torch.manual_seed(0)
        model: nn.Module = UntiedGPT()
        if options:
            model = ORTWrap(model, fallback=False, zero3_gather="submodule", **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(3))
        gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        tracker = zero3_layers.GatherTracker()
        losses = []
        for step in range(STEPS):
            if options and step == 1:
                _state(model).table.tracker = tracker
            ids = torch.randint(0, cfg.vocab, (BATCH, 12), generator=gen)
            loss = engine(ids, (3 * ids + 1) % cfg.vocab)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        result = {"losses": losses}
        if options:
            result["exporter"] = model.last_artifacts.exporter
            result["fallback"] = str(model.fallback_reason) if model.fallback_reason else None
            result["live_layers_peak"] = tracker.live_layers_peak
        engine.destroy()
        return result

    return {"plain": run(), "dynamo": run(exporter="auto"), "torchscript": run(exporter="torchscript")}


def main() -> None:
    # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce kernel here (a minute or
    # more on a fresh machine, cached in ~/.cache/torch_extensions); gloo does all these tests need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out_dir = os.environ["ORTWRAP_DIST_OUT"]
    cases = sys.argv[1:]
    for case in cases:
        stage = int(case[4]) if case.startswith("zero") else 0  # zero1, zero2, zero3, zero3_init, zero3_accum
        accumulation = 2 if case.endswith("_accum") else 1
        init = case.endswith("_init")
        partial = case.endswith("_partial")
        fallback = "eval" if case.endswith("_evalfallback") else case.endswith("_fallback")
        result: dict = {"case": case, "rank": rank}
        try:
            if case == "deepspeed_comm":
                result.update(case_deepspeed_comm())
            elif case == "zero3_submodule_gpt":
                result.update(case_zero3_submodule_gpt())
            elif case == "zero3_leaf":
                result.update(case_zero3_leaf())
            elif case == "zero3_cached":  # run twice by the test, the build cache shared between the runs
                result["ortwrap"] = train(build(True, 3, wrap=True), 3, wrap=True)
            elif case in ("zero3_submodule", "zero3_submodule_dynamo"):
                # (zero3_submodule_dynamo: the default exporter, which is the dynamo exporter)
                options = {} if case.endswith("_dynamo") else {"exporter": "torchscript"}
                result["plain"] = train(build(False, 3, deep=True), 3, wrap=False)
                result["ortwrap"] = train(build(False, 3, deep=True), 3, wrap=True, zero3_gather="submodule", **options)
            else:
                plain_model = build(init, stage, partial, fallback=fallback)
                our_model = build(init, stage, partial, wrap=True, fallback=fallback)
                result["plain"] = train(plain_model, stage, wrap=False, accumulation=accumulation)
                result["ortwrap"] = train(our_model, stage, wrap=True, accumulation=accumulation)
        except Exception:
            result["error"] = traceback.format_exc()
        with open(os.path.join(out_dir, f"{case}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()


if __name__ == "__main__":
    main()
