"""Calibration's last step: one scale for a concatenation and the tensors it is made of.

YOLOv8's C2f block concatenates the two halves of its first convolution's output with each bottleneck's output,
and the bottlenecks read those halves (and each other's outputs) too; its neck concatenates an upsampled level
with a skip connection that a strided convolution also reads. Calibrated layer by layer, the concatenation's
reader and each part's own readers get different scales: every part is then made in float32, quantized once for
its reader and once more for the concatenation, and the concatenation runs as a kernel of its own (the
YOLOv8n-style detector's int8 build had 36 such kernels beside its 63 convolutions).

TensorRT gives a concatenation's inputs its output's scale. Here the same, over what must agree for the whole to
run in int8: tensors joined by operators that move values without changing them (a concatenation and its parts,
a split and its halves, slices, max-pools, nearest-neighbour resizes: ``hoist_quantize.moves``) form a group,
and every int8 layer reading a member of a group with a concatenation in it reads at one scale, the largest of
their calibrated ones (none of them clips more than it did). Then ``hoist_quantize`` quantizes each part once,
where it is made, and the GPU backend writes it into the concatenation in place (``concat_in_place``).

Applied only to a group whose members are read by nothing else than the group's operators, int8 per-tensor
layers and residual adds (what ``hoist_quantize`` needs to keep it all int8), and is no graph output: elsewhere a
part stays in float anyway, and a coarser scale would cost accuracy for nothing. Not exact: a layer whose own
scale was finer reads its input with the coarser one (the manifest's ``quantization.layers[].shared_scale_with``
names the layers each one shares with; ``activation_threshold`` stays the layer's own calibrated one).
"""

from __future__ import annotations

from edgeq.graph import Graph, relax, weight_operand
from edgeq.quantize.hoist_quantize import concatenation, moved, moves, residual_read
from edgeq.quantize.layers import Layer


def groups(graph: Graph, layers: list[Layer]) -> list[list[Layer]]:
    """The int8 per-tensor layers whose inputs must share one scale, in groups of two or more (``layers`` order)."""
    values = {b.var: b.value for b in graph.bindings()}
    readers = graph.readers()
    outputs = set(relax.analysis.free_vars(graph.main.body.body))
    parent: dict = {}

    def find(var):
        parent.setdefault(var, var)
        while not parent[var].same_as(var):  # (TVM objects: one node may come in several wrappers)
            parent[var] = parent[parent[var]]
            var = parent[var]
        return var

    def union(a, b):
        parent[find(a)] = find(b)

    with_concat = set()
    for var, value in values.items():
        if moves(value, values) and isinstance(moved(value), relax.Var):
            union(var, moved(value))
        elif concatenation(value):
            for part in value.args[0].fields:
                if isinstance(part, relax.Var):
                    union(var, part)
            with_concat.add(var)
    with_concat = {find(v) for v in with_concat}

    by_weight = {l.weight: l for l in layers if l.precision == "int8" and l.activation == "per-tensor"}
    reading: dict = {}  # var -> the int8 per-tensor layers reading it
    for var, value in values.items():
        rhs, _ = weight_operand(value, values.get, lambda expr: isinstance(expr, relax.Var) and expr.name in by_weight)
        if rhs is not None:
            layer = by_weight[rhs.name]
            if isinstance(value.args[0], relax.Var):
                reading.setdefault(value.args[0], []).append((var, layer))

    members: dict = {}
    for var in parent:
        members.setdefault(find(var), []).append(var)
    out = []
    for root, group in members.items():
        if root not in with_concat:
            continue
        found, closed = [], True
        for var in group:
            if var in outputs or var not in values:
                closed = False
                break
            layer_readers = {r for r, _ in reading.get(var, [])}
            for reader in readers.get(var, []):
                if reader not in layer_readers and not find(reader).same_as(root) \
                        and not residual_read(values[reader], var, values):
                    closed = False
                    break
            found += [layer for _, layer in reading.get(var, [])]
        chosen = {id(l) for l in found}
        if closed and len(chosen) > 1:
            out.append([l for l in layers if id(l) in chosen])
    return sorted(out, key=lambda g: layers.index(g[0]))


def share(groups_: list[list[Layer]], thresholds: dict[str, float]) -> dict[str, float]:
    """``thresholds`` (weight name -> calibrated |x| threshold) with each group's layers at the group's largest."""
    out = dict(thresholds)
    for group in groups_:
        top = max(thresholds[l.weight] for l in group)
        for layer in group:
            out[layer.weight] = top
    return out
