"""The aggressive CPU fallback's contract between its build side and its run side.

``passes/host_shapes.py`` (``HostShapeSplitPass``) produces a :class:`HostShapeSplit`;
``runtime/host_shapes.py`` (``HostShapeRunner``) runs it before each forward. Both read these types,
so they live below both stages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import onnx

__all__ = ["HostFeed", "HostPlacement", "HostShapeSplit", "shape_slice"]


@dataclass(frozen=True)
class HostFeed:
    """How one value is produced on the host before each run.

    Attributes:
        name: the value's name (an input of the shape program or of the main graph).
        kind: ``"shape"`` (``tensor.shape[start:end]`` of ``source``), ``"size"`` (its element
            count), ``"value"`` (the user input ``source`` itself, read on the host) or
            ``"program"`` (output ``index`` of the shape program).
        source: the graph input it is computed from (``shape``, ``size``, ``value``).
        start, end: ``Shape``'s attributes (``end`` ``None`` for "to the last dim").
        index: output index in the shape program (``program``).
    """

    name: str
    kind: str
    source: str | None = None
    start: int = 0
    end: int | None = None
    index: int = -1

    def describe(self) -> str:
        if self.kind == "shape":
            end = "" if self.end is None else self.end
            return f"{self.name} = {self.source}.shape[{self.start or ''}:{end}] (python)"
        if self.kind == "size":
            return f"{self.name} = {self.source}.numel() (python)"
        if self.kind == "value":
            return f"{self.name} = value of input {self.source} (read on the host)"
        return f"{self.name} = shape program output {self.index}"


@dataclass(frozen=True)
class HostPlacement:
    """Where one shape-related node ended up, and why.

    Attributes:
        name: the node's name as the analysis reports it (scope paths for subgraph nodes).
        op_type: its op type.
        placement: ``"host"`` (moved into the shape program), ``"python"`` (a ``Shape``/``Size``
            of a user input, replaced by a python feed), ``"constant"`` (depends on constants
            only: left to ORT's constant folding, copied into the shape program where needed),
            ``"subgraph"`` (inside a control-flow node; moves with it, see ``why``) or
            ``"kept"`` (stays in the main graph).
        reasons: the host inputs whose backward walk reached it (from the analysis), e.g.
            ``"/Reshape input 1 (shape)"``.
        device_uses: uses that need the value on the device (non-empty: a mixed node).
        why: for ``kept`` and ``subgraph``, why it did not move on its own.
    """

    name: str
    op_type: str
    placement: str
    reasons: tuple[str, ...]
    device_uses: tuple[str, ...] = ()
    why: str = ""

    @property
    def moved(self) -> bool:
        """True if the node no longer runs in the main graph (``host`` or ``python``)."""
        return self.placement in ("host", "python")


_TITLES = {
    "host": "moved into the shape program (node, because <consumer input that made it shape-related>):",
    "python": "replaced by python feeds computed from tensor.shape:",
    "kept": "kept in the main graph (node, because ...; why it stayed):",
    "subgraph": "inside a control-flow node that stays in the main graph:",
}


@dataclass
class HostShapeSplit:
    """The result of the split: the shape program, the new main-graph feeds, and the report.

    Attributes:
        program: the shape program (``None`` when every crossing value is a python feed).
        program_inputs: how each input of ``program`` is produced, in its input order.
        feeds: the new main-graph inputs, in the order they were appended to the graph.
        placements: reported node name -> :class:`HostPlacement`, for every shape-related node.
    """

    program: onnx.ModelProto | None = None
    program_inputs: tuple[HostFeed, ...] = ()
    feeds: tuple[HostFeed, ...] = ()
    placements: dict[str, HostPlacement] = field(default_factory=dict)

    @property
    def moved(self) -> dict[str, HostPlacement]:
        """The nodes that left the main graph."""
        return {k: p for k, p in self.placements.items() if p.moved}

    @property
    def kept(self) -> dict[str, HostPlacement]:
        """The shape-related nodes still in the main graph (``kept`` and ``subgraph``)."""
        return {k: p for k, p in self.placements.items() if p.placement in ("kept", "subgraph")}

    def summary(self) -> str:
        """A readable report: which nodes moved and why, and the feeds."""
        counts: dict[str, int] = {}
        for p in self.placements.values():
            counts[p.placement] = counts.get(p.placement, 0) + 1
        lines = [
            f"aggressive CPU fallback: {len(self.moved)} node(s) moved off the main graph "
            f"({counts.get('host', 0)} into the shape program, {counts.get('python', 0)} Shape/Size as python feeds), "
            f"{counts.get('constant', 0)} constant, {len(self.kept)} kept, {len(self.feeds)} new graph input(s)",
            "",
            "feeds of the main graph:",
            *(f"  {f.describe()}" for f in self.feeds),
            "inputs of the shape program:",
            *(f"  {f.describe()}" for f in self.program_inputs),
            "",
        ]
        constants = [p.name for p in self.placements.values() if p.placement == "constant"]
        if constants:
            lines.append(
                f"constant ({len(constants)}; depend on constants only, left for ORT to fold, copied into the shape "
                f"program where a moved node reads them): {', '.join(constants)}"
            )
        for placement, title in _TITLES.items():
            rows = [p for p in self.placements.values() if p.placement == placement]
            if not rows:
                continue
            lines.append(title)
            for p in rows:
                mixed = f"; mixed, device uses: {', '.join(p.device_uses)}" if p.device_uses else ""
                why = f"; {p.why}" if p.why else ""
                lines.append(f"  {p.name} ({p.op_type}) because {'; '.join(p.reasons)}{mixed}{why}")
        return "\n".join(lines) + "\n"

    def save(self, directory: str, stem: str) -> list[str]:
        """Write ``<stem>.txt`` (the :meth:`summary`) and ``<stem>.onnx`` (the shape program, if
        any) to ``directory``; return their paths."""
        os.makedirs(directory, exist_ok=True)
        paths = [os.path.join(directory, f"{stem}.txt")]
        with open(paths[0], "w") as f:
            f.write(self.summary())
        if self.program is not None:
            paths.append(os.path.join(directory, f"{stem}.onnx"))
            onnx.save_model(self.program, paths[1])
        return paths


def shape_slice(dims, start: int, end: int | None) -> list[int]:
    """``Shape``'s output for an input of shape ``dims``: ``dims[start:end]`` with ONNX clamping."""
    rank = len(dims)
    s = start + rank if start < 0 else start
    e = rank if end is None else (end + rank if end < 0 else end)
    s, e = min(max(s, 0), rank), min(max(e, 0), rank)
    return [int(d) for d in dims[s:e]]
