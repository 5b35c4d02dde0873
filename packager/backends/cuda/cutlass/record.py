"""What the manifest says of each kernel (``kernel_record``).
"""

from __future__ import annotations

import math

from edgeq.backends.cuda.cutlass.kernels import (ConvKernel, DEPTHWISE_LANES, DepthwiseKernel, GemmKernel,
    GroupConvKernel, TokenLinearKernel)


def kernel_record(kernel: ConvKernel, smem_bytes: int) -> dict:
    """What the manifest says of one kernel: template (or edgeq's depthwise), tile, the problem, the epilogue,
    FLOPs."""
    p = kernel.problem
    if isinstance(kernel, GemmKernel):
        return {
            "function": kernel.function, "template": "GemmBatched over DefaultGemm (Sm80, fp16, fp32 "
            f"accumulation, row-major A, {kernel.b_layout.replace('Major', '-major').lower()} B)",
            "tile": list(kernel.tile.block), "warp": list(kernel.tile.warp),
            "stages": kernel.tile.stages, "threads": kernel.tile.threads, "grid": list(kernel.grid),
            "shared_bytes": smem_bytes, "problem": {"batch": p.batch, "mnk": [p.m, p.n, p.k]},
            "strides": {name: list(v) for name, v in kernel.strides.items()},
            "head_views": [name for name, v in (("a", kernel.a_view), ("w", kernel.b_view), ("y", kernel.y_view))
                           if v is not None],
            "offsets": {"a": kernel.a_offset, "w": kernel.b_offset},
            "alpha": kernel.alpha, "activation": "identity", "residual": False, "precision": kernel.precision,
            "output": kernel.out_dtype, "flops": p.flops,
            **({"quantize": {"divisor": kernel.quantize[0], "clamp": list(kernel.quantize[1:])}} if kernel.quantize
               else {}),
        }
    problem = {"nhwc": [p.n, p.h, p.w, p.c], "k": p.k, "rs": [p.r, p.s], "pad": list(p.pad), "stride": list(p.stride),
               "dilation": list(p.dilation), "output_pixels": p.n * p.p * p.q}
    if getattr(kernel, "x_view", None):  # channels [first, first + C) of an input with more
        problem["input_channels"] = {"first": kernel.x_view[0], "of": kernel.x_view[1]}
    if getattr(kernel, "out_view", None):  # channels [first, first + K) of a concatenation
        problem["output_channels"] = {"first": kernel.out_view[0], "of": kernel.out_view[1],
                                      "in_place": kernel.out_in_place}
    if getattr(kernel, "residual_view", None):
        problem["residual_channels"] = {"first": kernel.residual_view[0], "of": kernel.residual_view[1]}
    if getattr(kernel, "up_view", None):  # also nearest-upsampled 2x into channels [first, first + K) of a tensor
        problem["upsampled_2x_into_channels"] = {"first": kernel.up_view[0], "of": kernel.up_view[1]}
    if getattr(kernel, "head_out", None):  # channels [first, first + K) at anchors [anchor, anchor + P Q) of [N, C, A]
        first, anchor, channels, anchors, dtype = kernel.head_out
        problem["detector_output"] = {"channels": [first, first + p.k], "anchors": [anchor, anchor + p.p * p.q],
                                      "shape": [p.n, channels, anchors], "dtype": dtype}
    if isinstance(kernel, DepthwiseKernel):
        record = {
            "function": kernel.function, "template": f"edgeq depthwise (TIR: {DEPTHWISE_LANES} channels of an output "
            f"pixel per thread, {'int32' if kernel.precision == 'int8' else 'fp32'} accumulation)",
            "threads": kernel.threads, "grid": list(kernel.grid), "shared_bytes": 0,
            "problem": {**problem, "groups": p.groups},
        }
    else:
        template = ("DefaultConv2dFpropWithBroadcast (Sm80, s8 x s8 -> s32, edgeq's Requantize epilogue)"
                    if kernel.precision == "int8" else "DefaultConv2dFpropWithBroadcast (Sm80, fp16, fp32 accumulation)")
        if isinstance(kernel, TokenLinearKernel):
            template = ("DefaultGemmWithVisitor (Sm80, s8 x s8 -> s32, epilogue visitor tree: weight scale and bias "
                        "per column, token scale per row)")
        if isinstance(kernel, GroupConvKernel):
            template = (f"DefaultConv2dGroupFprop (Sm80, fp16, fp32 accumulation, {kernel.group_mode}, bias as a "
                        "zero-stride source)")
            problem["groups"] = p.groups
        record = {
            "function": kernel.function, "template": template,
            "tile": list(kernel.tile.block), "warp": list(kernel.tile.warp), "stages": kernel.tile.stages,
            "split_k": kernel.tile.split_k,
            "threads": kernel.tile.threads, "grid": list(kernel.grid), "shared_bytes": smem_bytes, "problem": problem,
        }
        if isinstance(kernel, GroupConvKernel):  # the tensor cores' work over the useful work
            record["tensor_core_work"] = kernel.work
    record.update({
        "activation": kernel.activation, "residual": kernel.residual, "precision": kernel.precision,
        "output": kernel.output_dtype, "flops": p.flops,
    })
    if kernel.residual:
        record["residual_dtype"] = kernel.residual_type
        record["residual_after_activation"] = getattr(kernel, "residual_after", False)
    if kernel.precision != "int8" and not isinstance(kernel, GemmKernel) and kernel.bias_dtype != "float16":
        record["bias_dtype"] = kernel.bias_dtype  # an fp16 layer of an int8 graph: its float32 bias
    if isinstance(kernel, TokenLinearKernel):  # y = float(acc) * scale[n] * token[m] + bias[n] [GELU] [+ residual]
        record["activation"] = "gelu" if kernel.gelu else "identity"
        record["token_scale"] = {"rows": kernel.rows, "bias": True, "gelu": list(kernel.gelu) if kernel.gelu else None}
        return record
    if kernel.precision == "int8":
        record["requantize"] = {
            "float_out": kernel.float_out, "silu": kernel.silu, "post_scale": kernel.post,
            "residual_scale": kernel.residual_scale,
            "out_div": kernel.out_div,
            "activation_clamp": [None if math.isinf(v) else v for v in (kernel.act_lo, kernel.act_hi)],
            "clamp": [kernel.lo, kernel.hi],
        }
    return record
