"""ORTWrap presents the module it wraps: names, signature, class, attributes and methods are the
module's, and the module's own methods that call ``self(...)`` run on ONNX Runtime."""

from __future__ import annotations

import inspect

import pytest
import torch
from parity import assert_close
from torch import nn

from ortwrap import ORTWrap


class Net(nn.Module):
    """A module with a root parameter, a buffer, children and methods of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.norm = nn.LayerNorm(3)
        self.register_buffer("shift", torch.linspace(-1, 1, 3))
        self.label_smoothing = 0.0
        self.calls = 0

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.norm(self.body(features) * self.scale) + self.shift
        if labels is not None:
            return nn.functional.cross_entropy(out, labels, label_smoothing=self.label_smoothing)
        return out

    def train_step(self, features, labels):
        self.calls += 1
        return self(features, labels)

    def predict(self, features):
        return self.forward(features).argmax(-1)


def batch(b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)


def test_names_are_the_bare_modules():
    m = Net()
    w = ORTWrap(m)
    for what in ("named_parameters", "named_buffers"):
        assert [n for n, _ in getattr(w, what)()] == [n for n, _ in getattr(m, what)()], what
    assert [n for n, _ in w.named_modules()] == [n for n, _ in m.named_modules()]
    assert next(iter(w.named_modules()))[1] is w  # the wrapper stays the root
    assert [n for n, _ in w.named_children()] == ["body", "norm"]
    assert w.get_submodule("body.0") is m.body[0] and w.get_parameter("scale") is m.scale
    assert list(w.state_dict()) == list(m.state_dict())

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = ORTWrap(Net())

    assert [n for n, _ in Parent().named_parameters()][:2] == ["enc.scale", "enc.body.0.weight"]


def test_weight_decay_groups_and_freezing_by_name_train_like_eager():
    eager, m = Net(), Net()
    w = ORTWrap(m, fallback=False)

    def optimizer(model):
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith("body.0."))  # frozen by name
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight") and p.requires_grad]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}])

    opt_e, opt_o = optimizer(eager), optimizer(w)
    assert [len(g["params"]) for g in opt_o.param_groups] == [len(g["params"]) for g in opt_e.param_groups] == [2, 3]
    for step, b in enumerate((4, 7, 3)):
        x, y = batch(b, step)
        for model, opt in ((eager, opt_e), (w, opt_o)):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(eager.named_parameters(), w.parameters()):
        assert_close(q.detach(), p.detach(), n)
    assert w.fallback_reason is None


def test_signature_class_and_name():
    m = Net()
    w = ORTWrap(m)
    assert inspect.signature(w.forward) == inspect.signature(m.forward)
    assert inspect.signature(type(w).forward) == inspect.signature(Net.forward)
    assert w.__class__ is Net and isinstance(w, Net) and isinstance(w, ORTWrap)
    assert type(w).__name__ == "Net" and w._get_name() == "Net"
    assert repr(w).startswith("ORTWrap(Net(")
    assert "train_step" in dir(w) and "export_count" in dir(w)


def test_attributes_and_registration_reach_the_module():
    m = Net()
    w = ORTWrap(m, fallback=False)
    x, y = batch(4)
    assert w.label_smoothing == 0.0 and w.body is m.body and w.shift is m.shift
    loss0 = w(x, y).item()
    # Set through the wrapper: the module sees it and the next call follows eager.
    w.label_smoothing = 0.3
    assert m.label_smoothing == 0.3 and "label_smoothing" not in vars(w)
    torch.testing.assert_close(w(x, y).item(), Net.forward(m, x, y).item())
    assert w(x, y).item() != loss0
    w.register_buffer("extra", torch.ones(1))
    assert m.extra is w.extra and "extra" in m.state_dict()
    w.body = nn.Sequential(nn.Linear(6, 3))  # a submodule replaced through the wrapper
    assert m.body is w.body
    assert_close(w(x).detach(), Net.forward(m, x).detach(), "output after replacing a submodule")
    del w.label_smoothing
    assert not hasattr(m, "label_smoothing")
    w.train(False)
    assert not m.training and not w.training and not m.body.training
    w.train()
    assert m.training and w.training


def test_methods_calling_self_run_on_ort_with_eager_gradients():
    eager, m = Net(), Net()
    w = ORTWrap(m, fallback=False)
    x, y = batch(5)
    loss = w.train_step(x, y)
    expected = eager.train_step(x, y)
    assert m.calls == 1 and "forward" not in vars(m)  # the routing is lifted afterwards
    assert w.programs(), "train_step's self(...) did not run on ONNX Runtime"
    assert_close(loss.detach(), expected.detach(), "train_step loss")
    loss.backward()
    expected.backward()
    for (n, p), q in zip(eager.named_parameters(), w.parameters()):
        assert_close(q.grad, p.grad, f"{n}.grad")
    with torch.no_grad():
        assert torch.equal(w.predict(x), eager.predict(x))
    assert len(w.programs()) == 2  # predict's self.forward(...) ran an inference program


def test_hooks_on_the_wrapper_run_around_ort():
    w = ORTWrap(Net(), fallback=False)
    x, _ = batch(3)
    seen = []
    w.register_forward_hook(lambda mod, args, out: seen.append(mod))
    w(x)
    w.train_step(x, None)
    assert seen == [w, w]


def test_transformers_model_attributes_methods_and_save_pretrained(tmp_path):
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(config)
    w = ORTWrap(m, fallback=False)
    assert isinstance(w, transformers.PreTrainedModel)
    assert w.config is m.config and w.main_input_name == "input_ids"
    assert w.generation_config is m.generation_config
    assert transformers.utils.find_labels(w.__class__) == ["labels"]
    assert inspect.signature(w.forward) == inspect.signature(m.forward)
    w.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for (n, p), q in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), n
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    w.eval()
    with torch.no_grad():
        out = w(input_ids=ids, attention_mask=torch.ones_like(ids))
        expected = m.__class__.forward(m, input_ids=ids, attention_mask=torch.ones_like(ids))
    assert_close(out.logits, expected.logits, "logits")


class Result:
    """A user's result class: a plain object, not a dataclass."""

    def __init__(self, logits: torch.Tensor, hidden: list[torch.Tensor], step: int) -> None:
        self.logits = logits
        self.hidden = hidden
        self.step = step


