"""exporter="dynamo": selection, dynamic shapes and guards, the training-correct translations,
refusals, unsupported ops, and ``verify=True`` for both exporters.

The core parity tests (test_models, test_io, test_ops, parts of test_wrapper) and the Function zoo
(test_functions) already run with both exporters through the ``exporter`` fixture.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from parity import assert_close, check_parity
from tiny_gpt import GPTConfig, TinyGPT
from torch import nn

from ortwrap import ORTWrap
from ortwrap.api import FallbackWarning
from ortwrap.errors import ExportError, PassError, VerificationError
from ortwrap.export.type_inference import infer_types
from ortwrap.passes import run_pass
from ortwrap.passes.sequence_ops import RefuseSequenceOpsPass
from ortwrap.verify import VerificationSkipped


def _ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def test_environment_selects_the_dynamo_exporter(monkeypatch):
    monkeypatch.setenv("ORTWRAP_EXPORTER", "dynamo")
    w = ORTWrap(nn.Linear(4, 3), fallback=False)
    assert w.options.exporter == "dynamo"
    w(torch.randn(2, 4)).sum().backward()
    assert _opset(w.last_artifacts.exported) >= 18  # the dynamo exporter's opset; TorchScript's is 17
    monkeypatch.delenv("ORTWRAP_EXPORTER")
    # The default: dynamo where torch deprecates the TorchScript exporter (every supported release),
    # TorchScript when the dynamo capture fails.
    default = ORTWrap(nn.Linear(4, 3)).options
    assert default.exporter == "auto" and default.exporters == ("dynamo", "torchscript")
    assert ORTWrap(nn.Linear(4, 3), exporter="torchscript").options.exporters == ("torchscript",)
    with pytest.raises(ValueError, match="exporter='fx'"):
        ORTWrap(nn.Linear(4, 3), exporter="fx")


def test_lm_with_new_batch_and_sequence_lengths_exports_once():
    cfg = GPTConfig(vocab=64, d=32, heads=2, layers=2, max_len=32)

    def inputs(b, g):
        t = {4: 16, 7: 9, 3: 23}[b]
        ids = torch.randint(0, cfg.vocab, (b, t), generator=g)
        return (ids, torch.roll(ids, -1, 1)), {}

    w = check_parity(lambda: TinyGPT(cfg), inputs, loss_fn=lambda out: out, wrap_options={"exporter": "dynamo"})
    assert w.export_count == 1
    assert "Gather" in _ops(w.last_artifacts.pre_grad)


def test_a_dim_the_capture_fixed_is_guarded_and_reexported():
    """torch.export specializes a size-1 dimension: a later size gets its own, correct, program."""
    m = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(m)
    w = ORTWrap(m, exporter="dynamo", fallback=False)
    for b in (1, 6, 1, 3):
        x = torch.randn(b, 5)
        assert_close(w(x), ref(x), f"batch {b}")
    programs = w.programs()
    assert len(programs) == 2 and all(p.shape_guards for p in programs)
    assert w.export_count == 2  # batch 1, then one dynamic program for 6 and 3


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6, momentum=0.3)
        self.out = nn.Linear(6, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.out(torch.relu(self.bn(self.l(x)))), y, label_smoothing=0.2)


def _bn_inputs(b, g):
    return (torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g)), {}


def test_training_batchnorm_and_label_smoothing_are_exported_for_training():
    """torchlib exports BatchNorm in inference mode and ignores label_smoothing: ortwrap's
    translations keep training semantics (check_parity compares the running statistics too)."""
    w = check_parity(BatchNormNet, _bn_inputs, loss_fn=lambda out: out, wrap_options={"exporter": "dynamo"})
    bn = [n for n in w.last_artifacts.pre_grad.graph.node if n.op_type == "BatchNormalization"]
    assert bn and onnx.helper.get_attribute_value(next(a for a in bn[0].attribute if a.name == "training_mode")) == 1


def test_verify_passes_for_a_correct_build_with_both_exporters(exporter):
    w = ORTWrap(BatchNormNet(), exporter=exporter, verify=True, fallback=False)
    ref = copy.deepcopy(w.module)
    (x, y), _ = _bn_inputs(8, torch.Generator().manual_seed(0))
    loss = w(x, y)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    # Verification ran an extra eager and ORT step, but restored buffers and left .grad alone.
    assert_close(loss.detach(), ref_loss.detach(), "loss")
    assert_close(w.module.bn.running_mean, ref.bn.running_mean, "running_mean")
    assert_close(w.module.l.weight.grad, ref.l.weight.grad, "l.weight grad")


def test_verify_catches_a_silently_wrong_dynamo_translation(monkeypatch):
    """Without ortwrap's translations the dynamo export trains BatchNorm in inference mode and drops
    label smoothing, with no error: verify=True must raise, naming what differs."""
    from ortwrap.export import dynamo, translations

    real = translations.training_translations

    def torchlib_only():
        table = real()
        del table[torch.ops.aten._native_batch_norm_legit_functional.default]
        del table[torch.ops.aten.cross_entropy_loss.default]
        return table

    monkeypatch.setattr(dynamo, "training_translations", torchlib_only)
    # build_cache=False: a good build of the same model may be in the session's cache, and this test
    # breaks ortwrap's own code, which the cache key does not see.
    w = ORTWrap(BatchNormNet(), exporter="dynamo", verify=True, fallback=False, build_cache=False)
    (x, y), _ = _bn_inputs(8, torch.Generator().manual_seed(0))
    with pytest.raises(VerificationError, match=r"output 0: max \|ORT - eager\|") as info:
        w(x, y)
    assert "running_mean" in str(info.value) and "gradient of parameter 'l.weight'" in str(info.value)
    assert not w.programs()  # the wrong program is not kept for later calls
    with pytest.raises(VerificationError):
        w(x, y)


def test_verify_catches_a_broken_pass_with_the_torchscript_exporter(monkeypatch):
    from ortwrap.passes import batchnorm_running_stats

    monkeypatch.setattr(
        batchnorm_running_stats.BatchNormRunningStatsPass,
        "call",
        lambda self, model: batchnorm_running_stats.ir.passes.PassResult(model, modified=False),
    )
    # build_cache=False: this test breaks ortwrap's own code, which the cache key does not see, and a
    # good build of the same capture may be in the session's cache (the key names the exporter that
    # built it, not the ``exporter`` option's list)
    w = ORTWrap(BatchNormNet(), verify=True, fallback=False, build_cache=False)
    (x, y), _ = _bn_inputs(8, torch.Generator().manual_seed(0))
    with pytest.raises(VerificationError, match=r"buffer 'bn\.running_mean' after the step"):
        w(x, y)


def test_verify_skips_graphs_with_dropout_and_says_so():
    w = ORTWrap(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3)), verify=True, exporter="dynamo")
    with pytest.warns(VerificationSkipped, match="Dropout"):
        w(torch.randn(3, 4)).sum().backward()


def test_verify_from_the_environment(monkeypatch):
    monkeypatch.setenv("ORTWRAP_VERIFY", "1")
    assert ORTWrap(nn.Linear(2, 2)).options.verify is True


def _sequence_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("SplitToSequence", ["h"], ["seq"], axis=1, name="split_seq"),
        helper.make_node("SequenceAt", ["seq", "zero"], ["first"], name="at0"),
        # integer-only sequence use (shape computation): allowed
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("SequenceConstruct", ["shape"], ["shapes"], name="shape_seq"),
        helper.make_node("SequenceAt", ["shapes", "zero"], ["shape0"], name="shape_at"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4]),
        ],
        [
            helper.make_tensor_value_info("first", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("shape0", TensorProto.INT64, None),
        ],
        [onnx.numpy_helper.from_array(np.array(0, dtype=np.int64), "zero")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ir(model: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(infer_types(model))


def test_sequence_ops_on_the_gradient_path_are_refused():
    from onnx import TensorProto, helper

    # read at an index the graph computes: the elements are not known, the sequence stays (refused)
    model = _sequence_model()
    model.graph.node[2].input[1] = "k"
    model.graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, []))
    with pytest.raises(PassError, match=r"'split_seq' is a SplitToSequence on the gradient path"):
        run_pass(RefuseSequenceOpsPass(), _ir(model))
    # read at a constant index: lowered to a Slice (whose gradient ORT has), nothing refused
    lowered = run_pass(RefuseSequenceOpsPass(), _ir(_sequence_model())).model
    ops = [n.op_type for n in lowered.graph]
    assert "SplitToSequence" not in ops and "Slice" in ops, ops
    model = _sequence_model()
    del model.graph.node[:3]
    del model.graph.output[0]
    run_pass(RefuseSequenceOpsPass(), _ir(model))  # integer-only sequence ops pass


class MatrixExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 16)

    def forward(self, x):
        return torch.linalg.matrix_exp(self.l(x).view(-1, 4, 4) * 0.1)


def _aten_operators(w) -> set[str]:
    return {
        a.s.decode()
        for n in w.last_artifacts.pre_grad.graph.node
        if n.op_type == "ATen"
        for a in n.attribute
        if a.name == "operator"
    }


def test_an_op_without_translation_runs_as_an_aten_node():
    """torchlib has no translation (and torch no decomposition) for matrix_exp: as with the
    TorchScript exporter, it runs PyTorch's kernel inside the graph, with PyTorch's gradient."""
    w = check_parity(
        MatrixExp, lambda b, g: ((torch.randn(b, 4, generator=g),), {}), wrap_options={"exporter": "dynamo"}
    )
    assert "linalg_matrix_exp" in _aten_operators(w)
    assert w.last_artifacts.exporter == "dynamo"


def test_an_op_that_cannot_run_anywhere_falls_back_naming_it():
    """An op with neither a translation nor an argument the ATen bridge can carry (a list of
    tensors) falls back to PyTorch, naming the op (or raises with fallback=False)."""

    class ListOfTensors(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            return torch.ops.aten._foreach_mul([h, h], 2.0)[0].sum()

    w = ORTWrap(ListOfTensors(), exporter="dynamo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w(torch.randn(3, 4)).backward()
    messages = [str(c.message) for c in caught if issubclass(c.category, FallbackWarning)]
    assert len(messages) == 1 and "_foreach_mul" in messages[0], messages
    with pytest.raises(ExportError, match=r"_foreach_mul"):
        ORTWrap(ListOfTensors(), exporter="dynamo", fallback=False)(torch.randn(3, 4))


class BranchesOnData(torch.autograd.Function):
    """A forward that branches on its input's values, with its own backward (3, not autograd's 2)."""

    @staticmethod
    def forward(ctx, x):
        if x.abs().max() > 1e6:
            raise ValueError("boom 42: input too large")
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 3.0


class WithBranchesOnData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.l2(BranchesOnData.apply(self.l1(x)))


def test_auto_builds_a_function_that_branches_on_data_with_the_torchscript_exporter():
    """The dynamo exporter runs a Function's forward on fake tensors, where a branch on data cannot be
    decided: ``"auto"`` builds it with the TorchScript exporter, whose graph calls the Function's own
    forward (the raise included) and backward. ``exporter="dynamo"`` runs it as a split capture
    (split_capture.py): the Linears are fragments on ORT, the Function runs in PyTorch with its
    own backward (3, which the gradients check)."""

    def inputs(b, g):
        return (torch.randn(b, 6, generator=g),), {}

    split = check_parity(WithBranchesOnData, inputs, wrap_options={"exporter": "dynamo"})
    assert split.fallback_reason is None and "data-dependent" in split.split_capture.reason
    assert split.split_capture.fragments and all(f.on_ort for f in split.split_capture.fragments)
    assert split.split_capture.parameters_in_pytorch == []
    with pytest.raises(ValueError, match="boom 42"):
        split(torch.randn(3, 6) * 1e9)
    w = check_parity(WithBranchesOnData, inputs, wrap_options={"exporter": "auto"})
    assert w.last_artifacts.exporter == "torchscript"
    with pytest.raises(ValueError, match="boom 42"):
        w(torch.randn(3, 6) * 1e9)


def test_aten_ops_option_with_dynamo():
    """``aten_ops`` runs the listed ops on PyTorch's kernels with the dynamo exporter too."""
    make = lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))  # noqa: E731
    w = check_parity(make, lambda b, g: ((torch.randn(b, 4, generator=g),), {}),
                     wrap_options={"exporter": "dynamo", "aten_ops": ("gelu",)})  # fmt: skip
    assert "gelu" in _aten_operators(w)


