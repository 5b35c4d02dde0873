"""The CUDA path: the graph clean-up before TVM, and TVM's CUDA pipeline with edgeq's schedule step.

Graph (``prepare_graph``, run by ``edgeq.compile.lower_graph`` for CUDA targets, so the golden outputs are
computed on the same graph the device runs): ``edgeq.graph_passes.fold_batch_norm`` (no batch-norm kernel is
left) and ``precompute_weight_ops`` (weight reshapes and transposes done once, at build time).

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

from edgeq.backends.cuda import attention, concat_in_place, squeeze_excite
from edgeq.errors import ModelError
from edgeq.graph import Graph, Rewriter, call_op, const_value, rewrite
from edgeq.graph_passes import dtype_of, fold_batch_norm, fresh_name, precompute_weight_ops, shape_of
from edgeq.tvm_env import dlight as dl, relax, tvm


# PassContext key that makes RewriteCUDAGraph (in TVM's finalize phase) lift static call sequences into
# functions captured once as a CUDA graph and replayed (vm.builtin.cuda_graph.run_or_capture).
USE_CUDA_GRAPH = "relax.backend.use_cuda_graph"
CUDA_GRAPH_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"
NO_TENSOR_CORES = "dlight.do_not_tensorize"  # dlight's tensorization rules skip a PrimFunc with this attribute


# ------------------------------------------------------------------ graph transforms


def prepare_graph(graph: Graph) -> Graph:
    """The graph transforms of the CUDA path, in order (no scheduling: the result builds for any target,
    which is how its correctness is checked without a GPU)."""
    return precompute_weight_ops(fold_batch_norm(graph))


# element-wise operators that commute with a reshape when their other operands are scalars
_ELEMENTWISE = ("relax.astype", "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.round",
                "relax.maximum", "relax.minimum", "relax.clip", "relax.nn.relu", "relax.sigmoid", "relax.tanh",
                "relax.exp", "relax.negative", "relax.abs", "relax.floor", "relax.ceil")


def _memory_view(value) -> bool:
    """A reshape, or a permute_dims that moves only axes of extent 1: the same bytes in another shape."""
    op = call_op(value)
    if op == "relax.reshape":
        return True
    if op != "relax.permute_dims":
        return False
    shape = shape_of(value.args[0])
    if shape is None:
        return False
    axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else list(range(len(shape)))[::-1]
    moved = [a for a in axes if shape[a] != 1]
    return moved == sorted(moved)


def views_collapsed(graph: Graph) -> Graph:
    """Reshapes (and transposes of size-1 axes) after a reduction sunk below the element-wise operators with scalar
    operands that follow them, merged, and dropped where they end in the shape they started from. A global pool's
    ``mean(keepdims) -> transpose -> reshape [N, C] -> (quantize) -> reshape [N, 1, 1, C]`` before a classifier
    (a 1x1 convolution on the CUTLASS path) becomes ``mean -> (quantize)``, which FuseOps makes one kernel: a
    reshape between a reduction and what follows it would keep them apart (FuseOps fuses only element-wise
    operators after a reduction; a reshape is injective), and the element-wise operators after it would be a
    kernel of their own. Only after a reduction: elsewhere a reshape at the head of element-wise operators fuses
    with them, and sinking it could split them from a reduction that follows (a transformer's ``abs -> max``). A
    chain of views alone that ends in the shape it started from is dropped wherever it is."""
    sunk: dict = {}  # input-graph var -> the output-graph var holding its elements in another shape (after a reduction)
    views: dict = {}  # the same for chains of views alone

    def scalar(expr) -> bool:
        shape = shape_of(expr)
        return shape is not None and all(d == 1 for d in shape)

    def reduction(expr) -> bool:
        value = expr if isinstance(expr, relax.Call) else None
        op = call_op(value)
        return op in ("relax.mean", "relax.sum", "relax.max", "relax.min") or (
            op == "relax.call_tir" and value.args[0].name_hint.startswith("mean_fp16"))

    def visit(rw: Rewriter, var, value):
        if not isinstance(value, relax.Call) or not value.args:
            return None
        src = value.args[0]
        shape = shape_of(var)
        if _memory_view(value) and shape is not None:
            after_reduction = src in sunk or reduction(rw.value(src))
            root = sunk.get(src, views.get(src, rw.new(src)))
            if shape == shape_of(root):
                return root  # back in the shape it started from: no operator at all
            (sunk if after_reduction else views)[var] = root
            return relax.op.reshape(root, shape) if after_reduction or src in views else None
        if call_op(value) in _ELEMENTWISE and src in sunk and all(scalar(a) for a in value.args[1:]):
            root = sunk[src]
            rank = len(shape_of(root) or ())
            if all(len(shape_of(a)) <= rank for a in value.args[1:]):
                inner = rw.emit(relax.Call(value.op, [root, *(rw.new(a) for a in value.args[1:])], value.attrs,
                                           value.ty_args))
                sunk[var] = inner
                return relax.op.reshape(inner, shape)
        return None

    return rewrite(graph, visit)


def splits_as_slices(graph: Graph) -> Graph:
    """Each part of a split along the channels (the last axis of an NHWC tensor: YOLO's C2f splits its first
    convolution's output in two) as a ``strided_slice`` of the split's input. A split is a kernel of its own writing
    every part; a slice is injective, so it fuses into an element-wise reader or a concatenation, and a CUTLASS
    convolution reads its channels in place (``ConvKernel.x_view``): the split's kernel goes."""
    def visit(rw: Rewriter, var, value):
        if not isinstance(value, relax.TupleGetItem) or not isinstance(value.tuple_value, relax.Var):
            return None
        split = rw.value(value.tuple_value)
        if call_op(split) != "relax.split":
            return None
        x = split.args[0]
        shape = shape_of(x)
        if shape is None or len(shape) != 4 or int(split.attrs.axis) % 4 != 3:
            return None
        sections = split.attrs.indices_or_sections
        if isinstance(sections, (int, tvm.tirx.IntImm)):
            step = shape[3] // int(sections)
            cuts = [step * i for i in range(1, int(sections))]
        else:
            cuts = [int(c) for c in sections]
        bounds = [0, *cuts, shape[3]]
        i = int(value.index)
        return relax.op.strided_slice(rw.new(x), axes=[3], begin=[bounds[i]], end=[bounds[i + 1]])

    return rewrite(graph, visit)


def row_scales_in_one_kernel(graph: Graph) -> Graph:
    """A per-token scale, ``where(amax > 0, amax / q, 1)`` with ``amax = max(abs(x), axis=-1, keepdims)`` (how an
    int8 transformer's linear layers quantize their input, ``edgeq.quantize.quantize_ops._quantize_rows``), as one
    TIR function: FuseOps fuses nothing after a max (a plain reduction; a mean, sum and division, takes what
    follows it), so the scale was a kernel of its own after each of them (four a layer). The same operations in the
    same order: bit for bit."""
    def scalar(expr, want=None):
        value = const_value(expr)
        if value is None or value.size != 1:
            return None
        value = float(value.reshape(-1)[0])
        return value if want is None or value == want else None

    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.where" or dtype_of(var) != "float32":
            return None
        cond, high, low = (rw.value(a) if isinstance(a, relax.Var) else None for a in value.args)
        if call_op(cond) != "relax.greater" or call_op(high) != "relax.divide" or scalar(value.args[2], 1.0) is None:
            return None
        amax = cond.args[0]
        q = scalar(high.args[1])
        if not (amax.same_as(high.args[0]) and scalar(cond.args[1], 0.0) is not None and q is not None
                and rw.uses(value.args[0]) == 1 and rw.uses(value.args[1]) == 1 and rw.uses(amax) == 2):
            return None
        reduce = rw.value(amax)
        if call_op(reduce) != "relax.max" or not bool(reduce.attrs.keepdims) or reduce.attrs.axis is None:
            return None
        absolute = rw.value(reduce.args[0])
        x = absolute.args[0] if call_op(absolute) == "relax.abs" else None
        shape = shape_of(x) if x is not None else None
        if shape is None or rw.uses(reduce.args[0]) != 1 or dtype_of(x) != "float32" \
                or [int(a) % len(shape) for a in reduce.attrs.axis] != [len(shape) - 1]:
            return None
        from edgeq.backends.cuda.layer_norm import ROW_SCALE_ATTR

        cast = rw.value(x)  # x = float32(fp16 x): read in fp16 (the cast still fuses into x's other readers)
        if call_op(cast) == "relax.astype" and dtype_of(cast.args[0]) == "float16":
            x = cast.args[0]
        return rw.bb.call_te(_row_scale, rw.new(x), q, primfunc_name_hint="row_scale",
                             primfunc_attrs={ROW_SCALE_ATTR: q})

    return rewrite(graph, visit)


def _row_scale(x, q: float):
    """TE: ``where(max|x| > 0, max|x| / q, 1)`` over the last axis of ``x`` (keepdims), in float32 (x float32 or
    fp16)."""
    from tvm import te, tirx

    shape = [int(d) for d in x.shape]
    r = te.reduce_axis((0, shape[-1]), name="r")
    amax = te.compute(shape[:-1] + [1], lambda *i: te.max(te.abs(x[(*i[:-1], r)].astype("float32")), axis=r),
                      name="amax")
    return te.compute(amax.shape, lambda *i: tirx.Select(amax(*i) > tirx.const(0.0, "float32"),
                                                         amax(*i) / tirx.const(q, "float32"),
                                                         tirx.const(1.0, "float32")), name="scale")


def pools_read_fp16(graph: Graph) -> Graph:
    """``mean(astype(x fp16, float32))`` (ToMixedPrecision keeps a reduction in fp32 and casts its input) as one
    TIR function that reads x in fp16 and accumulates in fp32: FuseOps keeps the cast apart (a mean is a sum
    and a division, "out-element-wise fusable": it fuses what follows it, not what it reads), which would be
    a kernel writing the whole fp32 tensor (an EfficientNet has one before each of its 16 squeeze-and-excitation
    pools). The fp16 cast after the mean still fuses into it."""
    def visit(rw: Rewriter, var, value):
        if call_op(value) != "relax.mean" or dtype_of(var) != "float32":
            return None
        cast = rw.value(value.args[0])
        if call_op(cast) != "relax.astype" or dtype_of(cast.args[0]) != "float16" or rw.uses(value.args[0]) != 1:
            return None
        shape = shape_of(cast.args[0])
        if shape is None or shape_of(var) is None:
            return None
        axes = sorted({int(a) % len(shape) for a in value.attrs.axis} if value.attrs.axis is not None
                      else set(range(len(shape))))
        keepdims = bool(value.attrs.keepdims)
        return rw.bb.call_te(_mean_of_fp16, rw.new(cast.args[0]), axes, keepdims, primfunc_name_hint="mean_fp16")

    return rewrite(graph, visit)


def _mean_of_fp16(x, axes, keepdims):
    """TE: the mean over ``axes`` of fp16 ``x`` in fp32 (each element cast as it is read)."""
    from tvm import te

    shape = [int(d) for d in x.shape]
    reduce = [te.reduce_axis((0, shape[a]), name=f"r{a}") for a in axes]
    count = int(np.prod([shape[a] for a in axes]))
    kept = [i for i in range(len(shape)) if i not in axes]
    out_shape = [1 if i in axes else shape[i] for i in range(len(shape))] if keepdims else [shape[i] for i in kept]

    def index(idx):
        out, it = [], iter(reduce)
        for i in range(len(shape)):
            if i in axes:
                out.append(next(it))
            else:
                out.append(idx[i] if keepdims else idx[kept.index(i)])
        return out

    total = te.compute(out_shape, lambda *idx: te.sum(x[tuple(index(idx))].astype("float32"), axis=reduce),
                       name="sum")
    return te.compute(out_shape, lambda *idx: total(*idx) / np.float32(count), name="mean")


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
    cutlass: dict | None = None  # --gpu-kernels cutlass: its version, the kernel per claimed layer, what it left
    choice: dict | None = None  # --gpu-kernels as asked, the ledger "auto" decided by (backend.kernel_choice)
    workspace_bytes: int = 0  # the storage Relax's static memory plan allocates on the device (RecordWorkspace)
    device_math: dict | None = None  # the float semantics the device code compiled with (toolchain.DeviceMath)

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
            **({"cutlass": self.cutlass} if self.cutlass is not None else {}),
            **({"choice": self.choice} if self.choice is not None else {}),
            # device memory beside the weights: what inspect shows and the package step checks against the device
            "memory": {"workspace_bytes": self.workspace_bytes},
            **({"device_math": self.device_math} if self.device_math is not None else {}),
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
            if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("cutlass_"):
                report.functions[gv.name_hint] = "cutlass"
            elif isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("depthwise_"):
                report.functions[gv.name_hint] = "edgeq depthwise"
            elif isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("layernorm_"):
                report.functions[gv.name_hint] = "edgeq layer norm"
            elif isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("rowquant_"):
                report.functions[gv.name_hint] = "edgeq per-token quantize"
            elif isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint.startswith("poolfc_"):
                report.functions[gv.name_hint] = "edgeq pool + classifier"
            if not isinstance(func, tvm.tirx.PrimFunc) or int((func.attrs or {}).get("tirx.is_scheduled", 0) or 0) == 1:
                continue
            if gv.name_hint.startswith(concat_in_place.PREFIX):  # SPPF's pools into its concatenation
                updates[gv] = concat_in_place.schedule(func)
                report.functions[gv.name_hint] = "edgeq concatenated pools"
                continue
            if gv.name_hint.startswith(squeeze_excite.PREFIX):
                scheduled = _edgeq_schedule(gv.name_hint, func, target, report, check_all,
                                            squeeze_excite.schedule, "edgeq squeeze-excite")
                if scheduled is not None:
                    updates[gv] = scheduled
                    continue
            if gv.name_hint.startswith(attention.PREFIX):
                scheduled = _edgeq_schedule(gv.name_hint, func, target, report, check_all,
                                            attention.schedule, "edgeq attention scores + softmax")
                if scheduled is not None:
                    updates[gv] = scheduled
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


def _edgeq_schedule(name: str, func, target, report: GpuKernels, check_all: bool, schedule, rule: str):
    """edgeq's ``schedule`` of an outlined function (a squeeze-and-excitation, attention's scores; with
    ``check_all``, checked by a build alone, as ``schedule_function`` checks); None where it does not take or build
    (dlight's rules then schedule it, as any other function)."""
    try:
        scheduled = schedule(func)
    except Exception as err:  # noqa: BLE001 - a function of another shape: dlight's
        report.fallbacks.append({"function": name, "rule": rule, "error": _first_line(err)})
        return None
    err = _builds(name, scheduled, target) if check_all else None
    if err is not None:
        report.fallbacks.append({"function": name, "rule": rule, "error": _first_line(err)})
        return None
    report.functions[name] = rule
    return scheduled


def CountKernels(report: GpuKernels):  # noqa: N802
    """Kernel launches per inference, in all and per PrimFunc: main's call_tir (and call_tir_inplace: a kernel
    writing its part of a concatenation) calls once reshapes have become views."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.CountKernels")
    def _pass(mod, _ctx):
        launches: dict[str, int] = {}

        def visit(expr):
            if call_op(expr) in ("relax.call_tir", "relax.call_tir_inplace"):
                name = expr.args[0].name_hint
                launches[name] = launches.get(name, 0) + 1

        relax.analysis.post_order_visit(mod["main"], visit)
        report.kernels_per_inference, report.launches = sum(launches.values()), launches
        return mod

    return _pass


def RecordWorkspace(report: GpuKernels):  # noqa: N802
    """The bytes of device storage the static memory plan allocates (``R.memory.alloc_storage`` of a constant size,
    in every function: main's and the CUDA graph's allocations), right after StaticPlanBlockMemory: the activations'
    memory an inference needs beside the weights."""

    @tvm.transform.module_pass(opt_level=0, name="edgeq.RecordWorkspace")
    def _pass(mod, _ctx):
        total = 0

        def visit(expr):
            nonlocal total
            if call_op(expr) == "relax.memory.alloc_storage" and isinstance(expr.args[0], relax.ShapeExpr):
                size = expr.args[0].values[0]
                if isinstance(size, tvm.tirx.IntImm):
                    total += int(size.value)

        for _, func in mod.functions_items():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func, visit)
        report.workspace_bytes = total
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
            # one function per captured region: main_cuda_graph_capture, main_cuda_graph_capture1, ...
            if isinstance(func, relax.Function) and re.fullmatch(r".*_cuda_graph_capture\d*", gv.name_hint):
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
        finalize = cuda.finalize_passes(target)  # StaticPlanBlockMemory first: then what it planned is recorded
        passes = (cuda.library_dispatch_passes(target) + legalize + dataflow_lower[:1]
                  + [relax.transform.DeadCodeElimination(["main"]), CountKernels(report)]  # drop the reshapes' kernels
                  + dataflow_lower[1:] + finalize[:1] + [RecordWorkspace(report)] + finalize[1:] + [RecordResult(report)])
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build(mod, target, report: GpuKernels, cutlass: tuple[int, int] | None = None, gate=None):
    """``relax.build`` on ``pipeline`` with CUDA graph capture on. When the whole build still fails (a
    schedule no rule check caught), it is retried once with every schedule built alone first. ``cutlass``:
    (SMs, shared memory per block) of the profile: the fp16 and int8 layers go to edgeq's kernels (CUTLASS's and
    its own) first (``edgeq.backends.cuda.cutlass``), the rest to dlight. ``gate`` (``--gpu-kernels auto``:
    ``ledger.Ledger.gate``): kinds -> None where a kernel of those kinds may be used, else why not; a layer it
    holds back stays on dlight and is listed in ``cutlass.held``."""
    import contextlib

    from edgeq.backends.cuda.ledger import kinds_of, source_sha256

    def allowed(*kinds) -> bool:
        return gate is None or gate(kinds) is None

    wrappers = contextlib.nullcontext()
    if cutlass is not None:
        from edgeq.backends.cuda import layer_norm, pool_classifier
        from edgeq.backends.cuda import cutlass as cl

        # one cast of an input read by several layers (ToMixedPrecision casts it once per reader; Q, K and V
        # read the same hidden states)
        mod = relax.transform.EliminateCommonSubexpr()(mod)
        # each squeeze-and-excitation after its pool: one function, one kernel (its two 1x1s are not CUTLASS's)
        excitations = squeeze_excite.find_squeeze_excitations(mod["main"]) if allowed("squeeze-excite") else []
        mod = squeeze_excite.outline(mod, excitations)
        claimed, left = cl.find_convs(mod["main"], *cutlass)
        held = []  # --gpu-kernels auto: the layers whose kernel's kinds no GPU has run as written today
        if gate is not None:
            why = [gate(kinds_of(c.kernel)) for c in claimed]
            held = [{"conv": c.kernel.name, "kinds": list(kinds_of(c.kernel)), "why": w} for c, w in zip(claimed, why) if w]
            claimed = [c for c, w in zip(claimed, why) if w is None]
        # a batch-1 classifier after a global pool: the pool and the classifier, one kernel (instead of its CUTLASS
        # kernel and a pool kernel)
        pools = pool_classifier.find_pool_classifiers(mod["main"], claimed, cutlass[0]) if allowed("pool-classifier") else []
        claimed = [c for c in claimed if not any(c is p.fc for p in pools)]
        # attention's Q K^T with its softmax: one kernel of edgeq's (instead of the GEMM's and the softmax's)
        scores = attention.find_attention_scores(mod["main"], claimed) if allowed("attention-scores") else []
        claimed = [c for c in claimed if not any(c is s.gemm for s in scores)]
        mod = squeeze_excite.outline(mod, scores)
        # a detector's output written by its head's last convolutions (no transpose or concatenation kernel), and
        # the concatenations whose parts the kernels write in place (no concatenation kernel)
        heads = concat_in_place.find_head_outputs(mod["main"], claimed) if allowed("detector-output") else []
        in_heads = {var for h in heads for var, _, _ in h.parts}
        placements = (concat_in_place.find_placements(mod["main"], [c for c in claimed if c.output not in in_heads])
                      if allowed("in-place", "concat-in-place") else [])
        if not allowed("upsampled-output"):
            placements = [pl for pl in placements if not pl.ups]
        claimed = concat_in_place.place_heads(concat_in_place.place(mod["main"], claimed, placements), heads)
        kernels = [c.kernel for c in claimed]
        sizes = cl.smem_sizes(kernels, target.attrs["arch"]) if kernels else {}
        mod = cl.claim_convs(mod, claimed, sizes, placements, heads)
        # each with its fp16 cast or int8 quantize: one kernel
        norms = layer_norm.find_layer_norms(mod) if allowed("layer-norm") else []
        mod = layer_norm.claim_layer_norms(mod, norms)
        # the other per-token quantizes: scale and int8, one kernel
        quantizes = layer_norm.find_row_quantizes(mod) if allowed("row-quantize") else []
        mod = layer_norm.claim_row_quantizes(mod, quantizes)
        mod = pool_classifier.claim_pool_classifiers(mod, pools)
        wrappers = cl.wrappers_in_module(kernels)
        records = {k.name: cl.kernel_record(k, sizes[k.name]) for k in kernels}
        kinds = {kind for k in kernels for kind in kinds_of(k)} | {kind for kind, used in (
            ("squeeze-excite", excitations), ("pool-classifier", pools), ("attention-scores", scores),
            ("detector-output", heads), ("concat-in-place", placements), ("upsampled-output", [p for p in placements if p.ups]),
            ("layer-norm", norms), ("row-quantize", quantizes)) if used}
        report.cutlass = {"version": cl.cutlass_version(),
                          "kernels": [records[k.name] for k in kernels if not isinstance(k, cl.DepthwiseKernel)],
                          "depthwise": [records[k.name] for k in kernels if isinstance(k, cl.DepthwiseKernel)],
                          "layer_norms": [layer_norm.kernel_record(c.kernel) for c in norms],
                          "row_quantizes": [layer_norm.row_quantize_record(c.kernel) for c in quantizes],
                          "pool_classifiers": [pool_classifier.kernel_record(p.kernel) for p in pools],
                          "squeeze_excitations": [se.record() for se in excitations],
                          "concatenations_in_place": [pl.record() for pl in placements],
                          "detector_outputs": [h.record() for h in heads],
                          "attention_scores": [a.record() for a in scores],
                          "left": left,
                          # the kinds of edgeq's kernels this module runs, each with the key of its source
                          # (ledger.py): what a GPU run of this bundle verifies
                          "kinds": {kind: source_sha256(kind) for kind in sorted(kinds)},
                          **({"held": held} if gate is not None else {})}
    with wrappers:
        return _build(mod, target, report)


def _build(mod, target, report: GpuKernels):
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
        if field.name not in ("cutlass", "choice", "device_math"):  # (what was recorded before the pipeline)
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
    return views_collapsed(pools_read_fp16(_lift_constants(Graph(mixed, {}))))


def scalar_weights_as_constants(graph: Graph) -> Graph:
    """The 0-d weight parameters (an int8 graph keeps a GELU's 1/sqrt(2), 0.5 and 1 so) bound as constants, as
    ``to_fp16`` leaves them: the kernels that take the operators reading them (``cutlass.TokenLinearKernel``'s
    GELU) compile their values in."""
    scalars = {k: v for k, v in graph.weights.items() if np.ndim(v) == 0}
    if not scalars:
        return graph
    bound = relax.transform.BindParams("main", {k: tvm.runtime.tensor(np.asarray(v)) for k, v in scalars.items()})
    return Graph(bound(graph.mod), {k: v for k, v in graph.weights.items() if k not in scalars})

def _clips_as_max_min(graph: Graph) -> Graph:
    """Clips as ``maximum``/``minimum`` of a 0-d constant, which ToMixedPrecision converts (it fails on a
    call_tir, and on ``relax.clip``'s PrimValue bounds: "Expected TensorType, but got T.int64"). ONNX Clip with
    bounds that are weights imports as TIR calls ``maximum``/``minimum`` (the NaN guard around the bound folded
    by FoldConstant once the weights are constants); HardSwish and ReLU6 as ``relax.clip``."""

    def visit(rw: Rewriter, var, value):
        op = call_op(value)
        if op == "relax.clip" and all(isinstance(a, _IMMEDIATES) for a in value.args[1:]):
            dtype = dtype_of(value.args[0]) or "float32"
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
        args = [rw.param(fresh_name(rw, f"{var.name}_w{i}"), _array(a)) if _liftable(a) else rw.new(a)
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
