"""ONNX ``NonMaxSuppression`` with a static bound, and the rows it selects followed through the graph.

ONNX's NonMaxSuppression returns ``[num_selected, 3]`` (batch, class, box) rows, a number known only when
it runs; an edgeq bundle has static shapes. edgeq pads the output to a bound,

    rows = min(num_batches * num_classes * min(max_output_boxes_per_class, num_boxes), --max-detections)

fills the rows past the real ones with -1, and adds one output to the bundle, ``<output>_count`` (int64,
shape [1]), that says how many rows are real. The real rows are ONNX Runtime's, in its order: per batch, per
class, boxes in descending score (equal scores: the lower box index first), a box kept unless its IoU with a
box already kept in its class is above ``iou_threshold``, boxes at or below ``score_threshold`` never
considered. The IoU is computed as ONNX Runtime computes it (``SuppressByIOU``), in float32.

The selection is two TIR functions (``select_func``, ``collect_func``), one (batch, class) pair or one
output row per iteration of their outer loop, which the CUDA backend binds to GPU threads as any other
function's. A sort of the candidates (bottom-up merge sort, stable) and the greedy pass run sequentially
inside one pair.

Where the selected rows go on in the graph (a Gather of the boxes by the selected index, a Slice of a
column, a Cast, arithmetic with unpadded tensors), the padding goes with them (``padded_outputs``): the graph
outputs it reaches carry the same count, recorded in the manifest (``rows`` of the output spec). An op that
would mix the padded rows with the real ones (a TopK, a reduction, a Reshape or Concat across the rows) is
refused in one line naming it.
"""

from __future__ import annotations

from edgeq.errors import ModelError
from edgeq.tvm_env import relax, tvm

COUNT_SUFFIX = "_count"


def bound(num_batches: int, num_classes: int, num_boxes: int, max_per_class: int | None,
          max_detections: int | None) -> tuple[int, int]:
    """(per-class bound K, output rows R) for the shapes and the constant ``max_output_boxes_per_class``
    (None: computed at run time, bounded by the number of boxes)."""
    per_class = num_boxes if max_per_class is None else max(0, min(int(max_per_class), num_boxes))
    rows = num_batches * num_classes * per_class
    if max_detections is not None:
        rows = min(rows, max_detections)
    return per_class, rows


