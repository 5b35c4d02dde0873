"""The TIR functions TVM launches: one call of a CUTLASS kernel's device wrapper in its grid and block
(``prim_func``), and the depthwise kernel's schedule of its twin (``depthwise_prim_func``).
"""

from __future__ import annotations

from edgeq.backends.cuda.cutlass.kernels import (ConvKernel, DEPTHWISE_LANES, DEPTHWISE_THREADS, DepthwiseKernel,
    kernel_operands)
from edgeq.backends.cuda.cutlass.twins import twin_prim_func


def prim_func(kernel: ConvKernel, smem_bytes: int, shapes: dict | None = None):
    """The scheduled TIR function TVM launches for ``kernel``: its grid and block, ``smem_bytes`` of dynamic shared
    memory, and one call of the device wrapper with the operands of ``kernel_operands`` (TVMScript, written out
    for this kernel's operands and parsed)."""
    if isinstance(kernel, DepthwiseKernel):
        return depthwise_prim_func(kernel, shapes)
    from tvm.script import tirx as T

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    (gm, gn, *gz), threads = kernel.grid, kernel.threads
    smem_bytes = -(-smem_bytes // 16) * 16
    ops = kernel_operands(kernel, shapes)
    buf = {name: f"B_{name}" for name, _, _ in ops}

    def region(name, shape):
        return f"{buf[name]}[{', '.join(f'0:{d}' for d in shape)}]"

    outputs = [o for o in ops if o[0] in ("y", "y_up")]
    inputs = [o for o in ops if o not in outputs]
    text = "\n".join([
        "@T.prim_func(s_tir=True)",
        f"def func({', '.join(f'{name}: T.handle' for name, _, _ in ops)}):",
        # (a kernel writing a slice of a concatenation may read another slice of it: its operands may alias)
        f'    T.func_attr({{"tirx.noalias": {not (kernel.out_view or kernel.up_view)}}})' if isinstance(kernel, ConvKernel)
        else '    T.func_attr({"tirx.noalias": True})',
        *(f'    {buf[name]} = T.match_buffer({name}, {tuple(shape)}, "{dtype}")' for name, shape, dtype in ops),
        '    with T.sblock("root"):',
        f'        for bx in T.thread_binding({gm}, thread="blockIdx.x"):',
        f'            for by in T.thread_binding({gn}, thread="blockIdx.y"):',
        *([f'              for bz in T.thread_binding({gz[0]}, thread="blockIdx.z"):'] if gz else []),
        f'                for tx in T.thread_binding({threads}, thread="threadIdx.x"):',
        '                    with T.sblock("cutlass"):',
        f'                        T.reads({", ".join(region(n, s) for n, s, _ in inputs)})',
        f'                        T.writes({", ".join(region(n, s) for n, s, _ in outputs)})',
        # inside the kernel: the block's dynamic shared memory (extern __shared__), not a buffer passed in
        f'                        smem = T.alloc_buffer(({smem_bytes},), "uint8", scope="shared.dyn")',
        f'                        T.evaluate(T.call_extern("void", "edgeq_cutlass_{kernel.name}", '
        f'{", ".join(buf[n] + ".data" for n, _, _ in ops)}, smem.data))',
    ])
    func = tvm.script.from_source(text, extra_vars={"T": T})
    # op_pattern 8 (opaque): never fused
    return func.with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def depthwise_prim_func(kernel: DepthwiseKernel, shapes: dict | None = None):
    """A depthwise kernel's TIR: ``twin_prim_func``'s computation (the host twin is this function before its
    schedule) scheduled for the GPU: output pixels x channel groups of DEPTHWISE_LANES over the threads, per thread
    the accumulators, the padded input's and the weights' lanes and the epilogue's outputs in registers (loads and
    the store vectorized), the R x S taps unrolled."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": twin_prim_func(kernel, shapes)}))
    sch.cache_write(sch.get_sblock("y"), 0, "local")
    epilogue, store, acc, padded = (sch.get_sblock(n) for n in ("y", "y_local", "acc", "xp"))
    n, p, q, k = sch.get_loops(store)
    k_outer, lanes = sch.split(k, [None, DEPTHWISE_LANES])
    bx, tx = sch.split(sch.fuse(n, p, q, k_outer), [None, DEPTHWISE_THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lanes)
    sch.compute_at(epilogue, tx)
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    channel, ry, rx = sch.get_loops(acc)[-3:]
    sch.reorder(ry, rx, channel)
    # (no decompose_reduction: for some shapes TVM's simplified thread bindings are not quasi-affine, which it
    # refuses; the init stays a `ry == 0 and rx == 0` branch that unrolling folds away)
    weights = sch.cache_read(acc, "w", "local")
    sch.compute_at(padded, rx)
    sch.set_scope(padded, 0, "local")
    # int8: 4-byte loads (TVM 0.27 writes an 8-lane int8 zero as make_int2 of 8 chars, which NVRTC refuses)
    outer, inner = sch.split(sch.get_loops(padded)[-1], [None, 4 if kernel.precision == "int8" else DEPTHWISE_LANES])
    sch.vectorize(inner)
    sch.unroll(outer)
    sch.compute_at(weights, rx)
    sch.vectorize(sch.get_loops(weights)[-1])
    for loop in (ry, rx, channel, sch.get_loops(epilogue)[-1]):
        sch.unroll(loop)
    return sch.mod["main"].with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})