def test_parameters_keep_their_identity():
    """The exporter's optimizer would merge equal initializers (two fresh LayerNorm weights are both
    ones): ortwrap exports with optimize=False and feeds every parameter as its own input."""
    m = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4))
    w = check_parity(lambda: copy.deepcopy(m), lambda b, g: ((torch.randn(b, 4, generator=g),), {}),
                     wrap_options={"exporter": "dynamo"})  # fmt: skip
    inputs = {i.name for i in w.last_artifacts.pre_grad.graph.input}
    assert {"module.0.weight", "module.2.weight", "module.0.bias", "module.2.bias"} <= inputs


def test_the_lazy_torchlib_registry_has_from_torchlibs_entries():
    """ortwrap builds torchlib's registry without inferring every function's signature up front
    (``compat._lazy_torchlib``): the same entries, in the same order, with the same signatures."""
    from ortwrap._compat import torch as compat

    lazy = compat._lazy_torchlib(20)
    eager = compat._resolve(compat._DYN_REGISTRY).from_torchlib(opset_version=20)
    assert lazy.opset_version == eager.opset_version == 20
    assert list(lazy.functions) == list(eager.functions)
    for key, metas in eager.functions.items():
        got = lazy.functions[key]
        assert len(got) == len(metas), key
        for a, b in zip(got, metas):
            fields = ("onnx_function", "fx_target", "is_complex", "is_custom", "opset_introduced", "device")
            assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], key
            assert str(a.signature) == str(b.signature), key


