"""Pass: quantize a tensor once, where it is made, when everything that reads it quantizes it to one scale.

    quantize(concat(a, b, ...), s)       ->  concat(quantize(a, s), quantize(b, s), ...)
    quantize(max_pool2d(y), s)           ->  max_pool2d(quantize(y, s))

Both are exact: quantize is element-wise and does not decrease as its input grows, so it commutes with
moving values and with taking their maximum (a max-pool's padding, -inf in float, is the int8 minimum).
Applied to a tensor only when *every* reader quantizes it (directly or through max-pools) with the same
scale and zero point, so that nothing still needs it in float: then the concatenation and the pooling run
on int8 (a quarter of the bytes), and ``requantize`` turns each ``quantize(relu(dequantize(acc)))`` into
the epilogue of the layer that made the part. Inception blocks (GoogLeNet) and fire modules (SqueezeNet)
concatenated and pooled float maps between int8 convolutions before; a ResNet stem pooled in float.

The scales agree because calibration measures a layer's input through max-pools (``calibrate.with_taps``):
the layer after a pool gets the scale of the pool's input, as ONNX Runtime's quantizer gives a MaxPool's
output its input's scale.
"""

from __future__ import annotations

import numpy as np

from edgeq.graph import Graph, Rewriter, call_op, const_value, relax, rewrite
from edgeq.quantize.notes import PassNotes

POOLS = ("relax.nn.max_pool2d",)


def _key(value) -> tuple | None:
    """What a quantize call quantizes to: (scale, zero point, dtype) when both are scalar constants."""
    scale, zero = const_value(value.args[1]), const_value(value.args[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return None
    return float(scale.reshape(())), int(zero.reshape(())), str(value.attrs.out_dtype)


def hoist_quantize(graph: Graph, notes: PassNotes | None = None) -> Graph:
    bindings = graph.bindings()
    values = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for var in relax.analysis.free_vars(b.value):
            readers.setdefault(var, []).append(b.var)
    outputs = set(relax.analysis.free_vars(graph.main.body.body))
    agreed: dict = {}

    def agreed_key(var):
        """The one quantization every reader of ``var`` applies (through max-pools); None if any reader
        does something else, or they disagree."""
        if var not in agreed:
            keys = set()
            for reader in readers.get(var, []):
                value = values[reader]
                op = call_op(value)
                if op == "relax.quantize" and value.args[0].same_as(var):
                    keys.add(_key(value))
                elif op in POOLS and value.args[0].same_as(var):
                    keys.add(agreed_key(reader))
                else:
                    keys.add(None)
            agreed[var] = keys.pop() if len(keys) == 1 and var not in outputs and readers.get(var) else None
        return agreed[var]

    def pool_of_agreed(value) -> bool:
        return call_op(value) in POOLS and agreed_key(value.args[0]) is not None

    def concat_agreed(var) -> bool:
        value = values.get(var)
        return (call_op(value) == "relax.concat" and isinstance(value.args[0], relax.Tuple)
                and agreed_key(var) is not None)

    made: dict = {}

    def quantized(rw: Rewriter, var, quantize):
        """The int8 form of ``var`` (emitted once), ``quantize`` a quantize call with the agreed key."""
        if var in made:
            return made[var]
        value = values[var]
        if pool_of_agreed(value):
            inner = quantized(rw, value.args[0], quantize)
            out = rw.emit(relax.Call(value.op, [inner, *[rw.new(a) for a in value.args[1:]]], value.attrs))
        elif concat_agreed(var):
            parts = [rw.emit(relax.Call(quantize.op, [rw.new(p), *[rw.new(a) for a in quantize.args[1:]]],
                                        quantize.attrs))
                     for p in value.args[0].fields]
            out = rw.emit(relax.op.concat(parts, axis=int(value.attrs.axis)))
        else:
            out = rw.emit(relax.Call(quantize.op, [rw.new(var), *[rw.new(a) for a in quantize.args[1:]]],
                                     quantize.attrs))
        made[var] = out
        return out

    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.quantize" or not isinstance(value.args[0], relax.Var):
            return None
        if not (concat_agreed(value.args[0]) or pool_of_agreed(values.get(value.args[0]))):
            return None
        return quantized(rw, value.args[0], value)

    return rewrite(graph, visit)
