"""edgeq's CPU kernels, in the order they are tried: the one registry lowering and scheduling read.

To add a kernel, write one module, ``packager/backends/cpu/<name>.py``, that declares ``KERNEL =
Kernel(...)`` (``edgeq.backends.cpu.common``) with its name (what the manifest's ``cpu_kernels`` counts), the
problem it takes (``ConvSpec`` for convolutions and products by a weight, ``BmmSpec`` for products of two
activations, ``ResizeSpec`` for bilinear resizes), its ``plan`` (its matcher: the spec with its choices for the CPU, or None to decline), its
TIR builder and weight packer, its block name and its schedule; then put ``<name>.KERNEL`` in ``KERNELS``
below, ahead of the kernels it should win over. ``lower.py`` gives every convolution and matrix product to
the first kernel whose ``plan`` accepts it; ``schedule.py`` applies the first rule of ``SCHEDULES`` that
finds its block in a fused function, the rows rule to row-wise functions (softmax, LayerNorm), and the
generic rule to everything else.
"""

from __future__ import annotations

from edgeq.backends.cpu import conv, dwconv, matmul, resize, winograd
from edgeq.backends.cpu.generic import GENERIC
from edgeq.backends.cpu.rows import ROWS

# winograd before conv: both take float 3x3 convolutions, winograd only those it pays for
KERNELS = [winograd.KERNEL, dwconv.KERNEL, conv.KERNEL, matmul.KERNEL, resize.KERNEL]

# schedule rules: each ``apply(sch, isa)`` schedules the function and returns its name, or returns None
SCHEDULES = [*KERNELS, ROWS, GENERIC]
