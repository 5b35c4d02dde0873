"""A decoder's steps imported into one Relax module: ``prefill_<S>`` per prompt bucket and ``decode_<C>`` per cache
capacity, each taking its inputs and then the same weight parameters, so one weights file serves every step; and
``grow_<C>_<D>``, the cache of one capacity copied into the next one's.

Capacities grow by doubling up to the context, so a decode step's attention, and the cache it reads and writes,
cost what the tokens so far need, not the whole context (SmolLM2-135M fp32 on 2 cores, before: 21.8 ms a token
with a 64-slot cache, 53.4 ms with 512). A prefill of bucket ``S`` leaves a cache of the smallest capacity above ``S``.

A weight is an initializer of the exported model; constants the specialization made (folded shapes, the
cache's slot index) are bound into the step that made them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from edgeq import fold
from edgeq.errors import ModelError
from edgeq.llm import decoder
from edgeq.tvm_env import import_tvm


@dataclasses.dataclass(frozen=True)
class Step:
    function: str  # the module's function
    kind: str  # "prefill", "decode" or "grow"
    prompt: int  # prefill's prompt bucket (1 for decode; grow: the capacity it grows from)
    capacity: int  # cache slots of the cache it returns
    inputs: tuple  # (name, shape, dtype) of its inputs, in order
    outputs: tuple  # (name, shape, dtype): logits, then the cache


@dataclasses.dataclass(frozen=True)
class Steps:
    """The imported steps: the module, the weights in parameter order, and what each step takes and gives."""

    mod: object
    weights: dict  # name -> numpy array, in the order every function takes them
    steps: tuple  # Step
    layout: decoder.Layout
    context: int
    # pre-quantized 4-bit weights (MatMulNBits): name -> (codes [K, N], scales, minimums), for an int4 build
    codes: dict = dataclasses.field(default_factory=dict)

    @property
    def buckets(self) -> list[int]:
        return sorted(s.prompt for s in self.steps if s.kind == "prefill")


def default_buckets(context: int) -> list[int]:
    """Prompt buckets: powers of 2 from 16 up to the context (a prompt pads to the next one, so at most half a
    prefill is padding: a 30-token prompt in a bucket of 64 took SmolLM2's first token 333 ms, in 32 ...)."""
    buckets, size = [], 16
    while size < context:
        buckets.append(size)
        size *= 2
    return buckets + [context - 1] if not buckets or buckets[-1] < context - 1 else buckets


def default_capacities(context: int) -> list[int]:
    """Cache capacities: 64, 128, ... doubling below the context, then the context."""
    capacities, size = [], 64
    while size < context:
        capacities.append(size)
        size *= 2
    return capacities + [context]


def import_steps(model: onnx.ModelProto, context: int, buckets: list[int] | None = None,
                 name: str = "model", capacities: list[int] | None = None) -> Steps:
    """Specialize, import and merge the decoder's steps (see the module's text)."""
    tvm = import_tvm()
    from tvm import relax

    from edgeq.load import identifier_names

    layout = decoder.read_layout(model, name)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    codes = decoder.expand_matmul_nbits(model, name)
    identifier_names(model)
    buckets = sorted(set(buckets or default_buckets(context)))
    if not buckets or buckets[0] < 1 or buckets[-1] >= context:
        raise ModelError(f"prompt buckets {buckets} must lie in 1..{context - 1} (the context is {context})")
    originals = {t.name.replace(".", "_") for t in model.graph.initializer}  # as TVM's importer names them
    large = {t.name.replace(".", "_"): t for t in model.graph.initializer
             if int(np.prod(t.dims)) > fold.MAX_FOLD_ELEMENTS}
    capacities = sorted(set(capacities or default_capacities(context)) | {context})
    if capacities[0] < 2:
        raise ModelError(f"cache capacities {capacities} must be 2 or more")

    def holding(bucket: int) -> int:
        return next(c for c in capacities if c > bucket)

    plan = [("prefill", b, f"prefill_{b}", holding(b)) for b in buckets] \
        + [("decode", 1, f"decode_{c}", c) for c in capacities]
    functions, weights, steps = {}, {}, []
    for kind, prompt, function, capacity in plan:
        # the large weights come out of the step as inputs after its own, and get their values here by name
        onnx_step = decoder.specialize(model, layout, kind, capacity, prompt, name, detach=True)
        own = [i for i in onnx_step.graph.input if i.name.replace(".", "_") not in large]
        mod, params = _import(onnx_step, name)
        func = mod["main"]
        count = len(own)
        bound = {}
        for var in func.params[count:int(func.attrs["num_input"])]:
            if var.name not in weights:
                weights[var.name] = numpy_helper.to_array(large[var.name.replace(".", "_")])
        for var, value in zip(func.params[int(func.attrs["num_input"]):], params):
            if var.name.replace(".", "_") in originals:
                array = value.numpy()
                if var.name in weights and not np.array_equal(weights[var.name], array):
                    raise ModelError(f"{name}: weight '{var.name}' imports differently in two steps")
                weights.setdefault(var.name, array)
            else:
                bound[var.name] = value
        mod["main"] = func.with_attr("num_input", count)
        if bound:
            mod = relax.transform.BindParams("main", bound)(mod)
        functions[function] = mod["main"]
        steps.append(Step(function=function, kind=kind, prompt=prompt, capacity=capacity,
                          inputs=tuple((i.name, _shape(i), _np_dtype(i)) for i in own),
                          outputs=tuple((o.name, _shape(o), _np_dtype(o)) for o in onnx_step.graph.output)))
    order = list(weights)
    merged = tvm.IRModule()
    for function, func in functions.items():
        merged[function] = _with_weights(func, order, weights, function)
    for small, large in zip(capacities, capacities[1:]):
        function = f"grow_{small}_{large}"
        merged[function] = _grow(layout, small, large, function)
        cache = tuple((f"past_key_values.{i}.{kv}", (1, layout.kv_heads, small, layout.head_dim), layout.cache_dtype)
                      for i in range(layout.layers) for kv in ("key", "value"))
        steps.append(Step(function=function, kind="grow", prompt=small, capacity=large, inputs=cache,
                          outputs=tuple((n.replace("past_key_values", "cache"), (1, layout.kv_heads, large,
                                                                                  layout.head_dim), d)
                                        for n, _, d in cache)))
    return Steps(mod=merged, weights={n: weights[n] for n in order}, steps=tuple(steps), layout=layout,
                 context=context, codes={n: c for n, c in codes.items() if n in weights})


def _grow(layout: decoder.Layout, small: int, large: int, symbol: str):
    """The Relax function copying a cache of ``small`` slots into one of ``large`` (the new slots zero)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    shape = (1, layout.kv_heads, small, layout.head_dim)
    params = [relax.Var(f"past_key_values_{i}_{kv}", relax.TensorType(shape, layout.cache_dtype))
              for i in range(layout.layers) for kv in ("key", "value")]
    with bb.function(symbol, params, attrs={"num_input": len(params)}):
        with bb.dataflow():
            grown = [bb.emit(relax.op.nn.pad(p, [0, 0, 0, 0, 0, large - small, 0, 0])) for p in params]
            out = bb.emit_output(relax.Tuple(grown))
        bb.emit_func_output(out)
    return bb.get()[symbol].with_attr("global_symbol", symbol)


def _shape(value: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(int(d.dim_value) for d in value.type.tensor_type.shape.dim)


def _np_dtype(value: onnx.ValueInfoProto) -> str:
    return str(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def _import(onnx_step: onnx.ModelProto, name: str):
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from edgeq import onnx_ops

    try:
        with onnx_ops.installed(None), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = from_onnx(onnx_step, keep_params_in_input=True)
    except Exception as err:  # the frontend raises anything from ValueError to TVMError
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelError(f"TVM could not import {name}'s decoder step: {first}") from None
    mod, params = relax.frontend.detach_params(mod)
    return mod, list(params.get("main", []))


def _with_weights(func, order: list[str], weights: dict, symbol: str):
    """``func`` taking every weight in ``order`` after its inputs (those it does not read as unused parameters)."""
    from tvm import relax

    count = int(func.attrs["num_input"])
    own = {p.name: p for p in func.params[count:]}
    params = list(func.params[:count])
    for weight in order:
        var = own.get(weight)
        if var is None:
            var = relax.Var(weight, relax.TensorType(weights[weight].shape, str(weights[weight].dtype)))
        params.append(var)
    new = relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return new.with_attr("global_symbol", symbol)
