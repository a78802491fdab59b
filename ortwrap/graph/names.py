"""Every name the stages agree on in an ONNX graph: domains, operator prefixes, value-name prefixes and
suffixes, and the marks written into attributes.

A name here is read by one stage and written by another (the exporter names buffer outputs, a pass
prunes them; a pass marks an ATen node's bool inputs, the ATen runner reads the mark), so it lives
below both. Nothing here imports torch internals or ONNX Runtime.
"""

from __future__ import annotations

__all__ = [
    "ATEN_BOOL_MARK",
    "ATEN_DOMAIN",
    "BUFFER_OUTPUT_PREFIX",
    "COMPLEX_MARK",
    "CONTEXT_OUTPUT",
    "CONTEXT_OUTPUT_PREFIX",
    "INVENTED_PREFIX",
    "NATIVE_PREFIX",
    "ORTWRAP_DOMAIN",
    "OUTS_MARK",
    "PLACEHOLDER_DOMAIN",
    "PYTHONOP_BOOL_MARK",
    "PYTHONOP_DOMAIN",
    "STATE_PREFIX",
    "STOP_GRADIENT_SUFFIX",
    "USED_MARK",
    "VJP_PREFIX",
]

# ------------------------------------------------------------------------------------------ domains

#: ATen nodes: PyTorch ops inside the graph, run by the ATen bridge (``bridge/aten.py``).
ATEN_DOMAIN = "org.pytorch.aten"
#: ORT's contrib domain, where ``PythonOp`` (an autograd.Function inside the graph) lives.
PYTHONOP_DOMAIN = "com.microsoft"
#: The marker ops ortwrap's symbolics emit (``StopGradient``); passes resolve them before the
#: gradient build.
ORTWRAP_DOMAIN = "ortwrap"
#: The dynamo exporter's Function placeholders (``bridge/dynamo.py``), made PythonOps in one cleanup.
PLACEHOLDER_DOMAIN = "ortwrap.dynamo"

# ----------------------------------------------------------------------- ATen operator names

#: An ATen node whose operator starts with this is the vjp (backward) of the op after it.
VJP_PREFIX = "ortwrap_vjp::"
#: ATen nodes whose operator starts with this run ortwrap's own CPU kernels (``ortwrap.kernels``).
NATIVE_PREFIX = "ortwrap_cpu::"

# -------------------------------------------------------------------- marks in attribute values

#: prefix of an ATen node's ``overload_name`` saying which outputs the graph uses
#: (``used=101|overload``; ``grad/fixups.py`` ``mark_used_outputs``).
USED_MARK = "used="
#: suffix of an ATen node's ``overload_name`` listing its bool tensor inputs (``@bool=0,2``;
#: ``grad.aten.mark_bool_inputs``): ORT hands bools over DLPack as uint8.
ATEN_BOOL_MARK = "@bool="
#: suffix of a PythonOp's ``func_name`` listing its bool tensor inputs (``|bool=0,2``;
#: ``bridge/symbolic.py`` writes it, ``bridge/runner.py`` reads it). Another character than
#: :data:`ATEN_BOOL_MARK` because it ends a qualified Python name, not an overload name.
PYTHONOP_BOOL_MARK = "|bool="
#: ``ortwrap_vjp::outs=N|op``: the forward node has N outputs, fewer than ``op`` returns.
OUTS_MARK = "outs="
#: ``complex=0,2|op``: the ATen node's inputs 0 and 2 are complex values in torchlib's real ``[..., 2]``
#: form (the dynamo exporter writes it, ``export/type_inference.py`` for TorchScript; ``bridge/aten.py``
#: views them as complex for the op, and gives back every complex result as its real ``[..., 2]``
#: view). After ``outs=``/``used=`` in a vjp's name.
COMPLEX_MARK = "complex="

# ------------------------------------------------------------------------- value-name pieces

#: Graph names of the module's parameters and buffers start with this (the export adapter's attribute).
STATE_PREFIX = "module."
#: Graph outputs that return a buffer's new value (the exporter writes them, a pass prunes unchanged ones).
BUFFER_OUTPUT_PREFIX = "buffer:"
#: The PythonOp context outputs ``AddPythonOpContextPass`` adds.
CONTEXT_OUTPUT_PREFIX = "pythonop_ctx:"
CONTEXT_OUTPUT = f"{CONTEXT_OUTPUT_PREFIX}all"
#: The frozen duplicate input of a parameter whose gradient a ``detach`` stops.
STOP_GRADIENT_SUFFIX = "::stop_gradient"
#: Dim names ONNX shape inference invents (``unk__N``); forgotten before the gradient build.
INVENTED_PREFIX = "unk__"
