"""Independent references for a decoder: ONNX Runtime on the ONNX model exactly as exported (symbolic lengths,
the cache growing by concatenation), and the same steps as edgeq's on ONNX Runtime (to tell a fault of the
specialization from one of TVM's build).

``greedy(model_bytes, prompt, n)`` is the judge of edgeq's tokens: nothing of edgeq's specialization, TVM or
the generation loop is in it.
"""

from __future__ import annotations

import numpy as np
import onnx

from edgeq.llm import decoder
from edgeq.reference import onnxruntime_session


def _session(model: onnx.ModelProto | bytes):
    return onnxruntime_session(model)


class Exported:
    """ONNX Runtime running the exported decoder one call per step, its ``present`` fed back as the past."""

    def __init__(self, model: onnx.ModelProto):
        self.layout = decoder.read_layout(model)
        self.session = _session(model)
        self.names = {i.name for i in self.session.get_inputs()}

    def _walk(self, prompt: list[int], choose) -> list[np.ndarray]:
        """Run the prompt (one call), then one call per token ``choose(logits so far)`` gives, until it gives None."""
        lay = self.layout
        past = {f"past_key_values.{i}.{kv}": np.zeros((1, lay.kv_heads, 0, lay.head_dim), lay.cache_dtype)
                for i in range(lay.layers) for kv in ("key", "value")}
        results, chunk, position = [], list(prompt), 0
        while chunk:
            feeds = {"input_ids": np.array([chunk], lay.ids_dtype),
                     "position_ids": np.arange(position, position + len(chunk), dtype=lay.ids_dtype)[None],
                     **past}
            if "attention_mask" in self.names:
                feeds["attention_mask"] = np.ones((1, position + len(chunk)), lay.mask_dtype)
            out = self.session.run(None, feeds)
            results.append(out[0][0, -1].astype(np.float64))
            past = dict(zip(past, out[1:]))
            position += len(chunk)
            token = choose(results)
            chunk = [] if token is None else [token]
        return results

    def logits(self, prompt: list[int], continuation: list[int]) -> list[np.ndarray]:
        """The next-token logits after the prompt and after each token of ``continuation`` (teacher forced):
        ``len(continuation) + 1`` vectors."""
        return self._walk(prompt, lambda got: continuation[len(got) - 1] if len(got) <= len(continuation) else None)

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        """``count`` greedy tokens after ``prompt`` (the first of equal maxima, as ``generate.Sampler``)."""
        tokens: list[int] = []

        def choose(got):
            tokens.append(int(np.argmax(got[-1])))
            return tokens[-1] if len(tokens) < count else None

        self._walk(prompt, choose)
        return tokens


class SpecializedSteps:
    """edgeq's static steps (``decoder.specialize``) run by ONNX Runtime: a ``generate.Steps`` with one cache
    capacity, the context."""

    def __init__(self, model: onnx.ModelProto, context: int, buckets: list[int]):
        self.layout = lay = decoder.read_layout(model)
        self.context, self.buckets = context, sorted(buckets)
        self.ids_dtype, self.mask_dtype = lay.ids_dtype, lay.mask_dtype or "int64"
        self.prefills = {b: _session(decoder.specialize(model, lay, "prefill", context, b)) for b in self.buckets}
        self.decoder = _session(decoder.specialize(model, lay, "decode", context))
        self.past = [f"past_key_values.{i}.{kv}" for i in range(lay.layers) for kv in ("key", "value")]

    @staticmethod
    def _run(session, feeds):
        names = {i.name for i in session.get_inputs()}
        out = session.run(None, {k: v for k, v in feeds.items() if k in names})
        return out[0].reshape(-1, out[0].shape[-1])[-1], out[1:]

    def prefill(self, bucket, feeds):
        return self._run(self.prefills[bucket], feeds)

    def decode(self, token, position, cache):
        from edgeq.templates.generate import decode_feeds

        feeds = decode_feeds(np, token, position, self.context, self.ids_dtype, self.mask_dtype)
        return self._run(self.decoder, {**feeds, **dict(zip(self.past, cache))})