class Slotted:
    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.lin2 = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[Result, Slotted]:
        h = self.lin(x)
        return Result(self.lin2(h.tanh()), [h], step=3), Slotted(h.sigmoid())


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_output_objects_are_rebuilt_from_each_calls_tensors(exporter):
    """A plain object (``__dict__``) or a slotted one holding tensors comes back as a new object of
    its class per call, holding that call's values (never the tensors of the export trace)."""
    import copy

    torch.manual_seed(0)
    eager = ReturnsObject()
    w = ORTWrap(copy.deepcopy(eager), fallback=False, exporter=exporter)
    previous = None
    for b in (2, 5, 3):
        x = torch.randn(b, 4)
        (out, slotted), (expected, expected_slotted) = w(x), eager(x)
        assert type(out) is Result and type(slotted) is Slotted and out.step == 3
        assert_close(out.logits, expected.logits, "logits")
        assert_close(out.hidden[0], expected.hidden[0], "hidden")
        assert_close(slotted.logits, expected_slotted.logits, "slotted logits")
        (out.logits.sum() + slotted.logits.sum()).backward()
        if previous is not None:
            assert previous is not out and previous.logits is not out.logits
        previous = out
    assert len(w.programs()) == 1


class ReturnsSet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        return y, frozenset([y.sum()])


@pytest.mark.parametrize("exporter", ["auto", "dynamo", "torchscript"])
def test_an_output_object_ortwrap_cannot_rebuild_gets_an_error_that_names_it(exporter):
    import logging

    from ortwrap.errors import UnsupportedOutputError

    w = ORTWrap(ReturnsSet(), fallback=False, exporter=exporter)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("ortwrap").addHandler(handler)  # (records at WARNING and above)
    try:
        # Raised inside the trace, it comes out as itself, not as the exporter's failure; with "auto" no
        # second exporter is tried for it (none could take those outputs).
        with pytest.raises(UnsupportedOutputError, match=r"output `output\[1\]` \(builtins\.frozenset\) holds"):
            w(torch.randn(2, 4))
    finally:
        logging.getLogger("ortwrap").removeHandler(handler)
    assert not [m for m in seen if "exporter failed" in m], seen


def test_generate_gives_eagers_tokens_and_never_switches_ort_off():
    import pytest

    from ortwrap import FallbackWarning

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0, pad_token_id=0
    )
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(config).eval()
    eager = transformers.GPT2LMHeadModel(config).eval()
    eager.load_state_dict(m.state_dict())
    w = ORTWrap(m, fallback=False)
    ids = torch.randint(1, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    # generate passes a KV-cache object ORT cannot take: those calls run in PyTorch, said once.
    with pytest.warns(FallbackWarning, match="cache"):
        tokens = w.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, eager.generate(ids, max_new_tokens=5, do_sample=False))
    assert w.fallback_reason is None and "forward" not in vars(m)


class Pair:
    """A result type registered with torch's pytree (as libraries register theirs)."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second


def test_a_pytree_registered_output_is_rebuilt_by_its_registration():
    import copy

    import torch.utils._pytree as pytree

    rebuilt = []

    def unflatten(children, context):
        rebuilt.append(context)
        return Pair(*children)

    pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], "pair"), unflatten)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            y = self.lin(x)
            return Pair(y.relu(), y * 2)

    torch.manual_seed(0)
    eager = M()
    w = ORTWrap(copy.deepcopy(eager), fallback=False)
    for b in (2, 5):
        x = torch.randn(b, 4)
        out, expected = w(x), eager(x)
        assert type(out) is Pair and rebuilt[-1] == "pair"
        assert_close(out.first, expected.first, "first")
        assert_close(out.second, expected.second, "second")
        (out.first.sum() + out.second.sum()).backward()