def select_func(batches: int, classes: int, boxes_n: int, per_class: int, center_point_box: int,
                has_score_threshold: bool):
    """PrimFunc ``(boxes, scores, max_per_class[1], iou[1], score_threshold[1]) -> (keep[BC, K], kept[BC],
    order[2, BC, N])``: for each (batch, class), the boxes kept, in the order they were kept. ``order`` is the
    sort's workspace."""
    from tvm.script import tirx as T

    pairs = batches * classes
    n_boxes = boxes_n
    k_max = max(per_class, 1)

    def overlap(boxes, b, first, second, threshold):
        """ONNX Runtime's SuppressByIOU(first, second) as one expression (its early returns are conditions of
        the result; a division by zero they guard against gives Inf/NaN here, and a false comparison)."""
        a = [boxes[b, first, i] for i in range(4)]
        c = [boxes[b, second, i] for i in range(4)]
        if center_point_box == 0:  # [y1, x1, y2, x2], any diagonal pair
            ax0, ax1 = T.min(a[1], a[3]), T.max(a[1], a[3])
            cx0, cx1 = T.min(c[1], c[3]), T.max(c[1], c[3])
            ay0, ay1 = T.min(a[0], a[2]), T.max(a[0], a[2])
            cy0, cy1 = T.min(c[0], c[2]), T.max(c[0], c[2])
        else:  # [x_center, y_center, width, height]
            half = T.float32(2.0)
            ax0, ax1 = a[0] - a[2] / half, a[0] + a[2] / half
            cx0, cx1 = c[0] - c[2] / half, c[0] + c[2] / half
            ay0, ay1 = a[1] - a[3] / half, a[1] + a[3] / half
            cy0, cy1 = c[1] - c[3] / half, c[1] + c[3] / half
        ix0, ix1 = T.max(ax0, cx0), T.min(ax1, cx1)
        iy0, iy1 = T.max(ay0, cy0), T.min(ay1, cy1)
        inter = (ix1 - ix0) * (iy1 - iy0)
        area1 = (ax1 - ax0) * (ay1 - ay0)
        area2 = (cx1 - cx0) * (cy1 - cy0)
        union = area1 + area2 - inter
        zero = T.float32(0.0)
        return tvm.tirx.all(ix1 > ix0, iy1 > iy0, inter > zero, area1 > zero, area2 > zero, union > zero,
                            inter / union > threshold)

    def before(scores, b, c, x, y):
        """Box x goes before box y: a higher score, or the same score and a lower index."""
        return tvm.tirx.any(scores[b, c, x] > scores[b, c, y],
                            tvm.tirx.all(scores[b, c, x] == scores[b, c, y], x < y))

    @T.prim_func(private=True, s_tir=True)
    def nms_select(boxes: T.Buffer((batches, n_boxes, 4), "float32"),
                   scores: T.Buffer((batches, classes, n_boxes), "float32"),
                   limit: T.Buffer((1,), "int64"), iou: T.Buffer((1,), "float32"), threshold: T.Buffer((1,), "float32"),
                   keep: T.Buffer((pairs, k_max), "int32"), kept: T.Buffer((pairs,), "int32"),
                   order: T.Buffer((2, pairs, n_boxes), "int32")):
        T.func_attr({"tir.noalias": True})
        for pair in T.serial(pairs):
            with T.sblock("nms_select"):
                v = T.axis.spatial(pairs, pair)
                T.reads(boxes[v // classes, 0:n_boxes, 0:4], scores[v // classes, v % classes, 0:n_boxes],
                        limit[0], iou[0], threshold[0], order[0:2, v, 0:n_boxes], keep[v, 0:k_max])
                T.writes(keep[v, 0:k_max], kept[v], order[0:2, v, 0:n_boxes])
                b = v // classes
                c = v % classes
                n = T.alloc_buffer((1,), "int32", scope="local")
                width = T.alloc_buffer((1,), "int32", scope="local")
                src = T.alloc_buffer((1,), "int32", scope="local")
                lo = T.alloc_buffer((1,), "int32", scope="local")
                i = T.alloc_buffer((1,), "int32", scope="local")
                j = T.alloc_buffer((1,), "int32", scope="local")
                k = T.alloc_buffer((1,), "int32", scope="local")
                ok = T.alloc_buffer((1,), "int32", scope="local")
                # the candidates, in box order
                n[0] = 0
                for box in range(n_boxes):
                    if T.bool(not has_score_threshold) or scores[b, c, box] > threshold[0]:
                        order[0, v, n[0]] = box
                        n[0] = n[0] + 1
                # stable merge sort, bottom up, between order[0] and order[1]: src holds the sorted runs
                src[0] = 0
                width[0] = 1
                while width[0] < n[0]:
                    lo[0] = 0
                    while lo[0] < n[0]:
                        i[0] = lo[0]
                        j[0] = T.min(lo[0] + width[0], n[0])
                        k[0] = lo[0]
                        while k[0] < T.min(lo[0] + 2 * width[0], n[0]):
                            ok[0] = 0  # 1: take from the left run
                            if i[0] < T.min(lo[0] + width[0], n[0]):
                                if j[0] < T.min(lo[0] + 2 * width[0], n[0]):
                                    if before(scores, b, c, order[src[0], v, j[0]], order[src[0], v, i[0]]):
                                        ok[0] = 0
                                    else:
                                        ok[0] = 1
                                else:
                                    ok[0] = 1
                            if ok[0] == 1:
                                order[1 - src[0], v, k[0]] = order[src[0], v, i[0]]
                                i[0] = i[0] + 1
                            else:
                                order[1 - src[0], v, k[0]] = order[src[0], v, j[0]]
                                j[0] = j[0] + 1
                            k[0] = k[0] + 1
                        lo[0] = lo[0] + 2 * width[0]
                    src[0] = 1 - src[0]
                    width[0] = width[0] * 2
                # the greedy pass: a candidate is kept unless it overlaps one kept before it
                k[0] = 0
                i[0] = 0
                while i[0] < n[0] and T.Cast("int64", k[0]) < T.min(T.max(limit[0], T.int64(0)), T.int64(per_class)):
                    ok[0] = 1
                    j[0] = 0
                    while j[0] < k[0] and ok[0] == 1:
                        if overlap(boxes, b, keep[v, j[0]], order[src[0], v, i[0]], iou[0]):
                            ok[0] = 0
                        j[0] = j[0] + 1
                    if ok[0] == 1:
                        keep[v, k[0]] = order[src[0], v, i[0]]
                        k[0] = k[0] + 1
                    i[0] = i[0] + 1
                kept[v] = k[0]

    return nms_select


def collect_func(batches: int, classes: int, per_class: int, rows: int):
    """PrimFunc ``(keep[BC, K], kept[BC]) -> (selected[R, 3] int64, count[1] int64)``: the kept boxes as
    ONNX's rows (batch, class, box), pair after pair, -1 past the real ones, and how many are real."""
    from tvm.script import tirx as T

    pairs = batches * classes
    k_max = max(per_class, 1)

    @T.prim_func(private=True, s_tir=True)
    def nms_collect(keep: T.Buffer((pairs, k_max), "int32"), kept: T.Buffer((pairs,), "int32"),
                    selected: T.Buffer((rows, 3), "int64"), count: T.Buffer((1,), "int64")):
        T.func_attr({"tir.noalias": True})
        for row in T.serial(rows):
            with T.sblock("nms_rows"):
                r = T.axis.spatial(rows, row)
                T.reads(keep[0:pairs, 0:k_max], kept[0:pairs])
                T.writes(selected[r, 0:3])
                start = T.alloc_buffer((1,), "int32", scope="local")
                start[0] = 0
                selected[r, 0] = T.int64(-1)
                selected[r, 1] = T.int64(-1)
                selected[r, 2] = T.int64(-1)
                for pair in range(pairs):
                    if start[0] <= r and r < start[0] + kept[pair]:
                        selected[r, 0] = T.Cast("int64", pair // classes)
                        selected[r, 1] = T.Cast("int64", pair % classes)
                        selected[r, 2] = T.Cast("int64", keep[pair, r - start[0]])
                    start[0] = start[0] + kept[pair]
        for one in T.serial(1):
            with T.sblock("nms_count"):
                o = T.axis.spatial(1, one)
                T.reads(kept[0:pairs])
                T.writes(count[o])
                total = T.alloc_buffer((1,), "int32", scope="local")
                total[0] = 0
                for pair in range(pairs):
                    total[0] = total[0] + kept[pair]
                count[o] = T.Cast("int64", T.min(total[0], rows))

    return nms_collect


def with_counts(model):
    """``(copy, counts)``: a copy of the ONNX model in which every NonMaxSuppression node has a second output,
    ``<its output>_count``, that is also a graph output; ``counts`` maps each selected-rows tensor to (its
    count's name, the node's label). The model itself is left as it is (ONNX Runtime runs it as the reference)."""
    import onnx

    from edgeq.load import nested_node

    inner = nested_node(model.graph, ("NonMaxSuppression",))
    if inner:
        raise ModelError(f"NonMaxSuppression node '{inner}' is inside an If/Loop branch; edgeq pads "
                         "NonMaxSuppression only in the main graph: fold the condition")
    if not any(n.op_type == "NonMaxSuppression" for n in model.graph.node):
        return model, {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = {v.name for v in copy.graph.input} | {v.name for v in copy.graph.output} | \
        {t.name for t in copy.graph.initializer} | {o for n in copy.graph.node for o in n.output}
    counts = {}
    for node in copy.graph.node:
        if node.op_type != "NonMaxSuppression" or not node.output or not node.output[0]:
            continue
        name = node.output[0] + COUNT_SUFFIX
        while name in taken:
            name += "_"
        taken.add(name)
        node.output.append(name)
        copy.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, [1]))
        counts[node.output[0]] = (name, f"NonMaxSuppression '{node.name or node.output[0]}'")
    return copy, counts


# ops through which the padded rows keep their meaning, position by position (numpy broadcasting)
_ELEMENTWISE = {
    "Identity", "Cast", "CastLike", "Abs", "Neg", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Reciprocal",
    "Floor", "Ceil", "Round", "Sign", "Not", "Clip", "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Where", "BitShift",
}


def padded_outputs(model, counts: dict[str, tuple[str, str]]) -> dict[str, tuple[int, str, str]]:
    """The graph outputs the selected rows reach, as ``{output: (padded axis, count name, node label)}``,
    followed through the ops above, Gather, Slice, Squeeze, Unsqueeze, Transpose and Concat (not across the
    rows). Raises ModelError naming the first op that would mix padded rows with real ones."""
    import onnx
    from onnx import numpy_helper

    if not counts:
        return {}
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for t in model.graph.initializer:
        ranks[t.name] = len(t.dims)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t) if node.attribute[0].HasField("t") else None
    padded = {name: (0, count, label) for name, (count, label) in counts.items()}

    for node in model.graph.node:
        hits = [(i, padded[x]) for i, x in enumerate(node.input) if x in padded]
        if not hits:
            continue
        sources = {h[1][1] for h in hits}
        label = hits[0][1][2]
        who = f"{node.op_type} node '{node.name or node.op_type}'"

        def refuse(why: str):
            raise ModelError(f"{who} {why} the rows {label} selected, which edgeq pads to a static bound (-1 rows "
                             "past the real ones); end the model before it and read the real rows by the count "
                             "output in the application")

        if len(sources) > 1:
            refuse("mixes the rows of two NonMaxSuppression nodes with")
        count = hits[0][1][1]
        out_rank = ranks.get(node.output[0]) if node.output else None
        axis_out = None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in _ELEMENTWISE:
            if out_rank is None:
                refuse("has no known rank after")
            axes = {p + out_rank - ranks.get(node.input[i], out_rank) for i, (p, _, _) in hits}
            if len(axes) > 1:
                refuse("lines up differently")
            axis_out = axes.pop()
        elif node.op_type == "Gather":
            rank = ranks.get(node.input[0])
            if rank is None:
                refuse("has no known rank after")
            axis = int(attrs.get("axis", 0))
            axis = axis + rank if axis < 0 else axis
            found = dict(hits)
            if 0 in found:
                p = found[0][0]
                if p == axis:
                    refuse("gathers along")
                axis_out = p if p < axis else p + ranks.get(node.input[1], 1) - 1
            if 1 in found:
                if 0 in found:
                    refuse("gathers padded rows by")
                axis_out = axis + found[1][0]
        elif node.op_type in ("Slice", "Squeeze", "Unsqueeze", "Transpose", "Concat") and hits[0][0] == 0 or \
                node.op_type == "Concat":
            p = hits[0][1][0]
            rank = ranks.get(node.input[0])
            if node.op_type == "Slice":
                starts_axes = consts.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
                if len(node.input) > 3 and node.input[3] and starts_axes is None:
                    refuse("slices, along axes computed at run time,")
                axes = [int(a) % rank for a in (starts_axes if starts_axes is not None else range(len(consts.get(node.input[1], []))))] \
                    if rank else []
                if p in axes:
                    refuse("slices along")
                axis_out = p
            elif node.op_type in ("Squeeze", "Unsqueeze"):
                axes = attrs.get("axes")
                if axes is None and len(node.input) > 1 and node.input[1]:
                    axes = consts.get(node.input[1])
                if axes is None:
                    refuse("squeezes, along axes computed at run time,")
                if node.op_type == "Squeeze":
                    axes = [int(a) % rank for a in axes]
                    if p in axes:
                        refuse("squeezes")
                    axis_out = p - sum(a < p for a in axes)
                else:
                    axes = sorted(int(a) % out_rank for a in axes)
                    axis_out = p
                    for a in axes:
                        if a <= axis_out:
                            axis_out += 1
            elif node.op_type == "Transpose":
                perm = list(attrs.get("perm", range(rank - 1, -1, -1)))
                axis_out = perm.index(p)
            else:  # Concat
                axis = int(attrs["axis"]) % out_rank
                if {h[1][0] for h in hits} != {p} or axis == p or len(hits) != len(node.input):
                    refuse("concatenates along or beside")
                axis_out = p
        else:
            refuse("uses")
        for out in node.output[:1]:
            padded[out] = (axis_out, count, label)
    return {o.name: padded[o.name] for o in model.graph.output if o.name in padded and o.name not in
            {c for c, _ in counts.values()}}


