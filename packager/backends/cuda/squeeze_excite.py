"""A squeeze-and-excitation gate and its product as one kernel (#42).

EfficientNet's (and MobileNetV3's, RegNetY's) squeeze-and-excitation: ``x * sigmoid(excite(act(squeeze(mean(x)))))``
(or a hard sigmoid), where squeeze and excite are 1x1 convolutions on one pixel ([N, 1, 1, C] -> [N, 1, 1, C / 24]
-> [N, 1, 1, C]). On the CUDA path that was four kernels for two layers: the pool, the squeeze (dlight where its 4
to 48 output channels are no multiple of 8), the excitation (CUTLASS, M = 1) and the product (with, in int8, the
next layer's quantize). Two are left: the pool (TVM's reduction rule, with its cast or quantize), and one kernel for
the rest. Each of its blocks computes the whole gate from the pooled vector into shared memory (``schedule``), then
multiplies its part of x. The gate is computed again by every block: C x C/24 x 2 multiply-adds (110 thousand for
EfficientNet-B0's widest, 1152 channels), so a wide gate gets few blocks, each thread more of the product
(``per_thread``), against a kernel launch and the gate's round trip through memory saved.

The computation is the graph's own: the bindings from the pool's output to the product's (and its quantize's) are
outlined into a Relax function marked ``Primitive``, which TVM's LegalizeOps and FuseTIR make one PrimFunc, so the
host build (the reference check, the tests' twins) runs exactly what the graph ran. ``schedule`` gives that
PrimFunc its GPU schedule (``pipeline.ScheduleKernels`` calls it for functions named ``se_*``).
"""

from __future__ import annotations

import dataclasses
import math

from edgeq.backends.cuda.cutlass.match import is_constant, main_index, only_reader_of, tensor_type

PREFIX = "se_"
THREADS = 256
ELEMENTWISE = ("relax.astype", "relax.divide", "relax.round", "relax.maximum", "relax.minimum", "relax.clip")


