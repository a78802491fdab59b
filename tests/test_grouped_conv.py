"""Grouped convolutions train on ORT's CPU kernels without writing outside their buffers.

ORT 1.19.2's CPU ``ConvGrad`` zeroes a whole image's worth of floats from each group's offset in
the input gradient of a grouped 1-D or 3-D convolution: past the end of the buffer for the last
image (passes/grouped_conv.py). Inside ORT's arena the zeros land on whatever value comes next
(wav2vec2: an attention layer's saved probabilities, so an unrelated weight's gradient was wrong);
with the arena off, glibc's heap checks catch them at the next ``free``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import onnx
import pytest
import torch
from parity import check_parity, seq_len
from torch import nn

pytestmark = pytest.mark.usefixtures("exporter")


class PosConv(nn.Module):
    """wav2vec2's positional convolution: grouped Conv1d with weight norm, the same-padding slice,
    GELU, added to its input; then a softmax attention whose probabilities the backward reads."""

    def __init__(self, d: int = 32, groups: int = 4) -> None:
        super().__init__()
        conv = nn.Conv1d(d, d, 8, padding=4, groups=groups)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = x + nn.functional.gelu(self.conv(x.transpose(1, 2))[:, :, :-1]).transpose(1, 2)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        p = torch.softmax(q @ k.transpose(1, 2) / 32**0.5, dim=-1)
        return self.out(p @ v)


class GroupedConv3d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(4, 6, 3, padding=1, stride=(1, 2, 1), groups=2)
        self.depthwise = nn.Conv3d(6, 6, 3, padding=1, groups=6, bias=False)

    def forward(self, x):
        return self.depthwise(torch.tanh(self.conv(x)))


def _seq_inputs(b, g):
    x = torch.randn(b, seq_len(b, 12), 32, generator=g)
    return (x.requires_grad_(),), {}


def _kernel_ranks(model: onnx.ModelProto) -> list[int]:
    return [
        len(next(a.ints for a in n.attribute if a.name == "kernel_shape"))
        for n in model.graph.node
        if n.op_type == "Conv"
    ]


def test_grouped_conv1d_trains_like_eager():
    # build_cache=False: the graph given to the gradient builder is read below
    w = check_parity(PosConv, _seq_inputs, wrap_options={"build_cache": False})
    assert _kernel_ranks(w.last_artifacts.pre_grad) == [2]  # the grouped Conv1d runs as a Conv2d


def test_grouped_conv3d_trains_like_eager():
    w = check_parity(
        GroupedConv3d,
        lambda b, g: ((torch.randn(b, 4, 3, 6, 5, generator=g).requires_grad_(),), {}),
        batch_sizes=(2, 3),
        wrap_options={"build_cache": False},
    )
    assert _kernel_ranks(w.last_artifacts.pre_grad) == [3] * 8  # one Conv per group (2 + 6)


_HEAP_CHECK = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    import ortwrap.runtime.session as session
    from ortwrap import ORTWrap

    plain = session.session_options

    def no_arena(options, **kwargs):
        # ORT's own heap blocks instead of its arena: glibc sees a write past a buffer at the next free.
        so = plain(options, **kwargs)
        so.enable_cpu_mem_arena = False
        return so

    session.session_options = no_arena
    torch.manual_seed(0)
    rank = int(sys.argv[1])
    conv = (nn.Conv1d(32, 32, 3, groups=4) if rank == 1 else nn.Conv3d(8, 8, 3, groups=4))
    wrapped = ORTWrap(conv, fallback=False, exporter=sys.argv[2], build_cache=False)
    for b in (2, 3, 4):
        shape = (b, 32, 20 + b) if rank == 1 else (b, 8, 4, 5, 3 + b)
        x = torch.randn(*shape, requires_grad=True)
        wrapped(x).square().sum().backward()
    print("done")
    """
)


@pytest.mark.parametrize("rank", [1, 3])
def test_grouped_conv_backward_stays_in_its_buffers(rank, exporter):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    r = subprocess.run(
        [sys.executable, "-c", _HEAP_CHECK, str(rank), exporter],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=300,
    )
    assert r.returncode == 0 and "done" in r.stdout, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
