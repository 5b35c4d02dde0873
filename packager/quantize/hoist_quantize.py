"""Pass: quantize a tensor once, where it is made, when everything that reads it quantizes it to one scale.

    quantize(concat(a, b, ...), s)       ->  concat(quantize(a, s), quantize(b, s), ...)
    quantize(max_pool2d(y), s)           ->  max_pool2d(quantize(y, s))
    quantize(split(y)[i], s)             ->  split(quantize(y, s))[i]        (and strided_slice, nearest resize)
    add(z, y)  where y is also quantized ->  add(z, dequantize(quantize(y, s), s))

The first three are exact: quantize is element-wise and does not decrease as its input grows, so it commutes
with moving values (a concatenation, a channel split or slice, a nearest-neighbour resize) and with taking their
maximum (a max-pool's padding, -inf in float, is the int8 minimum). The fourth is the residual connection of
ResNet and MobileNet blocks: the block's output is read by the next block's first layer (quantized) and by its
residual add; the add now reads the int8 copy, as ONNX Runtime's quantized Add does, so the float tensor is
never written (a float residual made the epilogue of every block's last convolution read and write 4 bytes per
value: ResNet-50's ran at 150-260 G MAC/s where its other convolutions run at 390). Not exact: the residual
carries the rounding of the int8 copy (half a step of the scale the next layer reads it at). A tensor that
several layers quantize alike is quantized once (ResNet's block output, read by the next block's first and
downsampling convolutions).

Applied to a tensor only when every reader quantizes it (directly, or through the operators above that move its
values into what a reader quantizes, a concatenation it is part of included) with the same scale and zero
point, or is such an add, and at least one quantizes it: then nothing needs it in float, the concatenation, the
split and the pooling run on int8, and ``requantize`` (or the GPU backend's epilogues) turn each
``quantize(act(dequantize(acc)))`` into the epilogue of the layer that made the part. Inception blocks
(GoogLeNet) and fire modules (SqueezeNet) concatenated and pooled float maps between int8 convolutions before;
YOLOv8's C2f block concatenates the two halves of its first convolution's output with each bottleneck's, and
they are also read by the bottlenecks (``shared_scales`` gives them the concatenation's scale, so they agree).

The scales agree because calibration measures a layer's input through max-pools (``calibrate.Taps``):
the layer after a pool gets the scale of the pool's input, as ONNX Runtime's quantizer gives a MaxPool's
output its input's scale; and a concatenation's parts read by layers of their own take its scale
(``shared_scales``).
"""

from __future__ import annotations

from edgeq.graph import Graph, Rewriter, call_op, const_value, relax, rewrite
from edgeq.quantize.notes import PassNotes

POOLS = ("relax.nn.max_pool2d",)
SLICES = ("relax.strided_slice", "relax.split")


