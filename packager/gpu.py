"""The CUDA path: the graph clean-up before TVM, and TVM's CUDA pipeline with edgeq's schedule step.

Graph (``prepare_graph``, run by ``edgeq.compile.lower_graph`` for CUDA targets, so the golden outputs are
computed on the same graph the device runs):

- ``fold_batch_norm``: inference BatchNorm folded into the convolution before it (its weights scaled, its
  bias shifted); a BatchNorm with no convolution before it becomes a per-channel multiply and add, which
  FuseOps fuses into the kernel before it. No batch-norm kernel is left.
- ``precompute_weight_ops``: reshapes, transposes and casts of weights (ONNX Conv's bias reshaped to
  [1, C, 1, 1], Gemm's transposed weight) done here, once, on the weights: they are kernels per inference
  otherwise (TVM cannot fold them, weights are parameters, not constants).

Bias, activation and residual add then fuse into the producing conv/matmul kernel by TVM's FuseOps/FuseTIR.

Pipeline (``pipeline``): the phases of TVM's ``relax/backend/cuda/pipeline.py``, the same passes, with the
dlight step replaced by ``ScheduleKernels``: dlight's GPU rules per PrimFunc in order; a tensor-core
schedule (dlight's Matmul picks ``MatmulInt8Tensorization`` for int8 x int8 -> int32 and
``MatmulTensorization`` for fp16 when every GEMM extent is over 64) is built alone for the target first, and
when TVM cannot build it (TVM 0.27's int8 tensorization fails in InjectSoftwarePipeline,
``GetWmmaFragmentSize``) it is tried once more without its software-pipeline annotations (that lowers; NVRTC
then needs CUDA's ``crt/mma.h``), and failing that the function is scheduled again without tensor cores
(dlight's plain Matmul; for int8 the SASS has IDP.4A, dp4a). ``GpuKernels`` records
which rule each function got, the fallbacks with the first line of TVM's error, the kernel launches per
inference (in all and per function) and whether CUDA graph capture took effect; the manifest carries it
as ``library.gpu_kernels``.

fp16 (``to_fp16``, ``edgeq package --precision fp16``): TVM's ToMixedPrecision on the prepared graph, fp16
weights folded once, fp32 accumulation in the conv/matmul kernels (dlight's ``MatmulTensorization``: HMMA).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from edgeq.errors import ModelError
from edgeq.graph import LAYOUT_OPS, Graph, Rewriter, apply_layout_op, call_op, const_value, rewrite
from edgeq.toolchain import import_tvm

tvm = import_tvm()
from tvm import relax  # noqa: E402
from tvm.s_tir import dlight as dl  # noqa: E402

# PassContext key that makes RewriteCUDAGraph (in TVM's finalize phase) lift static call sequences into
# functions captured once as a CUDA graph and replayed (vm.builtin.cuda_graph.run_or_capture).
USE_CUDA_GRAPH = "relax.backend.use_cuda_graph"
CUDA_GRAPH_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"
NO_TENSOR_CORES = "dlight.do_not_tensorize"  # dlight's tensorization rules skip a PrimFunc with this attribute


# ------------------------------------------------------------------ graph transforms


def _static(rw: Rewriter, expr, dequantize: bool = True) -> np.ndarray | None:
    """The value of ``expr`` when it is known before run time: with ``dequantize``, ``Rewriter.static_value``;
    without, only a weight, a constant, or a reshape / transpose / cast / squeeze / expand_dims of one."""
    if dequantize:
        return rw.static_value(expr)
    value = rw.array(expr)
    if value is not None:
        return value
    inner = rw.value(expr) if isinstance(expr, relax.Var) else expr
    return apply_layout_op(inner, lambda e: _static(rw, e, False)) if isinstance(inner, relax.Call) else None


def _fresh(rw: Rewriter, name: str) -> str:
    """A weight parameter name not taken yet (``Rewriter.param`` returns the existing one for a taken name)."""
    taken = set(rw.weights) | set(rw.graph.weights)
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    return candidate




def _name(expr, default: str) -> str:
    return expr.name if isinstance(expr, relax.Var) else default


def fold_batch_norm(graph: Graph) -> Graph:
    """Inference BatchNorm (``relax.nn.batch_norm``, training off, statistics known) folded away: into the
    weights and bias of a convolution (NCHW/OIHW, weights known, its output used only by the BatchNorm) or
    a ``conv + bias`` before it, otherwise into a per-channel multiply and add."""

    def visit(rw: Rewriter, var, value):
        if not isinstance(value, relax.TupleGetItem) or value.index != 0:
            return None
        bn = rw.value(value.tuple_value)
        if call_op(bn) != "relax.nn.batch_norm" or bool(bn.attrs.training):
            return None
        x, gamma, beta, mean, variance = bn.args
        stats = [_static(rw, a) for a in (gamma, beta, mean, variance)]
        shape = _shape(x)
        if any(s is None for s in stats) or shape is None or _dtype(x) != "float32":
            return None
        axis = int(bn.attrs.axis) % len(shape)
        gamma_v, beta_v, mean_v, var_v = (s.astype(np.float64).reshape(-1) for s in stats)
        eps = float(bn.attrs.epsilon)
        scale = gamma_v / np.sqrt(var_v + eps) if bool(bn.attrs.scale) else 1.0 / np.sqrt(var_v + eps)
        shift = (beta_v if bool(bn.attrs.center) else 0.0) - mean_v * scale
        base = _name(value.tuple_value, "bn")
        folded = _fold_into_conv(rw, x, scale, shift, axis, base)
        if folded is not None:
            return folded
        bshape = [1] * len(shape)
        bshape[axis] = -1
        scale_param = rw.param(_fresh(rw, f"{base}_scale"), scale.astype(np.float32).reshape(bshape))
        shift_param = rw.param(_fresh(rw, f"{base}_shift"), shift.astype(np.float32).reshape(bshape))
        return relax.op.add(rw.emit(relax.op.multiply(rw.new(x), scale_param)), shift_param)

    return rewrite(graph, visit)


def _fold_into_conv(rw: Rewriter, x, scale, shift, axis: int, base: str):
    """conv2d(data, W * scale) + (bias * scale + shift), or None when ``x`` is not such a convolution."""
    if axis != 1 or not isinstance(x, relax.Var) or rw.uses(x) != 1:
        return None
    inner = rw.value(x)
    bias = None
    if call_op(inner) == "relax.add":
        a, b = inner.args
        for conv_var, bias_expr in ((a, b), (b, a)):
            if call_op(rw.value(conv_var)) == "relax.nn.conv2d" and _static(rw, bias_expr) is not None:
                bias = _static(rw, bias_expr)
                per_channel = bias.ndim >= 3 and bias.shape[-3] == scale.size and bias.size == scale.size
                if rw.uses(conv_var) != 1 or not (bias.size == 1 or per_channel):
                    return None
                inner = rw.value(conv_var)
                break
        else:
            return None
    if call_op(inner) != "relax.nn.conv2d":
        return None
    a = inner.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return None
    if str(a.out_dtype) not in ("", "None", "void", "float32"):  # None: the input's dtype
        return None
    data, w = inner.args
    wv = _static(rw, w)
    if wv is None or wv.dtype != np.float32 or wv.shape[0] != scale.size:
        return None
    weight = (wv.astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(np.float32)
    b = np.zeros(scale.size) if bias is None else np.broadcast_to(bias.reshape(-1).astype(np.float64), scale.shape)
    new_bias = (b * scale + shift).astype(np.float32).reshape(1, -1, 1, 1)
    conv = relax.op.nn.conv2d(rw.new(data), rw.param(_fresh(rw, f"{_name(w, base)}_{base}_folded"), weight), a.strides,
                              a.padding, a.dilation, int(a.groups), "NCHW", "OIHW", "NCHW")
    return relax.op.add(rw.emit(conv), rw.param(_fresh(rw, f"{base}_folded_bias"), new_bias))


def precompute_weight_ops(graph: Graph) -> Graph:
    """Reshapes, transposes, casts, squeezes and expand_dims of weights computed now: their results become
    weight parameters, so no kernel computes them on every inference. (Of constants alone TVM's FoldConstant
    takes care; dequantized weights stay as they are: precomputed they would be float, four times larger.)"""

    def visit(rw: Rewriter, var, value):
        if call_op(value) not in LAYOUT_OPS or const_value(value.args[0]) is not None:
            return None
        result = _static(rw, value, dequantize=False)
        if result is None:
            return None
        return rw.param(_fresh(rw, f"{_name(value.args[0], 'w')}_{var.name}"), result)

    return rewrite(graph, visit)


def prepare_graph(graph: Graph) -> Graph:
    """The graph transforms of the CUDA path, in order (no scheduling: the result builds for any target,
    which is how its correctness is checked without a GPU)."""
    return precompute_weight_ops(fold_batch_norm(graph))


def _shape(expr) -> list[int] | None:
    ty = getattr(expr, "struct_info", None) or getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    values = list(shape.values)
    return [int(v) for v in values] if all(isinstance(v, tvm.tirx.IntImm) for v in values) else None


def _dtype(expr) -> str | None:
    ty = getattr(expr, "struct_info", None) or getattr(expr, "ty", None)
    return str(ty.dtype) if ty is not None and hasattr(ty, "dtype") else None


# ------------------------------------------------------------------ scheduling


@dataclasses.dataclass
class GpuKernels:
    """What each GPU kernel got; JSON-ready and deterministic (sorted), recorded in the manifest."""

    functions: dict[str, str] = dataclasses.field(default_factory=dict)  # PrimFunc -> schedule rule
    fallbacks: list[dict[str, str]] = dataclasses.field(default_factory=list)
    kernels_per_inference: int = 0  # kernel launches of one call of main
    launches: dict[str, int] = dataclasses.field(default_factory=dict)  # PrimFunc -> its launches per inference
    cuda_graph: bool = False  # main's static call sequences run as one captured CUDA graph
    cuda_graph_kernels: int = 0  # of kernels_per_inference, those inside the graph (one launch for all)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for rule in self.functions.values():
            counts[rule] = counts.get(rule, 0) + 1
        return {
            "kernels_per_inference": self.kernels_per_inference,
            "cuda_graph": self.cuda_graph,
            "cuda_graph_kernels": self.cuda_graph_kernels,
            "schedules": dict(sorted(counts.items())),
            "functions": dict(sorted(self.functions.items())),
            "launches": dict(sorted(self.launches.items())),
            "fallbacks": sorted(self.fallbacks, key=lambda f: f["function"]),
        }


# dlight's GPU rules in the order TVM's CUDA pipeline tries them, with the name each is recorded under.
RULES = (
    ("matmul", dl.gpu.Matmul()),
    ("gemv", dl.gpu.GEMV()),
    ("reduction", dl.gpu.Reduction()),
    ("general reduction", dl.gpu.GeneralReduction()),
    ("fallback", dl.gpu.Fallback()),
)
TENSOR_CORE_NAMES = {"int8": "int8 tensorized matmul", "float16": "tensorized matmul"}


def _tensorized(sch) -> bool:
    return any(inst.kind.name in ("Tensorize", "Blockize") for inst in sch.trace.insts)


def _input_dtype(func) -> str:
    text = func.script()
    return "int8" if '"int8"' in text else "float16" if '"float16"' in text else "float32"


def _first_line(err: Exception) -> str:
    """The error's first line, and where that only introduces the cause (NVRTC: "compilation failed:"),
    the first line that names an error, without paths from this machine."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    cause = next((ln for ln in lines[1:] if "error" in ln.lower()), None) if text.endswith(":") else None
    if cause:
        text = f"{text} {re.sub(r'^.*?/include/', 'include/', cause)}"
    return f"{type(err).__name__}: {text}"[:300]


