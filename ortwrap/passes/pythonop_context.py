"""Give every ``com.microsoft::PythonOp`` the context output ORT expects.

ORT's PythonOp schema puts an int64 context id first, before the Function's tensor outputs;
``PythonOpGrad`` reads it to find the call's saved state. The exporter emits only the tensor
outputs, so each node is rebuilt with a fresh ``<node>/ctx`` output in front. The ids of the main
graph's PythonOps are also concatenated into ONE int64 graph output (``pythonop_ctx:all``, last): a
forward whose backward never runs tells ortwrap which entries of ORT's context map to erase
(``bridge/state.py``). One output, not one per call: every graph output costs a fetch, a DLPack
conversion and an autograd output per step (about 2.5 us per PythonOp for 16 separate outputs).
"""

from __future__ import annotations

import onnx_ir as ir

from ..graph.names import CONTEXT_OUTPUT, CONTEXT_OUTPUT_PREFIX, PYTHONOP_DOMAIN  # noqa: F401 (program.py reads the prefix here)


def is_pythonop(node: ir.Node) -> bool:
    return node.domain == PYTHONOP_DOMAIN and node.op_type == "PythonOp"


class AddPythonOpContextPass(ir.passes.InPlacePass):
    """Prepend a context output to PythonOp nodes that lack it."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        contexts: list[ir.Value] = []
        for graph in (model.graph, *model.graph.subgraphs()):
            for i, node in enumerate(list(graph)):
                if not is_pythonop(node) or node.meta.get("ortwrap_ctx"):
                    continue
                name = node.name or f"PythonOp_{i}"
                new = ir.Node(
                    node.domain,
                    node.op_type,
                    list(node.inputs),
                    attributes=list(node.attributes.values()),
                    num_outputs=len(node.outputs) + 1,
                    name=name,
                )
                new.meta["ortwrap_ctx"] = True
                new.outputs[0].name = f"{name}/ctx"
                graph.insert_before(node, new)
                for j, (old, value) in enumerate(zip(node.outputs, new.outputs[1:])):
                    old_name = old.name
                    old.replace_all_uses_with(value, replace_graph_outputs=True)
                    old.name = None
                    value.name = old_name
                    value.type = old.type
                    if old.shape is not None:  # the exporter recorded the traced sizes: free them
                        value.shape = ir.Shape([ir.SymbolicDim(f"{name}/out{j}_dim{d}") for d in range(len(old.shape))])
                graph.remove(node, safe=True)
                new.outputs[0].dtype = ir.DataType.INT64
                if graph is model.graph:
                    contexts.append(new.outputs[0])
                modified = True
        if contexts:
            # ORT's shape inference calls a context id a scalar, its kernel writes shape [1]: stack
            # them along a new axis (Concat would refuse scalars). The result is [n] or [n, 1].
            seq = ir.node("SequenceConstruct", contexts, name="pythonop_ctx/sequence")
            exposed = ir.node(
                "ConcatFromSequence",
                [seq.outputs[0]],
                attributes={"axis": 0, "new_axis": 1},
                name="pythonop_ctx/concat",
            )
            model.graph.append(seq)
            model.graph.append(exposed)
            exposed.outputs[0].name = CONTEXT_OUTPUT
            exposed.outputs[0].dtype = ir.DataType.INT64
            model.graph.outputs.append(exposed.outputs[0])
        return ir.passes.PassResult(model, modified=modified)