@dataclasses.dataclass(frozen=True)
class SqueezeExcite:
    """One squeeze-and-excitation the kernel takes: its name, x's shape, and the outlined bindings."""

    name: str
    shape: tuple[int, int, int, int]
    bindings: tuple  # from the pool's output (exclusive) to the product's quantize (inclusive), in order
    inputs: tuple  # the outlined function's parameters: the pooled vector, x, the weights
    output: object  # the last binding's variable
    dtypes: tuple[str, str] = ("float16", "float16")  # x's and the output's
    gate_macs: int = 0  # the gate's multiply-adds (its convolutions', once)

    @property
    def function(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def blocks(self) -> int:
        """The product's (``schedule``): ``per_thread`` elements a thread."""
        n, h, w, c = self.shape
        return -(-n * h * w * c // (THREADS * per_thread(self.gate_macs)))

    def record(self) -> dict:
        return {"function": self.function, "template": "edgeq squeeze-and-excitation (TIR: the gate from the pooled "
                "vector in each block's shared memory, then the product)", "x": list(self.shape),
                "input": self.dtypes[0], "output": self.dtypes[1], "threads": THREADS, "grid": [self.blocks, 1],
                "gate_macs": self.gate_macs, "flops": 2 * self.gate_macs}


def find_squeeze_excitations(main) -> list[SqueezeExcite]:
    """The squeeze-and-excitation blocks of ``main``: ``multiply(x [N, H, W, C], g [N, 1, 1, C])`` where g is computed
    from a global pool of x (``mean(x, [1, 2])`` or ``pipeline.pools_read_fp16``'s function, with its cast or
    quantize) through one-pixel operators only, among them at least one convolution, each read by nothing else."""
    from edgeq.backends.cuda.pool_classifier import pooled_input
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, params = main_index(main)
    position = {b.var: i for i, b in enumerate(bindings)}

    only_reader = only_reader_of(readers)

    found = []
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.multiply":
            continue
        shapes = [shape_of(a) for a in value.args]
        if any(s is None or len(s) != 4 for s in shapes):
            continue
        big = next((i for i in (0, 1) if shapes[i][1] * shapes[i][2] > 1), None)
        if big is None or list(shapes[1 - big]) != [shapes[big][0], 1, 1, shapes[big][3]]:
            continue
        x, gate = value.args[big], value.args[1 - big]
        # the gate's cone: one-pixel bindings back to the pool of x
        cone, stack, pool, ok = set(), [gate], None, True
        while stack and ok:
            var = stack.pop()
            if var in cone or var in params or var not in value_of:
                continue
            src = pooled_input(value_of[var])
            if src is not None:
                ok = pool is None and src.same_as(x)
                pool = var
                continue
            shape = shape_of(var)
            if shape is not None and len(shape) == 0:  # a scalar (fp16's cast of a constant: hardsigmoid's 1/6), an
                continue  # input of the function
            if shape is None or len(shape) != 4 or shape[1] * shape[2] != 1:
                ok = False
                break
            cone.add(var)
            for arg in _var_args(value_of[var]):
                stack.append(arg)
        if not ok or pool is None:
            continue
        # the pool's own cast or quantize stays with it (FuseOps fuses it into the pool's kernel)
        head = pool
        while True:
            nxt = only_reader(head)
            if nxt is None or nxt not in cone or call_op(value_of[nxt]) not in ELEMENTWISE:
                break
            cone.discard(nxt)
            head = nxt
        if not any(call_op(value_of[v]) == "relax.nn.conv2d" for v in cone):
            continue
        # the product's quantize (int8: the next layer's input), read by nothing else in between
        tail, end = [], b.var
        while True:
            nxt = only_reader(end)
            if nxt is None or call_op(value_of[nxt]) not in ELEMENTWISE or shape_of(nxt) != shape_of(end):
                break
            tail.append(nxt)
            end = nxt
        group = cone | {b.var, *tail}
        if any(r is None or r not in group for v in cone for r in readers.get(v, [])):
            continue  # a gate value read elsewhere
        ordered, inputs = outline_inputs(group, value_of, position)
        if any(not (a.same_as(head) or a.same_as(x) or a in params or is_constant(a) or shape_of(a) == [])
               for a in inputs):
            continue
        macs = sum(math.prod(int(d) for d in shape_of(value_of[v].args[1])) for v in cone
                   if call_op(value_of[v]) == "relax.nn.conv2d")
        found.append(SqueezeExcite(f"e{len(found)}", tuple(int(d) for d in shape_of(x)),
                                   tuple(bindings[position[v]] for v in ordered),
                                   tuple(inputs), end, (dtype_of(x), dtype_of(end)), macs))
    return found


def outline_inputs(group: set, value_of: dict, position: dict) -> tuple[list, list]:
    """The bindings of ``group`` in main's order and what they read from outside it (variables and tensor
    constants, each once): the bindings and the parameters of the function they are outlined into (``outline``)."""
    ordered = sorted(group, key=position.get)
    inputs = []
    for v in ordered:
        for arg in _var_args(value_of[v]) + _tensor_constants(value_of[v]):
            if arg not in group and not any(arg.same_as(i) for i in inputs):
                inputs.append(arg)
    return ordered, inputs


def _var_args(value) -> list:
    """The Relax variables among a call's arguments (tuples looked into)."""
    from edgeq.tvm_env import relax

    out = []
    for arg in getattr(value, "args", []):
        for a in (arg.fields if isinstance(arg, relax.Tuple) else [arg]):
            if isinstance(a, relax.Var):
                out.append(a)
    return out


def _tensor_constants(value) -> list:
    """The tensor constants (one dimension or more) among a call's arguments: a primitive function takes them as
    parameters (as FuseOps' functions do)."""
    return [a for a in getattr(value, "args", []) if is_constant(a)]


def outline(mod, found: list[SqueezeExcite]):
    """``mod`` with each squeeze-and-excitation's bindings one call of a Relax function of its own (``Primitive``:
    LegalizeOps and FuseTIR make it one PrimFunc named ``se_<name>``)."""
    from edgeq.backends.cuda.cutlass import rebuild_main

    functions = {se.function: _function(se) for se in found}
    by_output = {se.output: se for se in found}
    dropped = {b.var for se in found for b in se.bindings}

    def rebind(b, gvars):
        from edgeq.tvm_env import relax

        se = by_output.get(b.var)
        if se is not None:
            return [relax.VarBinding(b.var, relax.Call(gvars[se.function], list(se.inputs)))]
        return [] if b.var in dropped else [b]

    from edgeq.tvm_env import relax

    return relax.transform.Normalize()(rebuild_main(mod, functions, rebind))


def _function(se: SqueezeExcite):
    """The bindings as a Relax function of the inputs (fresh variables, the same calls)."""
    from edgeq.tvm_env import relax

    params = [relax.Var(v.name if isinstance(v, relax.Var) else f"c{i}", tensor_type(v)) for i, v in enumerate(se.inputs)]
    mapping = dict(zip(se.inputs, params))

    def arg(a):
        if isinstance(a, relax.Tuple):
            return relax.Tuple([arg(f) for f in a.fields])
        if is_constant(a):
            return next(p for i, p in zip(se.inputs, params) if i.same_as(a))
        return mapping.get(a, a) if isinstance(a, relax.Var) else a

    bb = relax.BlockBuilder()
    with bb.function(se.function, params, {"Primitive": True}, pure=True):
        with bb.dataflow():
            for b in se.bindings:
                v = b.value
                call = relax.Call(v.op, [arg(a) for a in v.args], v.attrs, v.ty_args)
                out = bb.emit_output(call, b.var.name) if b.var.same_as(se.output) else bb.emit(call, b.var.name)
                mapping[b.var] = out
        bb.emit_func_output(out)
    mod = bb.get()
    return mod[se.function]


def per_thread(gate_macs: int) -> int:
    """Elements of the product each thread computes: a power of two that grows with the gate's multiply-adds (each
    block computes the gate), so a wide gate (EfficientNet-B0's last stages: 1152 x 48) is computed by few blocks."""
    n = 1
    while n < 64 and n * WORK_PER_BLOCK < gate_macs:
        n *= 2
    return n


WORK_PER_BLOCK = 4096  # gate multiply-adds a block may repeat per element a thread computes
WARPS = THREADS // 32
WIDE = 128  # a convolution reducing over this many channels or more: a warp an output channel


def schedule(func):
    """The GPU schedule of an outlined squeeze-and-excitation's PrimFunc (after FuseTIR): the product (and what
    follows it) ``per_thread`` elements a thread, ``THREADS`` a block; before it, in each block, the one-pixel
    stages: each convolution's sums (a squeeze over ``WIDE`` channels or more: a warp an output channel, the lanes
    across the input channels, a warp-shuffle reduction; else a thread an output channel) and the value the next
    stage reads (the excitation's input, the gate) in shared memory; every other one-pixel operator is inlined into
    the stage that reads it."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": func}))
    sch.work_on("main")
    blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    out = blocks[-1]

    def iters(block, kind):  # extents of its spatial (0) or reduction (2) iterators
        return [int(iv.dom.extent) for iv in sch.get(block).iter_vars if int(iv.iter_type) == kind]

    def one_pixel(block):  # spatial [N, 1, 1, C]
        shape = iters(block, 0)
        return len(shape) == 4 and shape[1] * shape[2] == 1

    stages, keep = [], {out}
    for i, block in enumerate(blocks):
        if iters(block, 2):
            nxt = next((j for j, b in enumerate(blocks[i + 1:], i + 1) if iters(b, 2) or not one_pixel(b)),
                       len(blocks))
            last = [b for b in blocks[i + 1:nxt] if one_pixel(b)]
            if not one_pixel(block) or not last:
                raise ValueError("a reduction that is no one-pixel convolution with a value after it")
            stages.append((block, last[-1]))
            keep.update((block, last[-1]))
    if not stages:
        raise ValueError("no convolution in the gate")
    macs = sum(math.prod(iters(r, 0)) * math.prod(iters(r, 2)) for r, _ in stages)
    for block in reversed(blocks):
        if block not in keep:
            sch.compute_inline(block)
    elements = math.prod(iters(out, 0))
    each = per_thread(macs)
    bx, _, ty, tx = sch.split(sch.fuse(*sch.get_loops(out)), [-(-elements // (THREADS * each)), each, WARPS, 32])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    for red, value in reversed(stages):
        sch.compute_at(value, bx)
        sch.set_scope(value, 0, "shared")
        _, vy, vx = sch.split(sch.fuse(*sch.get_loops(value)[1:]), [None, WARPS, 32])
        sch.bind(vy, "threadIdx.y")
        sch.bind(vx, "threadIdx.x")
        if math.prod(iters(red, 2)) >= WIDE:  # a warp an output channel
            sch.compute_at(red, bx, preserve_unit_loops=True)
            sch.set_scope(red, 0, "shared")
            loops = sch.get_loops(red)[1:]
            spatial = len(iters(red, 0))
            _, ry = sch.split(sch.fuse(*loops[:spatial]), [None, WARPS])
            _, rx = sch.split(sch.fuse(*loops[spatial:]), [None, 32])
            sch.bind(ry, "threadIdx.y")
            sch.bind(rx, "threadIdx.x")
        else:  # a thread an output channel
            sch.compute_at(red, vx)
            sch.set_scope(red, 0, "local")
    return sch.mod["main"].with_attrs({"tirx.is_scheduled": True})