def _builds(name: str, func, target) -> Exception | None:
    """Build one scheduled PrimFunc alone for ``target``; the error when TVM cannot."""
    try:
        with target:  # TVM's NVRTC callback reads the architecture from the current target
            tvm.tirx.build(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)
    except Exception as err:  # noqa: BLE001 - TVM raises InternalError, TVMError, ValueError, ...
        return err
    return None


def schedule_function(name: str, func, target, check_all: bool = False) -> tuple[Any, str, list[dict[str, str]]]:
    """(scheduled PrimFunc or None, rule name, fallbacks) for one PrimFunc: the first dlight rule that applies
    and, for tensor-core schedules (or every schedule with ``check_all``), builds alone for ``target``. A
    tensor-core schedule that does not build is tried once more without its software pipeline, then the
    function is scheduled without tensor cores."""
    fallbacks: list[dict[str, str]] = []
    candidates = list(RULES)
    while candidates:
        rule_name, rule = candidates.pop(0)
        try:
            sch = rule.apply(func, target, False)
        except Exception as err:  # noqa: BLE001 - a rule that raises is a rule that does not apply
            fallbacks.append({"function": name, "rule": rule_name, "error": _first_line(err)})
            continue
        if sch is None:
            continue
        if isinstance(sch, list):
            sch = sch[0]
        tensor_cores = rule_name == "matmul" and _tensorized(sch)
        if tensor_cores:
            rule_name = TENSOR_CORE_NAMES.get(_input_dtype(func), "tensorized matmul")
        attempts = [(rule_name, sch.mod["main"])]
        if tensor_cores and _drop_software_pipeline(sch):  # TVM 0.27's int8 wmma fails in InjectSoftwarePipeline
            attempts.append((f"{rule_name} (no software pipeline)", sch.mod["main"]))
        for attempt, scheduled in attempts:
            scheduled = scheduled.with_attr("tirx.is_scheduled", True)
            err = _builds(name, scheduled, target) if tensor_cores or check_all else None
            if err is None:
                return scheduled, attempt, fallbacks
            fallbacks.append({"function": name, "rule": attempt, "error": _first_line(err)})
        if tensor_cores:
            func = func.with_attr(NO_TENSOR_CORES, True)
            candidates.insert(0, ("matmul", rule))
    return None, "unscheduled", fallbacks