def _key(value) -> tuple | None:
    """What a quantize call quantizes to: (scale, zero point, dtype) when both are scalar constants."""
    scale, zero = const_value(value.args[1]), const_value(value.args[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return None
    return float(scale.reshape(())), int(zero.reshape(())), str(value.attrs.out_dtype)


def moves(value, values: dict) -> bool:
    """Does ``value`` hold some of one tensor's values, unchanged or their maximum (quantize commutes with it):
    a max-pool, a slice or split, an item of a split, a nearest-neighbour resize?"""
    if isinstance(value, relax.TupleGetItem):
        return call_op(values.get(value.tuple_value)) == "relax.split"
    op = call_op(value)
    if op == "relax.image.resize2d":
        return str(value.attrs.method) == "nearest_neighbor"
    return op in POOLS or op in SLICES


def moved(value):
    """The tensor a ``moves`` value reads (for an item of a split: the split)."""
    return value.tuple_value if isinstance(value, relax.TupleGetItem) else value.args[0]


def concatenation(value) -> bool:
    return call_op(value) == "relax.concat" and isinstance(value.args[0], relax.Tuple)


def residual_read(add, var, values: dict) -> bool:
    """Is ``add`` a float add of ``var`` and another computed tensor (a bound var of ``values``: a residual, not
    a bias)?"""
    if call_op(add) != "relax.add" or str(add.ty.dtype) != "float32":
        return False
    other = [a for a in add.args if not a.same_as(var)]
    return len(other) == 1 and isinstance(other[0], relax.Var) and other[0] in values


def hoist_quantize(graph: Graph, notes: PassNotes | None = None) -> Graph:
    values = {b.var: b.value for b in graph.bindings()}
    readers = graph.readers()
    outputs = set(relax.analysis.free_vars(graph.main.body.body))
    agreed: dict = {}

    def agreement(var):
        """(key, a quantize call with it, read by residual adds?) for the one quantization every reader of
        ``var`` applies, directly or through what ``moves`` its values (residual adds take it too); None where a
        reader does something else, the readers disagree, or ``var`` is no computed float32 tensor (or split)."""
        if var in agreed:
            return agreed[var]
        agreed[var] = None
        value = values.get(var)
        if value is None or var in outputs:
            return None
        split = call_op(value) == "relax.split"
        if not split and str(value.ty.dtype) != "float32":
            return None
        found, residual = {}, False
        for reader in readers.get(var, []):
            read = values[reader]
            if call_op(read) == "relax.quantize" and read.args[0].same_as(var) and _key(read) is not None:
                found.setdefault(_key(read), read)
            elif ((moves(read, values) and moved(read).same_as(var)) or concatenation(read)) \
                    and agreement(reader) is not None:
                key, call, _ = agreement(reader)
                found.setdefault(key, call)
            elif not split and residual_read(read, var, values):
                residual = True
            else:
                return None
        if len(found) == 1:
            key, call = next(iter(found.items()))
            agreed[var] = (key, call, residual)
        return agreed[var]

    def source_agreed(value) -> bool:
        """Does ``value`` move the values of a tensor that is quantized where it is made (for an item of a
        split: the split's input)?"""
        if not moves(value, values):
            return False
        source = moved(value)
        if isinstance(value, relax.TupleGetItem):
            source = values[source].args[0]
        return isinstance(source, relax.Var) and agreement(source) is not None

    def hoisted(var) -> bool:
        """Is ``var`` quantized where it is made: a concatenation, or what moves the values of a tensor quantized
        where it is made, whose readers agree; or a tensor residual adds or several readers take?"""
        found = agreement(var)
        return found is not None and (concatenation(values[var]) or source_agreed(values[var]) or found[2]
                                      or len(readers[var]) > 1)

    made: dict = {}

    def quantized(rw: Rewriter, var):
        """The int8 form of ``var`` (emitted once)."""
        if var in made:
            return made[var]
        value = values[var]

        def quantize(x):
            _, call, _ = agreement(var)
            return rw.emit(relax.Call(call.op, [x, *call.args[1:]], call.attrs))

        if source_agreed(value) and isinstance(value, relax.TupleGetItem):  # (the split's input is quantized)
            out = rw.emit(relax.TupleGetItem(quantized(rw, value.tuple_value), value.index))
        elif source_agreed(value):
            out = rw.emit(relax.Call(value.op, [quantized(rw, value.args[0]), *value.args[1:]], value.attrs))
        elif concatenation(value):
            parts = [quantized(rw, p) if isinstance(p, relax.Var) and agreement(p) is not None else quantize(rw.new(p))
                     for p in value.args[0].fields]
            out = rw.emit(relax.op.concat(parts, axis=int(value.attrs.axis)))
        else:
            out = quantize(rw.new(var))
        made[var] = out
        return out

    def visit(rw: Rewriter, var, value):
        op = call_op(value)
        if op == "relax.quantize" and isinstance(value.args[0], relax.Var) and hoisted(value.args[0]):
            return quantized(rw, value.args[0])
        if op != "relax.add":
            return None
        args, changed = [], False
        for a in value.args:
            found = agreement(a) if isinstance(a, relax.Var) else None
            if found is not None and found[2] and residual_read(value, a, values):
                _, call, _ = found
                args.append(relax.op.dequantize(quantized(rw, a), call.args[1], call.args[2], out_dtype="float32"))
                changed = True
            else:
                args.append(rw.new(a))
        return relax.Call(value.op, args, value.attrs) if changed else None

    return rewrite(graph, visit)
