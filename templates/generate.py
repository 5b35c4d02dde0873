"""Token generation over a decoder's static steps (prefill, decode, and growing the cache), shared by run.py and
edgeq's host checks. Plain Python and numpy: it runs on the device with nothing installed.

A ``Steps`` object runs the compiled steps. Its cache is opaque here (device tensors in a bundle, numpy arrays
elsewhere), passed from each step to the next:

- ``steps.context``: cache slots at most, the most tokens (prompt and generated) one generation holds;
- ``steps.buckets``: the prompt lengths prefill is compiled for, ascending;
- ``steps.prefill(bucket, feeds) -> (logits, cache)`` with feeds ``input_ids``, ``position_ids``,
  ``attention_mask`` (each ``1 x bucket``) and ``last`` (the row whose logits come back);
- ``steps.decode(token, position, cache) -> (logits, cache)``: token ``token`` at ``position`` (below
  ``steps.context``); the steps grow the cache to a larger capacity where ``position`` is past the one it has.

Sampling draws from edgeq's own generator (SplitMix64, 53-bit uniforms), written the same way in edgeq-run, so
that a seed gives the same tokens in both loaders.
"""

from bisect import bisect_left, bisect_right
from functools import reduce
from itertools import accumulate, repeat
from math import exp
from operator import add, truediv

MASK64 = (1 << 64) - 1


class ContextFull(Exception):
    """The prompt alone does not fit the context."""


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64; ``uniform()`` is in [0, 1) with 53 random bits."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next() >> 11) * (1.0 / (1 << 53))


class Sampler:
    """Greedy at temperature 0 (the first of equal maxima); else softmax(logits / temperature) restricted to
    the smallest set of most likely tokens whose probability reaches ``top_p``, drawn with one uniform.

    Written operation for operation as edgeq-run's (tokenizer.h), so that a seed draws the same tokens in both:
    each weight by the C library's ``exp`` (``math.exp``), every sum in order, one division at a time (numpy's
    vectorised exp and pairwise sums round differently)."""

    def __init__(self, np, temperature=0.0, top_p=1.0, seed=0):
        self.np = np
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.rng = SplitMix64(seed)

    def __call__(self, logits):
        np = self.np
        logits = np.asarray(logits, dtype=np.float64).ravel()
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        scaled = logits / self.temperature
        order = np.argsort(-scaled, kind="stable")
        ordered = (scaled[order] - scaled[order[0]]).tolist()  # a float64 subtraction each, as in C++
        weights = list(map(exp, ordered))
        total = reduce(add, weights, 0.0)  # in order (Python 3.12's sum() compensates, C++ does not)
        probs = list(map(truediv, weights, repeat(total, len(weights))))
        keep = min(bisect_left(list(accumulate(probs)), self.top_p) + 1, len(weights))  # the first sum >= top_p
        kept_total = reduce(add, probs[:keep], 0.0)
        u = self.rng.uniform()
        index = bisect_right(list(accumulate(map(truediv, probs[:keep], repeat(kept_total, keep)))), u)  # first > u
        return int(order[min(index, keep - 1)])


def generate(np, steps, prompt, max_tokens, sampler, stop=()):
    """Yield up to ``max_tokens`` token ids after ``prompt`` (a list of ids), stopping after a ``stop`` id or
    when the context is full. Raises ContextFull when the prompt alone does not fit."""
    n = len(prompt)
    if n == 0:
        raise ValueError("the prompt has no tokens")
    if n >= steps.context:
        raise ContextFull("the prompt is %d tokens; this bundle's context holds %d (prompt and answer)"
                          % (n, steps.context))
    bucket = next((b for b in steps.buckets if b >= n), steps.buckets[-1])
    first = min(n, bucket)
    ids = np.zeros((1, bucket), dtype=steps.ids_dtype)
    ids[0, :first] = prompt[:first]
    feeds = {"input_ids": ids,
             "position_ids": np.arange(bucket, dtype=steps.ids_dtype).reshape(1, bucket),
             "attention_mask": np.ones((1, bucket), dtype=steps.mask_dtype),
             "last": np.array([first - 1], dtype=np.int64)}
    logits, cache = steps.prefill(bucket, feeds)
    for position in range(first, n):  # a prompt longer than the largest bucket: the rest one token at a time
        logits, cache = steps.decode(prompt[position], position, cache)
    position = n
    for _ in range(max_tokens):
        token = sampler(logits)
        yield token
        if token in stop or position >= steps.context:
            return
        logits, cache = steps.decode(token, position, cache)
        position += 1