def selection_inputs(graph):
    """For a graph with NonMaxSuppression: the same graph returning, instead of its outputs, the boxes and
    scores its first NonMaxSuppression selects from; else None. Quantization is judged on these (the selected
    rows of a float and an int8 build differ in which boxes, not by how much)."""
    from edgeq.graph import Graph, call_op

    mod = relax.transform.ToNonDataflow()(graph.mod)  # dataflow vars cannot be returned
    func = mod["main"]
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if call_op(value) == "relax.call_tir" and value.args[0].name_hint.startswith("edgeq_nms_select"):
                boxes, scores = value.args[1].fields[0], value.args[1].fields[1]
                body = relax.SeqExpr(list(func.body.blocks), relax.Tuple([boxes, scores]))
                ret = relax.TupleType([boxes.ty, scores.ty])
                mod = mod.with_attr("edgeq", "selection inputs")  # a copy
                mod["main"] = relax.Function(func.params, body, ret, func.is_pure, func.attrs)
                return Graph(relax.transform.Normalize()(mod), graph.weights)
    return None


def check_iou_threshold(value: float, node: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ModelError(f"NonMaxSuppression node '{node}': iou_threshold {value:g} is not in [0, 1] (ONNX Runtime "
                         "refuses it too); fix the model's threshold")

