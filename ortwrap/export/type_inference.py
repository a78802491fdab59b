"""Type inference through ATen nodes: ONNX shape inference, extended by evaluating each
``org.pytorch.aten::ATen`` node on PyTorch's ``meta`` device (:func:`infer_types`).

It runs at build time only, on the exported model before the passes (the ``type_inference`` stage of
``build/stages.py``), again after the rewrites (``passes/shapes_for_gradients.py``) and on a copy for
the GEMM choice (``gemm_choice.py``); the ATen gradient fix-ups read its value types
(``grad/aten.py``). It lives in the export layer, the lowest layer that all of these can import: it
completes what the exporters leave open (the outputs of ATen nodes, which ONNX cannot infer), and it
writes the TorchScript exporter's complex values in the real ``[..., 2]`` form the dynamo exporter
writes (``COMPLEX_MARK``). The runner that executes ATen nodes inside ORT is ``bridge/aten.py``;
this module only asks it how to call an op (``resolve``).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch

from ..bridge.aten import ONNX_TYPES, TORCH_DTYPES, _as_complex, _complex_positions, _is_complex, resolve
from ..graph.names import ATEN_DOMAIN, COMPLEX_MARK, NATIVE_PREFIX, VJP_PREFIX

__all__ = ["infer_types", "meta_outputs", "tensor_from_proto", "value_types"]


def tensor_from_proto(t: onnx.TensorProto) -> torch.Tensor:
    """An ONNX tensor as a torch tensor (bfloat16 included, which numpy cannot hold natively)."""
    array = onnx.numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _proto_constants(model: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """Values of Constant nodes (strings as uint8 bytes, the executor's convention), the TorchScript
    exporter's ``prim::Constant`` ones included (a device, ``"cpu"``): an ATen node taking one is
    evaluated like any other, so that an argument it cannot take inside ORT (a ``Device``) is refused
    here, naming the op, and the complex values downstream are still found (``pairs`` below)."""
    out = {}
    for n in model.graph.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx", "prim"):
            continue
        for a in n.attribute:
            if a.type == onnx.AttributeProto.STRING and a.name in ("value", "value_string"):
                out[n.output[0]] = torch.tensor(list(a.s), dtype=torch.uint8)
            elif a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                out[n.output[0]] = tensor_from_proto(a.t)
    return out


def value_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None]]]:
    """name -> (ONNX element type, shape with None for symbolic dims) for every value whose type
    and rank are known."""
    known = {}
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        tt = v.type.tensor_type
        if tt.elem_type and tt.HasField("shape"):
            known[v.name] = (tt.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])
    return known


#: Sizes that stand in for symbolic dims when an ATen node is evaluated on the meta device: a node is
#: evaluated at each size of a tier, and a dim that differs is symbolic (three sizes: ``rfft``'s
#: ``n // 2 + 1`` is 2 at both 2 and 3). The larger tier where an op refuses the small sizes
#: (``stft``: its n_fft must not exceed the length, a dim ONNX inference left unknown after the
#: exporter's padding).
_STAND_INS = ((2, 3, 5), (1024, 2049, 4099))


def _meta_outputs(node: onnx.NodeProto, op: str, overload: str, known: dict, constants: dict, stand_in: int):
    """The node's results on the meta device, symbolic dims set to ``stand_in``; None if an input is
    unknown. Inputs a ``COMPLEX_MARK`` names are viewed as complex, and complex results stay complex."""
    positions = _complex_positions(op)
    inputs = []
    for i, name in enumerate(node.input):
        if not name:
            inputs.append(None)
        elif name in constants:
            inputs.append(constants[name])
        elif name in known:
            elem, shape = known[name]
            if elem not in TORCH_DTYPES:  # (an ONNX op's complex or string value: a Cast to complex64)
                kind = onnx.helper.tensor_dtype_to_string(elem).removeprefix("TensorProto.").lower()
                raise _complex_refusal(op, f"takes {name!r}, a {kind} value an ONNX op makes")
            dtype = TORCH_DTYPES[elem]
            shape = [stand_in if d is None else d for d in shape]
            if i in positions and shape:
                shape[-1] = 2  # (a complex value's real form)
            inputs.append(torch.empty(shape, dtype=dtype, device="meta"))
        else:
            return None
    plan = resolve(op, overload)
    args, kwargs = plan.decode(op, inputs)
    meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    args = [
        _as_complex(meta(x)) if i in positions and isinstance(x, torch.Tensor) else meta(x) for i, x in enumerate(args)
    ]
    result = plan.fn(*args, **{k: meta(v) for k, v in kwargs.items()})
    return result if isinstance(result, (tuple, list)) else (result,)


def _evaluate(node: onnx.NodeProto, op: str, overload: str, known: dict, constants: dict, example=None):
    """The node's results at each stand-in size of a tier (:data:`_STAND_INS`; one evaluation where no
    input dim is symbolic); None if an input is unknown."""
    symbolic = any(name in known and None in known[name][1] for name in node.input if name not in constants)
    error = None
    # Without a symbolic input dim other sizes could only repeat the first evaluation.
    tiers = [(False, _STAND_INS[0]), (True, _STAND_INS[0]), (False, _STAND_INS[1])] if symbolic else [(False, (2,))]
    for aligned, sizes in tiers:
        shapes = _aligned_shapes(node, op, known, constants) if aligned else known
        try:
            first = _meta_outputs(node, op, overload, shapes, constants, sizes[0])
            if first is None:
                return None
            return [first, *(_meta_outputs(node, op, overload, shapes, constants, size) for size in sizes[1:])]
        except Exception as e:  # (the first error is the one reported)
            error = error or e
    if symbolic and example is not None:
        try:  # at the example sizes, once: every output dim symbolic (``[first, None, ...]``)
            first = _meta_outputs(node, op, overload, example, constants, _STAND_INS[0][0])
            return None if first is None else [first, [None] * len(first)]
        except Exception:
            pass
    raise error


def _example_shapes(model: onnx.ModelProto, known: dict, sizes: dict[str, int]) -> dict:
    """``known``, the symbolic dims that ``sizes`` names (by ``dim_param``) at those sizes."""
    out = dict(known)
    for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        if v.name in known:
            dims = v.type.tensor_type.shape.dim
            shape = [sizes.get(d.dim_param) if d.dim_param and s is None else s for d, s in zip(dims, known[v.name][1])]
            out[v.name] = (known[v.name][0], shape)
    return out


def _aligned_shapes(node: onnx.NodeProto, op: str, known: dict, constants: dict) -> dict:
    """``known``, the node's symbolic input dims set to the static size that its other tensor inputs
    have at the same right-aligned position (where one size other than 1 is there): a broadcast
    against a static dim (a spectrum of a dynamic channel count times a learned ``[3, 9]`` filter),
    which no common stand-in size satisfies. Its result there is that static size, whatever the dim."""
    positions = _complex_positions(op)
    tensors = [(i, n) for i, n in enumerate(node.input) if n and n in known and n not in constants]
    # the op's view of each input: a complex one without its trailing 2
    views = {n: known[n][1][:-1] if i in positions else known[n][1] for i, n in tensors}
    out = dict(known)
    for _, n in tensors:
        shape = list(views[n])
        for d in range(len(shape)):
            if shape[d] is not None:
                continue
            back = len(shape) - d
            sizes = {views[m][-back] for _, m in tensors if m != n and len(views[m]) >= back} - {None, 1}
            if len(sizes) == 1:
                shape[d] = sizes.pop()
        out[n] = (known[n][0], shape + known[n][1][len(views[n]) :])
    return out


def _mark_complex(node: onnx.NodeProto, op: str, overload: str, positions: list[int]) -> str:
    """Write ATen node ``op`` as taking its inputs at ``positions`` as complex values in their real
    ``[..., 2]`` form and giving back its complex results so (``COMPLEX_MARK``, as the dynamo exporter
    writes its ATen nodes): the TorchScript exporter keeps complex values, which ORT cannot hold."""
    n_positional = len(resolve(op, overload).pos)
    if any(i >= n_positional for i in positions):
        raise NotImplementedError(f"ATen op {op}: a complex keyword-only argument cannot be passed to an ATen node")
    marked = f"{COMPLEX_MARK}{','.join(map(str, positions))}|{op}"
    for a in node.attribute:
        if a.name == "operator":
            a.s = marked.encode()
    return marked


def _consumers(model: onnx.ModelProto) -> dict[str, list]:
    """value name -> the nodes that take it, and ``None`` for a graph output."""
    out: dict[str, list] = {}
    for n in model.graph.node:
        for name in n.input:
            out.setdefault(name, []).append(n)
    for v in model.graph.output:
        out.setdefault(v.name, []).append(None)
    return out


def _check_pair_consumers(op: str, name: str, consumers: dict) -> None:
    """A complex value in its real ``[..., 2]`` form may only reach ATen nodes (which view it as
    complex again): any other op would compute on the pairs as on real numbers.

    Raises:
        NotImplementedError: naming the op and what takes the complex value."""
    for n in consumers.get(name, []):
        if n is not None and n.domain == ATEN_DOMAIN and n.op_type == "ATen":
            continue
        what = "a graph output" if n is None else f"ONNX op {n.op_type}"
        raise _complex_refusal(op, f"makes a complex tensor, and {what} takes it")


def _check_overload(op: str, overload: str, value: str) -> None:
    """An ATen node that takes a complex pair ``value`` runs on it viewed as complex (``COMPLEX_MARK``),
    which needs the op's overload: the TorchScript exporter writes some nodes without one (``to`` of
    DeepSeek-V2's complex RoPE frequencies: ``freqs_cis.to(device)``), and ``to`` has several.

    Raises:
        NotImplementedError: naming the op, the complex value, the overloads and the remedy."""
    try:
        resolve(op, overload)
    except RuntimeError as e:  # (``bridge.aten._default_overload``: no overload name, several overloads)
        raise _complex_refusal(op, f"takes {value!r}, a complex value, without the overload name it needs ({e})") from e


def _complex_refusal(op: str, what: str) -> NotImplementedError:
    """The refusal of a complex value on the TorchScript exporter's path, ``ATen op <op> <what>``, with
    the pair convention and the remedy, in one wording for each such refusal."""
    return NotImplementedError(
        f"ATen op {op.rpartition('|')[2]} {what}: ONNX Runtime cannot hold complex values, and ortwrap carries "
        "them as real [..., 2] pairs only between ATen nodes (PyTorch's kernels, which view them as complex "
        "again), where ONNX ops would compute on the pairs as on real numbers; use exporter='dynamo'"
    )


def meta_outputs(op: str, overload: str, inputs: list) -> tuple:
    """The results of ATen node ``op`` for ``inputs`` (tensors, constants encoded as the node's
    inputs, None for absent ones) evaluated on the meta device."""
    plan = resolve(op, overload)
    args, kwargs = plan.decode(op, inputs)
    meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    result = plan.run(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    return result if isinstance(result, (tuple, list)) else (result,)


def infer_types(
    model: onnx.ModelProto, max_rounds: int = 64, strict: bool = True, sizes: dict[str, int] | None = None
) -> onnx.ModelProto:
    """ONNX shape inference, extended through ATen nodes.

    ONNX cannot infer the outputs of ``org.pytorch.aten::ATen``, so inference stops at the first
    one. Each round infers what ONNX can, then evaluates every ATen node whose inputs are now known
    on PyTorch's ``meta`` device, static dims at their sizes (ops such as ``rms_norm`` check them
    against their weights), symbolic dims set to 2 and then to 3, constants at their values. It
    records each output's dtype and shape: a dim that is the same in both evaluations is static,
    the others symbolic. Until nothing changes.

    Where every stand-in size fails, a node whose symbolic input dims are named in ``sizes`` (the
    example inputs' sizes by dim name: ``view_as_complex`` of an input whose last dim the trace made
    dynamic) is evaluated once at those sizes; its output dims are then all symbolic.

    Value infos without a type (the TorchScript exporter writes them for custom-domain outputs,
    ``ortwrap::StopGradient``) are dropped first: ONNX inference does not fill an empty entry, and
    everything downstream of it would keep no shape.
    """
    untyped = [v for v in model.graph.value_info if not v.type.HasField("tensor_type")]
    for v in untyped:
        model.graph.value_info.remove(v)
    refined: set[tuple] = set()
    pairs: set[str] = set()  # complex values this inference wrote in their real [..., 2] form
    ours: set[tuple] = set()  # the outputs of the ATen nodes it marked so
    changed = False
    for _ in range(max_rounds):
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
        known = value_types(model)
        constants = _proto_constants(model)
        example = _example_shapes(model, known, sizes) if sizes else None
        # Progress only if the refined Slice shapes are new: ONNX re-infers the same unknown dims
        # each round, and counting their re-refinement as progress ran all max_rounds rounds
        # (seconds on HF GPT-2).
        changed, signature = _refine_slices(model, constants), _slice_signature(model)
        progress = changed and signature not in refined
        refined.add(signature)
        consumers = None
        for node in model.graph.node:
            if node.domain != ATEN_DOMAIN or node.op_type != "ATen":
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            op, overload = attrs["operator"].decode(), attrs.get("overload_name", b"").decode()
            if op.startswith((VJP_PREFIX, NATIVE_PREFIX)):
                continue
            # (a node whose outputs the exporter typed, ``view_as_real`` of a graph output, is still marked)
            if all(o in known for o in node.output) and (op.startswith(COMPLEX_MARK) or pairs.isdisjoint(node.input)):
                continue
            # The TorchScript exporter keeps complex values: written here in their real [..., 2] form
            # (``COMPLEX_MARK``: the dynamo exporter's ATen nodes come so).
            if strict and not op.startswith(COMPLEX_MARK) and not pairs.isdisjoint(node.input):
                _check_overload(op, overload, next(name for name in node.input if name in pairs))
            if any(n and n not in known and n not in constants for n in node.input):
                continue  # (its inputs' types, which of them are complex pairs included, come first)
            try:
                if any(name in pairs for name in node.input) and not op.startswith(COMPLEX_MARK):
                    op = _mark_complex(node, op, overload, [i for i, name in enumerate(node.input) if name in pairs])
                    ours.add(tuple(node.output))
                runs = _evaluate(node, op, overload, known, constants, example)
                if runs is not None and not op.startswith(COMPLEX_MARK) and any(map(_is_complex, runs[0])):
                    op = _mark_complex(node, op, overload, [])
                    ours.add(tuple(node.output))
            except Exception as e:
                if not strict:
                    continue  # best effort (strict=False): its outputs stay unknown
                if isinstance(e, NotImplementedError) and not str(e).startswith("ATen op"):
                    raise NotImplementedError(f"ATen op {op.rpartition('|')[2]}: {e}") from e
                raise
            if runs is None:
                continue
            for i, (name, r) in enumerate(zip(node.output, runs[0])):
                if isinstance(r, torch.Tensor) and name not in known:
                    others = [run[i] if i < len(run) else None for run in runs[1:]]
                    complex_result = r.is_complex()
                    if complex_result:  # (its real [..., 2] form: ``COMPLEX_MARK``)
                        if tuple(node.output) in ours:
                            consumers = consumers if consumers is not None else _consumers(model)
                            _check_pair_consumers(op, name, consumers)
                            pairs.add(name)
                        r, *others = (
                            torch.view_as_real(t.resolve_conj()) if _is_complex(t) else t for t in (r, *others)
                        )
                    dims = list(r.shape)
                    for other in others:
                        if other is None:  # (evaluated at the example sizes only)
                            dims = [None] * len(dims)
                            if complex_result:
                                dims[-1] = 2
                            continue
                        same = isinstance(other, torch.Tensor) and other.dim() == r.dim()
                        dims = [a if same and a == b else None for a, b in zip(dims, other.shape if same else dims)]
                    if r.dtype not in ONNX_TYPES:
                        raise NotImplementedError(
                            f"ATen op {op} makes a {r.dtype} tensor, which ONNX Runtime cannot hold"
                        )
                    elem = ONNX_TYPES[r.dtype]
                    model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, dims))
                    progress = True
        if not progress:
            break
    # NOTE: the last refinement dropped the unk__ dims ONNX had invented downstream of its Slices
    # (for the next round to re-infer): infer them once more, or those values reach the gradient
    # builder without a type (a Pad whose pads are computed: ORT cannot type the ATen node).
    return onnx.shape_inference.infer_shapes(model, data_prop=True) if changed else model


def _refine_slices(model: onnx.ModelProto, constants: dict[str, torch.Tensor]) -> bool:
    """Give each Slice output the input's sizes on the axes it does not cut; True if any changed.

    ONNX's Slice inference drops every dim when one bound is computed: ``position_ids[:, :T]`` of
    a (1, max_len) buffer reads as (unk, unk), and ORT's gradient builder then takes that unk for
    the batch and does not reduce the broadcast gradient (BERT's position embeddings). Dims ONNX
    invented downstream (``unk__*`` of standard ops) are dropped so the next round re-infers them.
    """
    graph = model.graph
    infos = {v.name: v for v in (*graph.input, *graph.value_info)}
    producers = {o: n for n in graph.node for o in n.output}

    def values(name: str) -> list[int] | None:
        # A constant, or one seen through ops that keep its values (the exporters' Unsqueeze).
        while name not in constants:
            node = producers.get(name)
            if node is None or node.op_type not in ("Unsqueeze", "Squeeze", "Reshape", "Cast", "Identity"):
                return None
            name = node.input[0]
        return [int(v) for v in constants[name].reshape(-1).tolist()]

    changed = False
    for node in graph.node:
        if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            continue
        src, out = infos.get(node.input[0]), infos.get(node.output[0])
        if src is None or not src.type.tensor_type.HasField("shape"):
            continue
        in_dims = src.type.tensor_type.shape.dim
        if len(node.input) > 3 and node.input[3]:
            axes = values(node.input[3])
            if axes is None:
                continue
            axes = [a % len(in_dims) for a in axes]
        else:
            starts = values(node.input[1])
            if starts is None:
                continue
            axes = list(range(len(starts)))
        if out is None:
            out = onnx.helper.make_tensor_value_info(node.output[0], src.type.tensor_type.elem_type, None)
            graph.value_info.append(out)
            out = graph.value_info[-1]
            infos[out.name] = out
        tt = out.type.tensor_type
        if not tt.HasField("shape") or len(tt.shape.dim) != len(in_dims):
            tt.ClearField("shape")
            tt.shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in in_dims)
        for i, d in enumerate(in_dims):
            if i in axes or not (d.HasField("dim_value") or d.HasField("dim_param")):
                continue
            o = tt.shape.dim[i]
            if o.HasField("dim_value") or (d.HasField("dim_param") and o.dim_param == d.dim_param):
                continue
            o.CopyFrom(d)
            changed = True
    if changed:
        standard = {o for n in graph.node if n.domain in ("", "ai.onnx") and n.op_type != "Slice" for o in n.output}
        stale = [
            v
            for v in graph.value_info
            if v.name in standard and any(d.dim_param.startswith("unk__") for d in v.type.tensor_type.shape.dim)
        ]
        if stale:  # one rebuild: removing entries one by one is quadratic in protobuf
            drop = {v.name for v in stale}
            keep = [
                onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in graph.value_info if v.name not in drop
            ]
            del graph.value_info[:]
            graph.value_info.extend(keep)
    return changed


def _slice_signature(model: onnx.ModelProto) -> tuple:
    """The shapes of every Slice output, as value infos record them."""
    slices = {o for n in model.graph.node if n.op_type == "Slice" for o in n.output}
    return tuple(
        sorted(
            (v.name, tuple((d.dim_value, d.dim_param) for d in v.type.tensor_type.shape.dim))
            for v in model.graph.value_info
            if v.name in slices
        )
    )
