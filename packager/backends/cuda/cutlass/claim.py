"""Putting the kernels' calls in the place of the chains they took (``claim_convs``, ``claim_calls``), and
``main`` rebuilt from new bindings (``rebuild_main``).
"""

from __future__ import annotations

from collections.abc import Sequence

from edgeq.backends.cuda.cutlass.match import Claimed, tensor_type
from edgeq.backends.cuda.cutlass.tir import prim_func


def claim_convs(mod, claimed: Sequence[Claimed], sizes: dict[str, int], placements: Sequence = (), heads: Sequence = ()):
    """``mod`` with each claimed chain replaced by one ``call_tir`` of its kernel's PrimFunc (added to the module):
    the chain's last binding becomes the call, its other bindings go. ``placements``
    (``concat_in_place.find_placements``, the claims ``concat_in_place.place``'s): a placed part's call binds the
    concatenation (the first part's allocates it, a later part's writes it in place) and the part's variable becomes
    a slice of it; the concatenation's binding becomes the tensor after its last part. ``heads``
    (``concat_in_place.find_head_outputs``): each part's call binds the detector's output after its write, the
    bindings between go, and the output's becomes the last version."""
    from edgeq.tvm_env import relax

    functions = {c.kernel.function: prim_func(c.kernel, sizes[c.kernel.name], c.shapes) for c in claimed}
    functions.update({pl.pools.function: pl.pool_prim_func() for pl in placements if pl.pools})
    dropped = {var for c in claimed for var in c.chain} | {v for pl in placements if pl.pools for v in pl.pools.pooled}
    dropped |= {var for pl in placements for var in pl.ups}  # an upsampling its convolution writes
    dropped |= {var for h in heads for var in h.dropped}
    head_part = {var: (h, i) for h in heads for i, (var, _, _) in enumerate(h.parts)}
    head_out = {h.out: h for h in heads}
    by_output = {c.output: c for c in claimed}
    version = {var: (pl, i) for pl in placements for i, (var, _) in enumerate(pl.parts)}
    up_version = {src: version[var] for pl in placements for var, src in pl.ups.items()}
    concats = {pl.concat: pl for pl in placements}

    def rebind(b, gvars):
        if b.var in head_out:  # the detector's output: as its last part's kernel left it
            return [relax.VarBinding(b.var, head_out[b.var].versions[-1])]
        if b.var in dropped:
            return []
        if b.var in concats:  # the tensor after its last part (SPPF: after its pool kernel, in place)
            pl = concats[b.var]
            if pl.pools is None:
                return [relax.VarBinding(b.var, pl.versions[-1])]
            return [relax.VarBinding(b.var, relax.call_tir_inplace(
                gvars[pl.pools.function], relax.Tuple([pl.versions[-1]]), [0], tensor_type(b.var)))]
        c = by_output.get(b.var)
        if c is None:
            return [b]
        gv, operands = gvars[c.kernel.function], relax.Tuple(list(c.operands()))
        if b.var in head_part:  # its part of the detector's output (the first part's call allocates it)
            h, i = head_part[b.var]
            ty = tensor_type(h.out)
            call = (relax.call_tir_inplace(gv, relax.Tuple([*operands.fields, c.y_in]), [len(operands.fields)], ty)
                    if i else relax.call_tir(gv, operands, ty))
            return [relax.VarBinding(h.versions[i], call)]
        if b.var not in version and b.var not in up_version:
            return [relax.VarBinding(b.var, relax.call_tir(gv, operands, tensor_type(b.var)))]
        pl, i = version.get(b.var, (None, None))
        ty, tensor = (tensor_type(pl.concat), pl.versions[i]) if pl is not None else (tensor_type(b.var), b.var)
        placed = []
        if pl is not None:
            first = c.kernel.out_view[0]
            placed = [relax.VarBinding(b.var, relax.op.strided_slice(
                tensor, axes=[3], begin=[first], end=[first + c.kernel.problem.k]))]
        if b.var in up_version:  # two outputs: y (maybe in place) and the upsampled copy's tensor (in place)
            up_pl, j = up_version[b.var]
            fields = [*operands.fields, c.up_in] + ([c.y_in] if c.kernel.out_in_place else [])
            n = len(fields)
            indices = [n - 1, n - 2] if c.kernel.out_in_place else [-1, n - 1]
            both_ty = relax.TupleType([ty, tensor_type(up_pl.concat)])
            both = relax.DataflowVar(f"{b.var.name}_and_upsampled", both_ty)
            call = relax.call_tir_inplace(gv, relax.Tuple(fields), indices, [ty, tensor_type(up_pl.concat)])
            return [relax.VarBinding(both, call), relax.VarBinding(tensor, relax.TupleGetItem(both, 0)),
                    relax.VarBinding(up_pl.versions[j], relax.TupleGetItem(both, 1)), *placed]
        if c.kernel.out_in_place:
            operands = relax.Tuple([*operands.fields, c.y_in])
            call = relax.call_tir_inplace(gv, operands, [len(operands.fields) - 1], ty)
        else:
            call = relax.call_tir(gv, operands, ty)
        return [relax.VarBinding(tensor, call), *placed]

    return rebuild_main(mod, functions, rebind)


def claim_calls(mod, functions: dict, calls: dict, dropped: set):
    """``mod`` with ``functions`` ({name: PrimFunc}) added, each variable of ``calls`` ({var: (function name, Relax
    operands)}) bound to a ``call_tir`` of its function instead, and the bindings of ``dropped`` gone."""
    from edgeq.tvm_env import relax

    def rebind(b, gvars):
        if b.var in dropped:
            return []
        if b.var not in calls:
            return [b]
        name, operands = calls[b.var]
        return [relax.VarBinding(b.var, relax.call_tir(gvars[name], relax.Tuple(list(operands)), tensor_type(b.var)))]

    return rebuild_main(mod, functions, rebind)


def rebuild_main(mod, functions: dict, rebind):
    """``mod`` with ``functions`` ({name: PrimFunc}) added and each binding of main replaced by the bindings
    ``rebind(binding, {name: GlobalVar})`` returns (none: the binding goes)."""
    from edgeq.tvm_env import relax, tvm

    main = mod["main"]
    bb = relax.BlockBuilder(mod)
    gvars = {name: bb.add_func(func, name) for name, func in functions.items()}
    blocks = [type(block)([new for b in block.bindings for new in rebind(b, gvars)]) for block in main.body.blocks]
    out = tvm.IRModule(dict(bb.get().functions))
    out["main"] = relax.Function(main.params, relax.SeqExpr(blocks, main.body.body), main.ret_ty, main.is_pure,
                                 main.attrs)
    return out