SOFTWARE_PIPELINE = ("software_pipeline_stage", "software_pipeline_order", "software_pipeline_async_stages")


def _drop_software_pipeline(sch) -> bool:
    """Remove the software-pipeline annotations from every loop of ``sch`` (the same computation, without
    overlapping the next tile's loads with this tile's math); whether there were any."""
    seen, dropped = set(), False
    blocks = [sch.get_sblock("root")]
    while blocks:
        block = blocks.pop()
        blocks.extend(sch.get_child_blocks(block))
        for loop in sch.get_loops(block):
            stmt = sch.get(loop)
            if stmt in seen:
                continue
            seen.add(stmt)
            for key in SOFTWARE_PIPELINE:
                if key in stmt.annotations:
                    sch.unannotate(loop, key)
                    dropped = True
    return dropped


def ScheduleKernels(target, report: GpuKernels, check_all: bool = False):  # noqa: N802 - a pass, named like TVM's
    """dlight's ApplyDefaultSchedule with a build check and fallback per PrimFunc (see the module docstring)."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.ScheduleKernels")
    def _pass(mod, _ctx):
        updates = {}
        for gv, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):
            if not isinstance(func, tvm.tirx.PrimFunc) or int((func.attrs or {}).get("tirx.is_scheduled", 0) or 0) == 1:
                continue
            scheduled, rule, fallbacks = schedule_function(gv.name_hint, func, target, check_all)
            report.functions[gv.name_hint] = rule
            report.fallbacks.extend(fallbacks)
            if scheduled is not None:
                updates[gv] = scheduled
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def CountKernels(report: GpuKernels):  # noqa: N802
    """Kernel launches per inference, in all and per PrimFunc: main's call_tir calls once reshapes have become
    views."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CountKernels")
    def _pass(mod, _ctx):
        launches: dict[str, int] = {}

        def visit(expr):
            if call_op(expr) == "relax.call_tir":
                name = expr.args[0].name_hint
                launches[name] = launches.get(name, 0) + 1

        relax.analysis.post_order_visit(mod["main"], visit)
        report.kernels_per_inference, report.launches = sum(launches.values()), launches
        return mod

    return _pass


