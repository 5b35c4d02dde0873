"""Ops whose output size depends on the data or that make sequences: NonMaxSuppression padded to a static
bound (``edgeq.nms``), the rest refused in one line naming what to do."""

from __future__ import annotations


import numpy as np

from edgeq.tvm_env import relax

from edgeq.onnx_ops.context import dtype_of, normal_axis, relax_const, runtime_operands, shape_of


# ----------------------------------------------------------------------------------------------- refusals


def data_dependent(ctx, inputs, attr):
    """Ops whose output size depends on the input values: a bundle has static output shapes."""
    if ctx.op == "Compress" and ctx.const(inputs[1]) is not None:
        condition = ctx.const(inputs[1]).astype(bool).reshape(-1)
        axis = attr.get("axis")
        x = inputs[0] if axis is not None else relax.op.reshape(inputs[0], [-1])
        axis = 0 if axis is None else normal_axis(int(axis), len(shape_of(inputs[0])))
        kept = np.nonzero(condition[: shape_of(x)[axis]])[0].astype("int64")
        return relax.op.take(x, relax_const(kept), axis=axis)
    if ctx.op == "Compress" and runtime_operands(inputs, ctx.params):
        ctx.refuse("its condition is computed at run time, and the size of its output depends on it (an edgeq bundle "
                   "has static output shapes)", "bind the graph input with --const NAME=FILE.npy (or make it an initializer)")
    ctx.refuse("the size of its output depends on the input values, and an edgeq bundle has static output shapes",
               f"end the model before {ctx.op} and run that step in the application")


def non_max_suppression(ctx, inputs, attr):
    """NonMaxSuppression padded to a static bound, with the count of real rows as a second output where
    the importer asked for one (``edgeq.nms``)."""
    from edgeq import nms

    boxes, scores = inputs[0], inputs[1]
    if dtype_of(boxes) != "float32" or dtype_of(scores) != "float32":
        ctx.refuse(f"boxes and scores are {dtype_of(boxes)} and {dtype_of(scores)}", "give it float32 boxes and scores")
    (batches, boxes_n, four), (batches2, classes, boxes_n2) = shape_of(boxes), shape_of(scores)
    if four != 4 or batches != batches2 or boxes_n != boxes_n2:
        ctx.refuse(f"boxes {shape_of(boxes)} and scores {shape_of(scores)} do not fit (ONNX: [B, N, 4] and [B, C, N])",
                   "fix the model")
    center = int(attr.get("center_point_box", 0))
    if center not in (0, 1):
        ctx.refuse(f"center_point_box is {center}", "ONNX allows 0 or 1")
    present = [i < len(inputs) and inputs[i] is not None for i in range(5)]
    limit_value = ctx.const(inputs[2]) if present[2] else np.zeros(1, "int64")
    per_class, rows = nms.bound(batches, classes, boxes_n,
                                None if limit_value is None else int(np.asarray(limit_value).reshape(-1)[0]),
                                ctx.max_detections)
    if rows == 0:
        ctx.refuse("max_output_boxes_per_class is 0 or absent, so it selects nothing (a bundle output cannot be empty)",
                   "give the model a positive max_output_boxes_per_class")
    iou_value = ctx.const(inputs[3]) if present[3] else np.zeros(1, "float32")
    if iou_value is not None:
        nms.check_iou_threshold(float(np.asarray(iou_value).reshape(-1)[0]), ctx.node)

    def scalar(index: int, dtype: str, default):
        if not present[index]:
            return relax_const(np.full(1, default, dtype))
        return relax.op.astype(relax.op.reshape(inputs[index], [1]), dtype)

    select = nms.select_func(batches, classes, boxes_n, per_class, center, present[4])
    collect = nms.collect_func(batches, classes, per_class, rows)
    bb, pairs = ctx.bb, batches * classes
    chosen = bb.emit(relax.call_tir(
        bb.add_func(select, "edgeq_nms_select"),
        relax.Tuple([boxes, scores, scalar(2, "int64", 0), scalar(3, "float32", 0.0), scalar(4, "float32", 0.0)]),
        [relax.TensorType([pairs, max(per_class, 1)], "int32"), relax.TensorType([pairs], "int32"),
         relax.TensorType([2, pairs, boxes_n], "int32")]))
    out = bb.emit(relax.call_tir(
        bb.add_func(collect, "edgeq_nms_collect"),
        relax.Tuple([bb.emit(relax.TupleGetItem(chosen, 0)), bb.emit(relax.TupleGetItem(chosen, 1))]),
        [relax.TensorType([rows, 3], "int64"), relax.TensorType([1], "int64")]))
    selected, count = relax.TupleGetItem(out, 0), relax.TupleGetItem(out, 1)
    return relax.Tuple([bb.normalize(selected), bb.normalize(count)]) if ctx.num_outputs == 2 else selected


def sequence_output(ctx, inputs, attr):
    ctx.refuse("it makes a sequence of tensors, and an edgeq bundle takes and returns tensors",
               "use Split, which returns the parts as separate tensors")
