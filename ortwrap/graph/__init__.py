"""The contract under every stage: the names stages agree on in a graph (``names.py``), the ATen node
builder (``nodes.py``), what an export hands on (``model.py``) and the host-shape split's types
(``host_shapes.py``). Imports neither torch internals (``_compat``) nor ONNX Runtime, and no other
ortwrap module (tests/test_layering.py)."""