def RecordResult(report: GpuKernels):  # noqa: N802
    """What the pipeline left: whether RewriteCUDAGraph lifted anything (main calls the capture-or-replay
    builtin) and how many kernel calls the captured functions hold, and the rules of only the kernels still
    in the module (reshapes became views)."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.RecordResult")
    def _pass(mod, _ctx):
        kernels = {gv for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
        found, captured = False, 0

        def visit_main(expr):
            nonlocal found
            if isinstance(expr, relax.ExternFunc) and expr.global_symbol == CUDA_GRAPH_BUILTIN:
                found = True

        def visit_capture(expr):
            nonlocal captured
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.GlobalVar) and expr.op in kernels:
                captured += 1

        relax.analysis.post_order_visit(mod["main"], visit_main)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and gv.name_hint.endswith("_cuda_graph_capture"):
                relax.analysis.post_order_visit(func, visit_capture)
        report.cuda_graph, report.cuda_graph_kernels = found, captured if found else 0
        names = {gv.name_hint for gv in kernels}
        report.functions = {name: rule for name, rule in report.functions.items() if name in names}
        return mod

    return _pass


def pipeline(target, report: GpuKernels, check_all: bool = False):
    """TVM's CUDA pipeline (relax/backend/cuda/pipeline.py) with edgeq's schedule step and records."""
    from tvm.relax.backend.cuda import pipeline as cuda

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CudaPipeline")
    def _pipeline(mod, _ctx):
        legalize = [
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            ScheduleKernels(target, report, check_all),  # TVM: dl.ApplyDefaultSchedule(Matmul, GEMV, ...)
        ]
        dataflow_lower = cuda.dataflow_lower_passes(target)  # RewriteDataflowReshape first: reshapes become views
        passes = (cuda.library_dispatch_passes(target) + legalize + dataflow_lower[:1]
                  + [relax.transform.DeadCodeElimination(["main"]), CountKernels(report)]  # drop the reshapes' kernels
                  + dataflow_lower[1:] + cuda.finalize_passes(target) + [RecordResult(report)])
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build(mod, target, report: GpuKernels):
    """``relax.build`` on ``pipeline`` with CUDA graph capture on. When the whole build still fails (a
    schedule no rule check caught), it is retried once with every schedule built alone first."""
    config = {USE_CUDA_GRAPH: True}
    try:
        with tvm.transform.PassContext(config=config):
            return relax.build(mod, target=target, relax_pipeline=pipeline(target, report))
    except Exception as err:  # noqa: BLE001
        first = _first_line(err)
    fresh = GpuKernels()
    with tvm.transform.PassContext(config=config):
        executable = relax.build(mod, target=target, relax_pipeline=pipeline(target, fresh, check_all=True))
    for field in dataclasses.fields(GpuKernels):
        setattr(report, field.name, getattr(fresh, field.name))
    report.fallbacks.append({"function": "(whole module)", "rule": "build", "error": first})
    return executable


# ------------------------------------------------------------------ fp16


def to_fp16(graph: Graph) -> Graph:
    """fp16 weights and activations, fp32 accumulation in convolutions and matrix products: TVM's
    ``ToMixedPrecision`` on the graph with its weights bound as constants, so that the casts of weights it
    inserts fold here, once (the bundle ships fp16 weights; no cast of a weight runs per inference), and the
    bias adds, activations and residual adds after a conv run in fp16 too (with weights as fp32 parameters
    they would stay fp32, and so would the tensors between kernels). The operators ToMixedPrecision keeps in
    fp32 (softmax, reductions) get casts; the model's inputs and outputs keep their dtypes. The folded
    constants become weight parameters again. Run after ``fold_batch_norm`` (it folds float32 only)."""
    # (ToMixedPrecision's fp16_input_names would convert the parameters directly, but TVM 0.27 fails with it
    # on a graph holding call_tir or R.clip: "Expected TensorType, but got T.int64".)
    bound = relax.transform.BindParams("main", {k: tvm.runtime.tensor(v) for k, v in graph.weights.items()})(graph.mod)
    bound = _clips_as_max_min(Graph(relax.transform.FoldConstant()(bound), {}))
    try:
        mixed = relax.transform.FoldConstant()(relax.transform.ToMixedPrecision("float32")(bound.mod))
    except Exception as err:  # noqa: BLE001 - TVM's InternalError
        raise ModelError(f"--precision fp16: TVM's ToMixedPrecision cannot convert this graph ({_first_line(err)}); "
                         "package it in fp32") from None
    return _lift_constants(Graph(mixed, {}))


def _clips_as_max_min(graph: Graph) -> Graph:
    """Clips as ``maximum``/``minimum`` of a 0-d constant, which ToMixedPrecision converts (it fails on a
    call_tir, and on ``relax.clip``'s PrimValue bounds: "Expected TensorType, but got T.int64"). ONNX Clip with
    bounds that are weights imports as TIR calls ``maximum``/``minimum`` (the NaN guard around the bound folded
    by FoldConstant once the weights are constants); HardSwish and ReLU6 as ``relax.clip``."""

    def visit(rw: Rewriter, var, value):
        op = call_op(value)
        if op == "relax.clip" and all(isinstance(a, _IMMEDIATES) for a in value.args[1:]):
            dtype = _dtype(value.args[0]) or "float32"
            low, high = (relax.const(float(a.value), dtype) for a in value.args[1:])
            return relax.op.minimum(rw.emit(relax.op.maximum(rw.new(value.args[0]), low)), high)
        if op != "relax.call_tir" or not isinstance(value.args[1], relax.Tuple):
            return None
        name = value.args[0].name_hint
        ops = {"maximum": relax.op.maximum, "minimum": relax.op.minimum}
        tir_op = next((op for prefix, op in ops.items() if name.startswith(prefix)), None)
        args = list(value.args[1].fields)
        if tir_op is None or len(args) != 2 or _array(args[1]) is None or _array(args[1]).ndim != 0:
            return None
        return tir_op(rw.new(args[0]), args[1])

    return rewrite(graph, visit)


def _lift_constants(graph: Graph) -> Graph:
    """The constants (not scalars) that calls in ``graph`` take become weight parameters."""

    def visit(rw: Rewriter, var, value):
        if not isinstance(value, relax.Call) or not any(_liftable(a) for a in value.args):
            return None
        args = [rw.param(_fresh(rw, f"{var.name}_w{i}"), _array(a)) if _liftable(a) else rw.new(a)
                for i, a in enumerate(value.args)]
        return relax.Call(value.op, args, value.attrs, value.ty_args)

    return rewrite(graph, visit)


def _liftable(expr) -> bool:
    value = _array(expr)
    return value is not None and value.ndim > 0


_IMMEDIATES = (tvm.tirx.IntImm, tvm.tirx.FloatImm)  # PrimValue arguments (relax.clip's bounds): Constants too


def _array(expr) -> np.ndarray | None:
    """The array of a tensor constant; None for anything else (a PrimValue included)."""
    return None if isinstance(expr, _IMMEDIATES) else const_value(expr)