class TwoBlocks(nn.Module):
    """Nested modules, so that a node's stack trace holds several ``forward`` frames."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)  # <- the user's line
        return x.softmax(-1)


def test_stack_traces_read_lines_lazily_and_record_the_same_text():
    """``compat.lazy_stack_trace_lines`` (during ortwrap's capture and translation) makes torch read a
    frame's source line only when the trace is formatted: every node records the same stack trace,
    source lines included, and torch's function is restored afterwards."""
    import linecache

    from ortwrap._compat import torch as compat

    original = compat._resolve(compat._SYMBOLIZED_TB)
    traces = []
    for lazy in (False, True):
        linecache.clearcache()
        torch.manual_seed(0)
        with compat.lazy_stack_trace_lines() if lazy else contextlib.nullcontext():
            program = torch.export.export(TwoBlocks(), (torch.randn(3, 4),), strict=False)
        traces.append([(n.name, n.meta.get("stack_trace")) for n in program.graph.nodes])
    assert compat._resolve(compat._SYMBOLIZED_TB) is original
    with compat.lazy_stack_trace_lines():
        with compat.lazy_stack_trace_lines():  # nested (another thread's capture): the outer one still holds
            pass
        assert compat._resolve(compat._SYMBOLIZED_TB) is not original
    assert compat._resolve(compat._SYMBOLIZED_TB) is original
    assert traces[0] == traces[1]
    user = [t for _, t in traces[1] if t and "x = x + block(x)  # <- the user's line" in t]
    assert user and all(f'File "{__file__}"' in t for t in user), traces[1]


def test_op_signatures_are_parsed_once_per_standard_operator():
    """``compat._op_signatures_memoized`` (around the exporter's translation) parses a standard ONNX
    operator's schema once: the same signature as a fresh parse; other domains' schemas are parsed
    each time; onnx_ir's method is restored afterwards."""
    from onnx import defs

    from ortwrap._compat import torch as compat

    cls = ir.schemas.OpSignature
    original = cls.__dict__["from_op_schema"]
    fresh = cls.from_op_schema(defs.get_schema("Gemm", 13))
    with compat._op_signatures_memoized():
        first = cls.from_op_schema(defs.get_schema("Gemm", 13))
        again = cls.from_op_schema(defs.get_schema("Gemm", 13))  # a new OpSchema object of the same operator
        older = cls.from_op_schema(defs.get_schema("Gemm", 9))
        ml = defs.get_schema("LinearClassifier", 1, "ai.onnx.ml")
        other = (cls.from_op_schema(ml), cls.from_op_schema(ml))
    assert cls.__dict__["from_op_schema"] is original
    assert again is first and str(first) == str(fresh) and first == fresh
    assert older.since_version == 9 and older != first
    assert other[0] is not other[1] and other[0] == other[1]


class DetachInPlace(nn.Module):
    """``detach_`` of a fresh tensor (as HF's ``DynamicCache`` does) and of a value used after it."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x):
        h = self.l(x)
        offset = torch.ones(4).detach_()
        if not self.shared:
            return torch.tanh(h) + offset
        g = h * 2
        g.detach_()  # eager: no gradient through g, for every later use of it
        return torch.tanh(h) * g + offset


@pytest.mark.parametrize(
    "shared",
    [False, True],
    ids=["fresh", "shared"],
)
def test_detach_in_place_trains_like_eager(shared):
    """A ``detach_`` nothing else reads (HF's ``DynamicCache``) is translated as it is, without the
    functionalizing retrace of the whole graph."""
    w = check_parity(
        lambda: DetachInPlace(shared), lambda b, g: ((torch.randn(b, 4, generator=g),), {}),
        wrap_options={"exporter": "dynamo"},
    )  # fmt: skip
    assert w.last_artifacts.exporter == "dynamo"


class MixedDtypes(nn.Module):
    """Ops whose inputs the exporter's type promotion casts: int / int, int * float, float64 + float32."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, idx):
        h = self.l(x)
        return h * (idx / 3) + idx * 2.5 + (h.double() + h).float() * (h > 0)


def test_type_promotion_matches_the_exporters_pass():
    """ortwrap's type promotion re-runs only the nodes it changes (``compat.insert_type_promotion``):
    the graph is the one the exporter's own pass makes, casts included, and it trains like eager."""
    from ortwrap._compat import torch as compat

    inputs = (torch.randn(3, 4), torch.randint(0, 5, (3, 4)))
    graphs = []
    for promote in (compat._resolve(compat._DYN_PROMOTE), compat.insert_type_promotion):
        gm = torch.export.export(MixedDtypes(), inputs, strict=False).graph_module
        promote(gm)
        graphs.append(str(gm.graph))
    assert graphs[0] == graphs[1]
    assert "convert_element_type" in graphs[1]  # the pass had work to do
    check_parity(
        MixedDtypes,
        lambda b, g: ((torch.randn(b, 4, generator=g), torch.randint(0, 5, (b, 4), generator=g)), {}),
        wrap_options={"exporter": "dynamo"},
    )


def test_export_writes_nothing_to_the_console():
    # torch.export logs a warning when a size-1 batch dimension specializes ("0/1 specialized"); the
    # user did not ask for an export and eager prints nothing: ortwrap's export stays quiet. (A fresh
    # process: pytest's own log capture would hide torch's console handler.)
    import subprocess
    import sys

    # Then a batch ORT's kernels reject (a sequence longer than the position table): the user gets
    # eager's IndexError, and ORT logs no error line of its own.
    code = (
        "import torch\nfrom torch import nn\nfrom ortwrap import ORTWrap\nfrom tiny_gpt import GPTConfig, TinyGPT\n"
        "m = ORTWrap(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), fallback=False, exporter='dynamo', build_cache=False)\n"
        "m(torch.randn(1, 4)).sum().backward()\n"
        "g = ORTWrap(TinyGPT(GPTConfig(vocab=20, d=8, heads=2, layers=1, max_len=8)), fallback=False, build_cache=False)\n"
        "g(torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8)))[0].backward()\n"
        "try:\n    g(torch.randint(0, 20, (2, 12)), torch.randint(0, 20, (2, 12)))\n"
        "except IndexError:\n    pass\nelse:\n    raise AssertionError('no IndexError')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTWRAP_", "TORCH_LOGS"))}
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    env["PYTHONPATH"] = os.pathsep.join([examples, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (a build's progress lines and summary are INFO: nothing at the default WARNING)
    assert proc.stdout == "" and proc.stderr == "", (proc.stdout, proc.stderr[-3000:])