def decode_feeds(np, token, position, capacity, ids_dtype, mask_dtype):
    """A decode step's inputs: the token at ``position``, the cache's ``capacity`` slots of which ``0 ..
    position-1`` are in use, and the new token after them (index ``capacity`` of the attention mask)."""
    mask = np.zeros((1, capacity + 1), dtype=mask_dtype)
    mask[0, :position] = 1
    mask[0, capacity] = 1
    return {"input_ids": np.full((1, 1), token, dtype=ids_dtype),
            "position_ids": np.full((1, 1), position, dtype=ids_dtype), "attention_mask": mask}


class VmSteps:
    """The bundle's compiled steps on a TVM VirtualMachine: a ``Steps``. ``steps``: the manifest's list of
    ``{"function", "kind", "prompt", "capacity", "inputs"}``: prefill per prompt bucket, decode per cache capacity
    (its cache inputs are named ``past_key_values.N.key|value``), and grow from each capacity to the next (its
    inputs the cache; no weights). ``params``: the weights as device tensors, passed after a step's inputs. The
    cache stays on the device between steps; only the logits are copied."""

    def __init__(self, np, tvm, vm, dev, params, steps, context, ids_dtype, mask_dtype):
        self.np, self.tvm, self.vm, self.dev, self.params = np, tvm, vm, dev, list(params)
        self.context, self.ids_dtype, self.mask_dtype = context, ids_dtype, mask_dtype or "int64"
        self.by_bucket = {s["prompt"]: s for s in steps if s["kind"] == "prefill"}
        self.buckets = sorted(self.by_bucket)
        self.decoding = {s["capacity"]: s for s in steps if s["kind"] == "decode"}
        self.capacities = sorted(self.decoding)
        self.growing = {s["prompt"]: s for s in steps if s["kind"] == "grow"}  # from capacity "prompt"
        self.functions = {s["function"]: vm[s["function"]] for s in steps}
        self.staged = {}
        self.capacity = None  # the cache's, as the last step left it

    def _stage(self, function, name, array):
        key = (function, name)
        staged = self.staged.get(key)
        if staged is None:
            staged = self.staged[key] = self.tvm.runtime.empty(array.shape, str(array.dtype), self.dev)
        staged.copyfrom(self.np.require(array, requirements="C"))
        return staged

    def _call(self, step, feeds, cache):
        args, cache = [], list(cache)
        for name in step["inputs"]:
            args.append(cache.pop(0) if name.startswith("past_key_values.") else self._stage(step["function"], name, feeds[name]))
        out = list(self.functions[step["function"]](*args, *self.params))
        self.capacity = step["capacity"]
        return out[0].numpy().reshape(-1), out[1:]

    def prefill(self, bucket, feeds):
        return self._call(self.by_bucket[bucket], feeds, [])

    def decode(self, token, position, cache):
        while position >= self.capacity:  # the cache is full: copied into the next capacity's
            step = self.growing[self.capacity]
            cache = list(self.functions[step["function"]](*cache))
            self.capacity = step["capacity"]
        feeds = decode_feeds(self.np, token, position, self.capacity, self.ids_dtype, self.mask_dtype)
        return self._call(self.decoding[self.capacity], feeds, cache)
