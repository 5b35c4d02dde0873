"""Language models: a decoder ONNX with a KV cache (exported by transformers + torch.onnx, as Optimum lays it out)
specialized into static prefill/decode steps, built by TVM, packaged, and generating from run.py. Judged by ONNX
Runtime on the model exactly as exported (symbolic lengths, the cache grown by concatenation) and, for the
tokenizer, by Hugging Face's ``tokenizers``."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import EXPORT_PYTHON, REPO, run_cli

from edgeq.errors import ModelError
from edgeq.llm import build, decoder, reference
from edgeq.templates import generate
from edgeq.templates import tokenizer as edgeq_tokenizer

LAYOUTS = ("tiny-llama", "tiny-qwen2", "tiny-phi3")
PROMPTS = ([1, 2, 3], [7, 100, 5, 9, 30, 31, 2], list(range(10, 22)))  # the last is past the largest bucket (8)
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
CORPUS = """The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital
of Germany. Language models predict the next token; a tokenizer splits text into tokens first. Jetson devices run
neural networks at the edge: cameras, robots and drones. It's 2026, and they'll run what we've packaged."""


@pytest.fixture(scope="session")
def decoders(tmp_path_factory) -> dict[str, Path]:
    """The three tiny random decoders (Llama, Qwen2, Phi-3 layouts), exported once per session."""
    if not EXPORT_PYTHON.exists():
        pytest.fail(f"{EXPORT_PYTHON} is missing: run 'bash scripts/setup.sh --zoo' (makes the export environment)")
    folder = tmp_path_factory.mktemp("decoders")
    paths = {}
    for kind in LAYOUTS:
        path = folder / kind / f"{kind}.onnx"
        proc = subprocess.run([str(EXPORT_PYTHON), str(REPO / "examples" / "export_llm.py"), kind, "-o", str(path)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        paths[kind] = path
    return paths


def _train_tokenizer(path: Path, pre_tokenizer=None, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders as hf_decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.split("\n") * 4, trainer)
    tok.save(str(path))
    return path


def _strings(count: int, seed: int = 0) -> list[str]:
    """Text a tokenizer must agree on: words, contractions, digits, whitespace runs, Unicode letters and marks,
    emoji with modifiers and flags, the separators Python's \\s and Unicode's White_Space disagree on, special
    tokens inside text, and invalid UTF-8 (decoded with replacement characters)."""
    rng = random.Random(seed)
    pieces = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 \t\n\r.,;:'\"!?-_()[]{}<>/\\@#$%^&*+=~`|") + [
        "é", "ü", "ß", "日本", "語", "中文", "😀", "👍🏽", "🇫🇷", "\u00a0", "\u2003", "\u3000", "\x1c", "\x1f", "\u200b",
        "ﬁ", "Ω", "½", "٣", "ǅ", "'s", "'ll", "'VE", "  ", "   ", "\n\n", "\r\n", "<|im_start|>", "<|im_end|>",
        "<|endoftext|>", "\x00", "\x7f", "\u0301", "Ⅻ", "\U0001f9d1\u200d\U0001f4bb"]
    strings = ["Hello world", "The capital of France is", "  leading", "trailing   ", "don't I'll we've", "x=1+2",
               "1234567 89", "\n\n\nfoo\n", "", " ", CORPUS]
    while len(strings) < count - 50:
        strings.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))))
    while len(strings) < count:
        strings.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 30))).decode("utf-8", errors="replace"))
    return strings


@pytest.fixture(scope="module")
def native_tokenizer(tmp_path_factory) -> Path:
    """edgeq-run's tokenizer (templates/native/tokenizer.h) alone, built as the loader builds it (tests/native/
    tokenize.cc): a tokenizer.json as argument, JSON strings on stdin, token ids and the streamed pieces out."""
    from edgeq.runtime.assemble import generated_headers, package_dir

    build = tmp_path_factory.mktemp("tokenize")
    for name, text in generated_headers().items():
        (build / name).write_bytes(text)
    binary = build / "tokenize"
    proc = subprocess.run(["g++", "-std=c++17", "-O2", "-ffp-contract=off", f"-I{build}", f"-I{REPO / 'templates' / 'native'}",
                           f"-I{package_dir('tvm_ffi') / 'include'}", str(REPO / "tests" / "native" / "tokenize.cc"),
                           "-o", str(binary)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return binary


def native_encode(binary: Path, path: Path, strings: list[str]) -> list[tuple[list[int], list[bytes]]]:
    """The native tokenizer's ids and its streaming decoder's pieces (the flushed tail last) for each string."""
    proc = subprocess.run([str(binary), str(path)], input="".join(json.dumps(s) + "\n" for s in strings),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = []
    for line in proc.stdout.splitlines():
        ids, pieces = line.split("\t")
        out.append(([int(i) for i in ids.split(",")] if ids else [], [bytes.fromhex(p) for p in pieces.split(",")]))
    assert len(out) == len(strings)
    return out


@pytest.mark.parametrize("variant", ["byte-level", "prefix-space", "split-regex"])
def test_tokenizer_gives_the_ids_tokenizers_gives(tmp_path, variant, native_tokenizer):
    """run.py's tokenizer (tokenizer.py) gives the ids of Hugging Face's ``tokenizers`` on a thousand strings, and
    edgeq-run's (tokenizer.h) gives run.py's ids and streams the same pieces of text."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    pre = {"byte-level": None, "prefix-space": pre_tokenizers.ByteLevel(add_prefix_space=True),
           "split-regex": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])}
    path = _train_tokenizer(tmp_path / "tokenizer.json", pre[variant])
    theirs, ours = Tokenizer.from_file(str(path)), edgeq_tokenizer.Tokenizer.from_file(path)
    differ = []
    for text in _strings(1000):
        want = theirs.encode(text, add_special_tokens=False).ids
        got = ours.encode(text)
        if got != want:
            differ.append((text, want, got))
        assert ours.decode(got, skip_special=False) == theirs.decode(want, skip_special_tokens=False)
        stream = edgeq_tokenizer.Decoder(ours)
        assert "".join(stream.push(t) for t in got) + stream.flush() == ours.decode(got), text
    assert not differ, f"{len(differ)} of 1000 strings differ, the first: {differ[0]}"
    strings = _strings(1000)
    for text, (ids, pieces) in zip(strings, native_encode(native_tokenizer, path, strings)):
        want = ours.encode(text)
        stream = edgeq_tokenizer.Decoder(ours)
        assert (ids, pieces) == (want, [stream.push(t).encode() for t in want] + [stream.flush().encode()]), text


def test_tokenizer_refuses_what_it_does_not_implement(tmp_path):
    data = json.loads(_train_tokenizer(tmp_path / "t.json").read_text())
    data["model"]["byte_fallback"] = True
    assert "byte fallback" in edgeq_tokenizer.supported(data)
    data = json.loads((tmp_path / "t.json").read_text())
    data["pre_tokenizer"] = {"type": "Whitespace"}
    assert "Whitespace" in edgeq_tokenizer.supported(data)


def test_sampler_is_greedy_at_zero_and_reproducible_by_seed():
    logits = np.array([0.1, 2.0, 2.0, -1.0, 1.9])
    assert generate.Sampler(np)(logits) == 1  # the first of equal maxima, as numpy's argmax
    draws = [generate.Sampler(np, 0.8, 0.95, seed)(logits) for seed in range(40)]
    assert draws == [generate.Sampler(np, 0.8, 0.95, seed)(logits) for seed in range(40)] and len(set(draws)) > 1
    # SplitMix64's published first outputs for seed 0 (the C++ loader draws the same numbers)
    rng = generate.SplitMix64(0)
    assert [rng.next() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    # top_p keeps only the most likely token when it alone reaches p
    assert {generate.Sampler(np, 1.0, 0.5, s)(np.array([5.0, 0.0, 0.0])) for s in range(20)} == {0}


@pytest.mark.parametrize("kind", LAYOUTS)
def test_specialized_steps_generate_what_the_exported_model_does(decoders, kind):
    """The static steps (cache a fixed buffer, the new token last, the slot written by position) on ONNX Runtime
    equal the exported model on ONNX Runtime: the specialization alone, without TVM."""
    model = onnx.load(decoders[kind])
    exported = reference.Exported(model)
    steps = reference.SpecializedSteps(model, context=40, buckets=[4, 8])
    for prompt in PROMPTS:
        assert list(generate.generate(np, steps, prompt, 24, generate.Sampler(np))) == exported.greedy(prompt, 24)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_host_build_generates_onnxruntime_greedy_tokens(decoders, kind):
    from edgeq.backends.cpu import decoder as cpu
    from edgeq.llm.package import host_steps
    from edgeq.targets import profiles

    model = onnx.load(decoders[kind])
    # two cache capacities: every prompt here grows its cache from 16 slots to 40 partway through
    steps = build.import_steps(model, context=40, buckets=[4, 8], capacities=[16])
    assert [s.function for s in steps.steps] == ["prefill_4", "prefill_8", "decode_16", "decode_40", "grow_16_40"]
    stats = {}
    executable, weights = cpu.build(steps.mod, steps.weights, profiles()["host"].tvm_target(), stats)
    assert any(name.endswith(tuple(f"_panels{n}" for n in (16, 32, 64, 128))) for name in weights)  # packed
    # attention read from the cache as it lies (edgeq.backends.cpu.attention): both products of every layer of
    # the two prefill and two decode steps
    assert stats.get("attention") == 2 * steps.layout.layers * 4, stats
    # the prefill steps' under their causal mask: each row's products and softmax over its own and the earlier
    # keys only (scores, softmax, weighted sum)
    assert stats.get("attention-causal") == 3 * steps.layout.layers * 2, stats
    # and the new entries written into the cache in place: each layer's key and value in both decode steps
    assert stats.get("cache-write") == 2 * steps.layout.layers * 2, stats
    runner = host_steps(steps, executable, weights)
    exported = reference.Exported(model)
    for prompt in PROMPTS:
        want = exported.greedy(prompt, 24)
        assert list(generate.generate(np, runner, prompt, 24, generate.Sampler(np))) == want
    # and the logits themselves, teacher-forced along the reference's tokens
    prompt = PROMPTS[1]
    want = exported.logits(prompt, exported.greedy(prompt, 6)[:-1])
    bucket = 8
    feeds = {"input_ids": np.array([prompt + [0] * (bucket - len(prompt))]), "position_ids": np.arange(bucket)[None],
             "attention_mask": np.ones((1, bucket), np.int64), "last": np.array([len(prompt) - 1])}
    got, cache = runner.prefill(bucket, feeds)
    np.testing.assert_allclose(got, want[0], rtol=1e-4, atol=1e-4 * np.abs(want[0]).max())
    # a decode step returns the cache it was given, changed in its one slot: no copy of the whole cache a token
    before = [c.numpy() for c in cache]
    position = len(prompt)
    _, after = runner.decode(int(np.argmax(got)), position, cache)
    for given, returned, old in zip(cache, after, before):
        now = given.numpy()
        np.testing.assert_array_equal(now, returned.numpy())
        changed = np.flatnonzero((now != old).any(axis=(0, 1, 3)))
        assert changed.tolist() == [position], changed


@pytest.mark.parametrize("heads, kv_heads, rows, dim, lengths", [
    (9, 3, 1, 64, [64, 1]),  # SmolLM2's decode: the cache and the new token, 3 query heads a kv head
    (9, 3, 8, 64, [8]),  # its prefill: 8 rows, the new keys alone
    (4, 2, 1, 16, [16, 1]),  # the tiny decoders' heads of 16: one vector (a reduction loop of one)
    (6, 1, 3, 40, [5, 3]),  # one kv head for all (multi-query), a width of 40 (no whole vector of 16)
])
def test_attention_kernels_compute_the_repeated_products(heads, kv_heads, rows, dim, lengths):
    """The decode attention kernels against numpy's products on the repeated, concatenated cache they replace."""
    from edgeq.backends.cpu import attention
    from edgeq.backends.cpu.common import Isa
    from edgeq.targets import profiles
    from edgeq.tvm_env import tvm

    target = profiles()["host"].tvm_target()
    isa = Isa.of(target)
    rng = np.random.default_rng(heads * rows + dim)
    q = rng.standard_normal((1, heads, rows, dim)).astype(np.float32)
    parts = [rng.standard_normal((1, kv_heads, n, dim)).astype(np.float32) for n in lengths]
    p = rng.random((1, heads, rows, sum(lengths))).astype(np.float32)
    repeated = np.repeat(np.concatenate(parts, axis=2), heads // kv_heads, axis=1)
    for func, inputs, want in (
            (attention.scores_func(heads, kv_heads, rows, dim, lengths, 0.125, "float32", isa), [q, *parts],
             q @ np.swapaxes(repeated * np.float32(0.125), 2, 3)),
            (attention.scores_func(heads, kv_heads, rows, dim, lengths, None, "float32", isa), [q, *parts],
             q @ np.swapaxes(repeated, 2, 3)),
            (attention.weighted_func(heads, kv_heads, rows, dim, lengths, "float32", isa), [p, *parts], p @ repeated)):
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
        out = tvm.runtime.tensor(np.full(want.shape, np.nan, np.float32))
        lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("heads, kv_heads, rows, dim", [
    (9, 3, 8, 64),  # SmolLM2's prefill of 8 rows
    (4, 2, 5, 16),  # the tiny decoders' heads, an odd count of rows (the middle row of the pairs once)
    (6, 1, 7, 40),  # multi-query, a width of 40
    (9, 3, 1, 64),  # one row
    (3, 1, 150, 16),  # rows over two tiles of keys, the last one partial
])
def test_causal_attention_kernels_compute_what_the_mask_keeps(heads, kv_heads, rows, dim):
    """A prefill's attention under its causal mask: each row's scores with its own and the earlier keys (0 after
    the tile of keys that holds its own), their softmax under the mask (0 after its own key), and the weighted sum
    of the values up to its own row as ``weighted_func`` computes it from lower-triangular weights, bit for bit."""
    from edgeq.backends.cpu import attention
    from edgeq.backends.cpu.common import Isa
    from edgeq.targets import profiles
    from edgeq.tvm_env import tvm

    target = profiles()["host"].tvm_target()
    isa = Isa.of(target)
    rng = np.random.default_rng(heads * rows + dim)
    q = rng.standard_normal((1, heads, rows, dim)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, rows, dim)).astype(np.float32)
    p = np.tril(rng.random((1, heads, rows, rows))).astype(np.float32)
    seen = np.tril(np.ones((rows, rows), bool))

    def run(func, inputs, shape):
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        out = tvm.runtime.tensor(np.full(shape, np.nan, np.float32))
        lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
        return out.numpy()

    tile = attention.causal_tile(isa)
    keys = np.zeros((1, kv_heads, dim, -(-rows // tile) * tile), np.float32)  # transposed, scaled, padded
    keys[..., :rows] = np.swapaxes(k * np.float32(0.125), 2, 3)
    got = run(attention.causal_scores_func(heads, kv_heads, rows, dim, "float32", isa), [q, keys],
              (1, heads, rows, rows))
    want = q @ np.swapaxes(np.repeat(k * np.float32(0.125), heads // kv_heads, axis=1), 2, 3)
    np.testing.assert_allclose(got[..., seen], want[..., seen], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # after the keys of the tile that holds a row's own key: 0 (the mask hides them; a score there is not computed)
    after = np.arange(rows)[None, :] >= (np.arange(rows)[:, None] // tile + 1) * tile
    assert (got[..., after] == 0).all() and np.isfinite(got).all()
    # the softmax of the masked scores over the keys up to each row's own (a prompt's last row a bucket's padding)
    scores = (rng.standard_normal((1, heads, rows, rows)) * 3).astype(np.float32)
    shown = seen & (np.arange(rows) < max(rows - 1, 1))
    mask = np.where(shown, 0, np.finfo(np.float32).min).astype(np.float32)[None, None]
    got = run(attention.causal_softmax_func(heads, rows, 1, True, "float32", isa), [scores, mask], scores.shape)
    y = scores.astype(np.float64) + mask
    want = np.exp(y - y.max(-1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert (got[..., ~seen] == 0).all()
    got = run(attention.causal_weighted_func(heads, kv_heads, rows, dim, "float32", isa), [p, k], (1, heads, rows, dim))
    full = run(attention.weighted_func(heads, kv_heads, rows, dim, [rows], "float32", isa), [p, k],
               (1, heads, rows, dim))
    np.testing.assert_array_equal(got, full)
    want = p @ np.repeat(k, heads // kv_heads, axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("axis", [2, 1])
def test_attention_pass_rewrites_only_the_repeat_it_computes(axis):
    """The grouped-query repeat as exported (expand_dims at 2: query head h reads kv head h // G) is rewritten to the
    kernels, and the graph computes what it did; a repeat at axis 1 (h reads kv head h % kv_heads) is left to TVM."""
    from edgeq.backends.cpu.attention import attention_pass
    from edgeq.backends.cpu.common import Isa
    from edgeq.targets import profiles
    from edgeq.tvm_env import relax, tvm

    heads, kv, length, dim = 6, 2, 5, 16
    group = heads // kv
    shape5 = (1, kv, group, length, dim) if axis == 2 else (1, group, kv, length, dim)
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, heads, 1, dim), "float32"))
    past = relax.Var("past", relax.TensorType((1, kv, length - 1, dim), "float32"))
    new = relax.Var("new", relax.TensorType((1, kv, 1, dim), "float32"))
    with bb.function("main", [q, past, new]):
        with bb.dataflow():
            keys = bb.emit(relax.op.concat([past, new], axis=2))
            repeat = bb.emit(relax.op.reshape(relax.op.broadcast_to(relax.op.expand_dims(keys, axis=[axis]), shape5),
                                              (1, heads, length, dim)))
            scores = bb.emit(relax.op.matmul(q, relax.op.multiply(relax.op.permute_dims(repeat, [0, 1, 3, 2]),
                                                                  relax.const(0.25, "float32"))))
            out = bb.emit_output(relax.op.matmul(relax.op.nn.softmax(scores, axis=-1), repeat))
        bb.emit_func_output(out)
    mod = bb.get()
    target = profiles()["host"].tvm_target()
    stats = {}
    rewritten = attention_pass(Isa.of(target), stats)(mod)
    assert stats.get("attention", 0) == (2 if axis == 2 else 0), stats
    rng = np.random.default_rng(axis)
    inputs = [rng.standard_normal(tuple(int(d) for d in v.ty.shape.values)).astype(np.float32)
              for v in mod["main"].params]
    results = []
    for module in (mod, rewritten):
        vm = relax.VirtualMachine(tvm.compile(module, target=target), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["causal", "sliding", "all"])
def test_attention_pass_takes_the_causal_kernels_only_under_a_causal_mask(mask):
    """A prefill's attention as exported (the mask ``where(C & padding, 0, min)`` added to the scores, softmax,
    NaNs made 0) is computed by the causal kernels where ``C`` hides every later key (a causal or a sliding-window
    mask), and by the full ones where it shows one; the graph computes what it did either way."""
    from edgeq.backends.cpu.attention import attention_pass
    from edgeq.backends.cpu.common import Isa
    from edgeq.targets import profiles
    from edgeq.tvm_env import relax, tvm

    heads, kv, rows, dim = 4, 2, 6, 16
    ones = np.ones((rows, rows), bool)
    keep = {"causal": np.tril(ones), "sliding": np.tril(np.triu(ones, -2)), "all": ones}[mask]
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, heads, rows, dim), "float32"))
    k = relax.Var("k", relax.TensorType((1, kv, rows, dim), "float32"))
    v = relax.Var("v", relax.TensorType((1, kv, rows, dim), "float32"))
    padding = relax.Var("padding", relax.TensorType((1, 1, 1, rows), "bool"))

    def repeat(x):
        expanded = relax.op.broadcast_to(relax.op.expand_dims(x, axis=[2]), (1, kv, heads // kv, rows, dim))
        return relax.op.reshape(expanded, (1, heads, rows, dim))

    with bb.function("main", [q, k, v, padding]):
        with bb.dataflow():
            both = bb.emit(relax.op.broadcast_to(relax.op.logical_and(relax.const(keep[None, None]), padding),
                                                 (1, 1, rows, rows)))
            hidden = relax.op.where(both, relax.const(0.0, "float32"), relax.const(np.finfo(np.float32).min, "float32"))
            scores = bb.emit(relax.op.matmul(relax.op.multiply(q, relax.const(0.5, "float32")),
                                             relax.op.multiply(relax.op.permute_dims(repeat(k), [0, 1, 3, 2]),
                                                               relax.const(0.5, "float32"))))
            weights = bb.emit(relax.op.nn.softmax(relax.op.add(scores, hidden), axis=-1))
            weights = bb.emit(relax.op.where(relax.op.isnan(weights), relax.const(0.0, "float32"), weights))
            out = bb.emit_output(relax.op.matmul(weights, repeat(v)))
        bb.emit_func_output(out)
    mod = bb.get()
    target = profiles()["host"].tvm_target()
    stats = {}
    rewritten = attention_pass(Isa.of(target), stats)(mod)
    assert stats.get("attention") == 2 and stats.get("attention-causal", 0) == (0 if mask == "all" else 3), stats
    rng = np.random.default_rng(rows)
    inputs = [rng.standard_normal((1, n, rows, dim)).astype(np.float32) for n in (heads, kv, kv)]
    inputs.append(np.array([[[[True] * (rows - 1) + [False]]]]))  # the last row a prompt bucket's padding
    results = []
    for module in (mod, rewritten):
        vm = relax.VirtualMachine(tvm.compile(module, target=target), tvm.cpu())
        results.append(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_a_long_prompts_causal_mask_is_folded_for_the_causal_kernels(decoders):
    """A prefill bucket over 256 rows: its causal mask (a comparison of two position ranges, 300 x 300) is over
    the size ONNX folding takes for other tensors, and is folded as a boolean all the same (``fold``), so that
    the CPU build computes only the keys each row sees (3 kernels a layer: scores, softmax, weighted sum)."""
    from edgeq.backends.cpu.attention import attention_pass
    from edgeq.backends.cpu.common import Isa
    from edgeq.targets import profiles

    steps = build.import_steps(onnx.load(decoders["tiny-llama"]), context=301, buckets=[300], capacities=[])
    stats = {}
    attention_pass(Isa.of(profiles()["host"].tvm_target()), stats)(steps.mod)
    assert stats.get("attention-causal") == 3 * steps.layout.layers, stats


def test_decoder_layout_and_refusals(decoders, tmp_path):
    model = onnx.load(decoders["tiny-llama"])
    layout = decoder.read_layout(model)
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (2, 2, 16, 320)
    # ONNX Runtime GenAI's fused attention: named, with the export that avoids it
    gqa = onnx.ModelProto()
    gqa.CopyFrom(model)
    gqa.graph.node.append(onnx.helper.make_node("GroupQueryAttention", ["input_ids"], ["unused"], domain="com.microsoft"))
    with pytest.raises(Exception, match="GroupQueryAttention .*optimum-cli export onnx"):
        decoder.read_layout(gqa)
    no_positions = onnx.ModelProto()
    no_positions.CopyFrom(model)
    kept = [i for i in no_positions.graph.input if i.name != "position_ids"]
    del no_positions.graph.input[:]
    no_positions.graph.input.extend(kept)
    with pytest.raises(Exception, match="no position_ids input"):
        decoder.read_layout(no_positions)


@pytest.fixture(scope="session")
def llm_bundle(decoders, tmp_path_factory):
    """tiny-llama packaged for the host with a trained byte-level tokenizer and a ChatML template beside it."""
    folder = tmp_path_factory.mktemp("llm")
    model = folder / "tiny.onnx"
    shutil.copyfile(decoders["tiny-llama"], model)
    _train_tokenizer(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    result = run_cli("package", model, "--device", "host", "-o", folder / "out", "--max-context", "64", "--json")
    assert result.code == 0, result.stderr
    return folder / "out" / "tiny-host", model


def _run_py(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(bundle / "run.py"), *args], capture_output=True, text=True, timeout=300)


def test_package_language_model_bundle(llm_bundle):
    bundle, model = llm_bundle
    manifest = json.loads((bundle / "manifest.json").read_text())
    gen = manifest["generate"]
    assert gen["context"] == 64 and [s["kind"] for s in gen["steps"]][-1] == "decode"
    assert gen["tokenizer"] == "tokenizer.json" and gen["chat_prefix"] == "<|im_start|>user\n"
    assert gen["chat_suffix"] == "<|im_end|>\n<|im_start|>assistant\n" and gen["stop"] == [2]
    assert manifest["reference_check"]["result"] == "passed"
    for name in ("generate.py", "tokenizer.py", "tokenizer.json"):
        assert name in manifest["files"]
    proc = _run_py(bundle, "--self-test", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outputs"][0] == {"output": "tokens", "count": 16, "matched": 16, "ok": True}


def test_run_py_streams_the_reference_tokens(llm_bundle):
    bundle, model = llm_bundle
    exported = reference.Exported(onnx.load(model))
    prompt = [5, 77, 120, 3, 9]
    want = exported.greedy(prompt, 20)
    stop = 2  # <|im_end|> ends the answer where greedy decoding reaches it
    want = want[:want.index(stop) + 1] if stop in want else want
    proc = _run_py(bundle, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["token"] for line in lines if "token" in line and line["token"] is not None] == want
    summary = lines[-1]["summary"]
    assert summary["prompt_tokens"] == 5 and summary["tokens"] == len(want)
    # text in: the bundle's tokenizer gives the ids; the streamed text is the tokenizer's decoding of the tokens
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    text = "The capital of France is"
    ids = hf.encode(text, add_special_tokens=False).ids
    proc = _run_py(bundle, "--prompt", text, "--max-tokens", "12", "--json")
    tokens = [json.loads(line)["token"] for line in proc.stdout.splitlines()[:-1]]
    tokens = [t for t in tokens if t is not None]
    want = exported.greedy(ids, 12)
    assert tokens == want[:len(tokens)] and (len(tokens) == 12 or tokens[-1] == stop)
    plain = _run_py(bundle, "--prompt", text, "--max-tokens", "12")
    assert plain.stdout.rstrip("\n") == hf.decode(tokens, skip_special_tokens=True)
    # --chat wraps the prompt in the template's two halves
    chat = _run_py(bundle, "--prompt", "hi", "--chat", "--max-tokens", "4", "--json")
    assert json.loads(chat.stdout.splitlines()[-1])["summary"]["prompt_tokens"] == len(
        hf.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids)
    # sampling: the same seed gives the same tokens
    runs = [_run_py(bundle, "--prompt-ids", "5,6,7", "--temperature", "0.9", "--top-p", "0.9", "--seed", "11",
                    "--max-tokens", "16", "--json").stdout for _ in range(2)]
    assert runs[0].splitlines()[:-1] == runs[1].splitlines()[:-1] and len(runs[0].splitlines()) > 2


@pytest.mark.parametrize("args, status, words", [
    (["--prompt-ids", ",".join(["5"] * 70)], 2, "the prompt is 70 tokens; this bundle's context holds 64"),
    (["--prompt-ids", "5,400"], 2, "prompt token id 400 is outside the vocabulary (0..319)"),
    (["--prompt-ids", "5,x"], 2, "--prompt-ids needs token ids separated by commas"),
    (["--prompt-ids", "5", "--chat"], 2, "--chat wraps a --prompt TEXT"),
    (["--prompt", "hi", "--top-p", "0"], 2, "--top-p needs P above 0"),
    (["--benchmark", "5"], 2, "this bundle is a language model"),
    (["--prompt", "hi", "--prompt-ids", "5"], 2, "give --prompt or --prompt-ids, not both"),
    (["--prompt", "hi", "--seed", "-1"], 2, "--seed needs S from 0 to 18446744073709551615"),
    (["--prompt", "hi", "--max-tokens", "0"], 2, "--max-tokens needs N from 1 to 1000000"),
    (["--prompt", "a\udcffb"], 2, "--prompt is not UTF-8 text (byte 1)"),  # the byte 0xff, as Python passes it on
])
def test_both_loaders_refuse_bad_generation_input(llm_bundle, args, status, words):
    bundle, _ = llm_bundle
    for proc in (_run_py(bundle, *args), _edgeq_run(bundle, *args)):
        assert proc.returncode == status, proc.stderr
        assert "Traceback" not in proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]  # (argparse's usage lines before it)
        assert len(errors) == 1 and words in errors[0] and proc.stderr.rstrip().endswith(errors[0])


def _edgeq_run(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bundle / "runtime" / "edgeq-run"), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [
    ["--self-test", "--json"],
    ["--self-test"],
    ["--prompt-ids", "5,77,120,3,9", "--max-tokens", "20", "--json"],
    ["--prompt-ids", "5,77,120,3,9", "--max-tokens", "40", "--ignore-eos", "--json"],  # past <|im_end|>
    ["--prompt", "The capital of France is", "--max-tokens", "12", "--json"],
    ["--prompt", "Caf\u00e9 \U0001f600 d\u00e9j\u00e0 vu", "--max-tokens", "24"],  # streamed as text
    ["--prompt", "hi", "--chat", "--max-tokens", "30", "--temperature", "0.9", "--top-p", "0.9", "--seed", "11", "--json"],
    ["--prompt-ids", ",".join(map(str, range(10, 40))), "--temperature", "1.5", "--seed", "3", "--max-tokens", "60",
     "--json"],  # past the largest prompt bucket (16), to the end of the context (64)
    ["--tokenize", "Hello w\u00f6rld \U0001f600  \n\t<|im_end|>x", "--json"],
])
def test_both_loaders_generate_the_same_tokens(llm_bundle, args):
    """edgeq-run (C++: tokenizer.h, its sampler, the steps through tvm-ffi's C API) prints what run.py prints, line for
    line: the same tokens and text for the same prompt and seed, the same self-test and token ids; only the summary's
    timings differ."""
    bundle, _ = llm_bundle
    ours, theirs = _edgeq_run(bundle, *args), _run_py(bundle, *args)
    assert ours.returncode == theirs.returncode == 0, (ours.stderr, theirs.stderr)
    if "--json" in args and "--prompt" in " ".join(args):
        *lines, summary = ours.stdout.splitlines()
        *want, want_summary = theirs.stdout.splitlines()
        assert lines == want and len(lines) > 1
        ours_s, theirs_s = json.loads(summary)["summary"], json.loads(want_summary)["summary"]
        for timing in ("first_token_ms", "decode_tokens_per_s"):
            ours_s.pop(timing), theirs_s.pop(timing)
        assert ours_s == theirs_s
    else:
        assert ours.stdout == theirs.stdout and ours.stdout.strip()


def test_bench_refuses_a_language_model_in_one_line(llm_bundle):
    bundle, _ = llm_bundle
    result = run_cli("bench", bundle, "--repeat", "3")
    assert result.code == 2 and "is a language model" in result.stderr and "run.py --prompt" in result.stderr
    assert "Traceback" not in result.stderr


def test_package_refuses_what_language_models_do_not_take(decoders, tmp_path):
    model = decoders["tiny-llama"]
    for args, words in ((["--precision", "fp16", "--device", "jetson-orin-nano"], "--precision fp16 is not available"),
                        (["--device", "jetson-orin-nano"], "jetson-orin-cpu"),
                        (["--device", "host", "--max-context", "8"], "--max-context 8: give 32 to 32768"),
                        (["--device", "host", "--tokenizer", tmp_path / "none.json"], "no such file")):
        result = run_cli("package", model, "-o", tmp_path / "out", *args)
        assert result.code == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "out").exists()  # nothing half-written


def _product_module(k: int, n: int, rows: int):
    from edgeq.tvm_env import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, rows, k), "float32"))
    wv = relax.Var("w", relax.TensorType((k, n), "float32"))
    with bb.function("main", [x, wv], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x, wv)))
        bb.emit_func_output(out)
    return bb.get()


def _run_product(target, w: np.ndarray, xs: np.ndarray, bits: int) -> tuple[np.ndarray, dict]:
    from edgeq.backends.cpu import decoder as cpu
    from edgeq.tvm_env import relax, tvm

    stats = {}
    executable, weights = cpu.build(_product_module(*w.shape[:1], w.shape[1], xs.shape[1]), {"w": w}, target, stats,
                                    bits=bits)
    assert stats.get("weight-product") == 1 and len(weights) == (2 if bits == 8 else 3)
    k, n = w.shape
    assert sum(a.nbytes for a in weights.values()) == k * n * bits // 8 + (k // 32) * n * 2 * (1 if bits == 8 else 2)
    # its tiles and the dot instruction's operands on the stack (common.TILE): no call to TVM's workspace pool,
    # whose allocation and free per parallel task cost SmolLM2's decode a tenth of its time
    library = next(m for m in executable.mod.imports if m.kind == "llvm")
    assert "__TVMBackendAllocWorkspace" not in library.inspect_source("ll")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(xs), *[tvm.runtime.tensor(a) for a in weights.values()]).numpy(), weights


def test_int8_weight_only_products_compute_their_dequantized_weights():
    """The packed int8 codes and scales, dequantized by the compiled product as it reads them, give x @
    dequantized(w), as numpy computes it from the codes."""
    from edgeq.backends.cpu import decoder as cpu
    from edgeq.targets import profiles

    rng = np.random.default_rng(8)
    k, n = 96, 64
    w = rng.standard_normal((k, n)).astype(np.float32)
    codes, scales, lowest = cpu.quantize_groups(w, 8)
    groups = np.repeat(scales.astype(np.float32), cpu.GROUP, axis=0)
    dequantized = codes.astype(np.float32) * groups
    assert lowest is None and np.abs(dequantized - w).max() <= groups.max() * 0.5 + 1e-6
    xs = rng.standard_normal((1, 3, k)).astype(np.float32)
    got, _ = _run_product(profiles()["host"].tvm_target(), w, xs, 8)
    np.testing.assert_allclose(got, xs @ dequantized, rtol=1e-5, atol=1e-4)


def _q4_1_times_q8(xs: np.ndarray, codes: np.ndarray, scales: np.ndarray, lowest: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 x Q8_1 product as numpy computes it, written from its definition: each row of ``x``
    quantized to int8 per 32 (``step = max |x| / 127``, ``x * (1 / step)`` rounded half to even, as llama.cpp's
    vector code for ``quantize_row_q8_1`` does; its scalar reference rounds half away); per group the integer sum
    of codes times int8 activations, scaled by ``scale * step``, plus ``minimum * step * sum(xq)``: the product of
    the dequantized activations and weights."""
    k, n = codes.shape
    groups = xs.reshape(*xs.shape[:-1], k // 32, 32)
    step = np.abs(groups).max(axis=-1) * (np.float32(1) / np.float32(127))
    inverse = np.float32(1) / np.where(step == 0, np.float32(np.inf), step)
    xq = np.clip(np.rint(groups * inverse[..., None]), -127, 127).astype(np.int64)
    sums = np.einsum("...gj,gjn->...gn", xq, codes.reshape(k // 32, 32, n).astype(np.int64))
    assert np.abs(sums).max() < 1 << 24  # exact in float32 below
    return (sums.astype(np.float32) * (scales.astype(np.float32) * step[..., None])
            + lowest.astype(np.float32) * (xq.sum(axis=-1).astype(np.float32) * step)[..., None]).sum(axis=-2)


def test_int4_products_are_integer_sums_alike_on_every_cpu():
    """int4 products multiply int8 activations by the 4-bit codes in integers (llama.cpp's Q4_1 x Q8_1): the
    compiled product equals numpy's definition of it, on this CPU's dot-product instruction (VNNI where it has
    it) and on a CPU without one (Haswell: the same sums in vector lanes, what a build host without the
    instruction computes for a Jetson's self-test) bit for bit, and stays within 1% of float x @ w. A row of
    ``x`` holds exact ties (x / step = 0.5, 1.5, 2.5, -0.5 with step 1): rounding them half away from zero, not
    to even as the definition says, moves its outputs."""
    from edgeq.backends.cpu import decoder as cpu
    from edgeq.targets import profiles
    from edgeq.tvm_env import tvm

    rng = np.random.default_rng(4)
    k, n, rows = 96, 64, 3
    w = rng.standard_normal((k, n)).astype(np.float32)
    codes, scales, lowest = cpu.quantize_groups(w, 4)
    packed = cpu.dot_codes(codes, 16)
    unpacked = np.stack([packed & 15, packed >> 4], axis=-2)  # [n / 16, k / 8, 16, half, byte]
    assert np.array_equal(unpacked.transpose(1, 3, 4, 0, 2).reshape(k, n), codes)  # the layout's definition
    xs = rng.standard_normal((1, rows, k)).astype(np.float32)
    xs[0, 1, :32] = np.tile(np.float32([0.5, 1.5, 2.5, -0.5]), 8)
    xs[0, 1, 31] = 127.0
    dequantized = (codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=0)
                   + np.repeat(lowest.astype(np.float32), 32, axis=0))
    expected = _q4_1_times_q8(xs, codes, scales, lowest)
    host = profiles()["host"].tvm_target()
    without = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"})
    got, _ = _run_product(host, w, xs, 4)
    plain, _ = _run_product(without, w, xs, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert np.array_equal(got, plain)
    exact = xs[:, ::2] @ dequantized  # the rows of random activations (the ties' row has an outlier: 127 beside 0.5)
    assert np.abs(got[:, ::2] - exact).max() <= 0.01 * np.abs(exact).max()


def test_int4_recovers_a_q4_1_grid_exactly():
    """Weights already on llama.cpp's Q4_1 grid (a float16 scale and minimum per 32, codes 0..15 using the whole
    range) come back exactly: the reason int4 takes this form (symmetric int4 cannot represent such a group)."""
    from edgeq.backends.cpu import decoder as cpu

    rng = np.random.default_rng(0)
    k, n = 64, 16
    d = rng.uniform(0.01, 0.1, (k // 32, n)).astype(np.float16)
    m = rng.uniform(-1.0, 0.0, (k // 32, n)).astype(np.float16)
    q = rng.integers(0, 16, (k, n))
    q[0::32], q[1::32] = 0, 15  # each group spans its whole grid
    w = (q * np.repeat(d.astype(np.float32), 32, axis=0) + np.repeat(m.astype(np.float32), 32, axis=0)).astype(np.float32)
    codes, scales, lowest = cpu.quantize_groups(w, 4)
    back = codes * np.repeat(scales.astype(np.float32), 32, axis=0) + np.repeat(lowest.astype(np.float32), 32, axis=0)
    assert np.array_equal(codes, q) and np.abs(back - w).max() <= 1e-3 * np.abs(w).max()


@pytest.mark.skipif(shutil.which("qemu-aarch64") is None or not Path("/usr/aarch64-linux-gnu").is_dir(),
                    reason="qemu-user and the aarch64 cross toolchain are needed (scripts/setup.sh)")
def test_an_aarch64_bundle_generates_under_qemu_as_the_host_does(llm_bundle, tmp_path):
    """The same model packaged for arm64-cpu (a Jetson's CPU): its cross-compiled edgeq-run and steps, run under
    qemu-aarch64 with nothing else, pass the self-test recorded by the host build and stream the host's greedy
    tokens and text."""
    bundle, model = llm_bundle
    result = run_cli("package", model, "--device", "arm64-cpu", "-o", tmp_path, "--max-context", "64", "-q", "--json")
    assert result.code == 0, result.stderr
    arm = Path(json.loads(result.stdout)["bundle_dir"])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(arm)}

    def run_arm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(arm / "runtime" / "edgeq-run"), *args],
                              capture_output=True, text=True, env=env, timeout=600)

    proc = run_arm("--self-test", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr
    args = ("--prompt", "The capital of France is", "--max-tokens", "12", "--json")
    ours, theirs = run_arm(*args), _run_py(bundle, *args)
    assert ours.returncode == theirs.returncode == 0, ours.stderr
    assert ours.stdout.splitlines()[:-1] == theirs.stdout.splitlines()[:-1]


@pytest.mark.skipif(shutil.which("qemu-aarch64") is None or not Path("/usr/aarch64-linux-gnu").is_dir(),
                    reason="qemu-user and the aarch64 cross toolchain are needed (scripts/setup.sh)")
def test_int4_on_an_orins_cpu_generates_the_hosts_tokens_under_qemu(llm_bundle, tmp_path):
    """int4 for a Jetson Orin's CPU (Cortex-A78AE: its products on Arm's ``sdot``) under qemu-aarch64 passes the
    self-test whose tokens a host build computed (on this machine's VNNI, or without a dot-product instruction):
    the integer products and the float steps around them give the same tokens on both."""
    bundle, model = llm_bundle
    result = run_cli("package", model, "--device", "jetson-orin-cpu", "--precision", "int4", "-o", tmp_path,
                     "--max-context", "64", "-q", "--json")
    assert result.code == 0, result.stderr
    arm = Path(json.loads(result.stdout)["bundle_dir"])
    gen = json.loads((arm / "manifest.json").read_text())["generate"]
    assert (gen["weight_bits"], gen["weight_scheme"], gen["activation_bits"]) == (4, "scale and minimum", 8)
    proc = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(arm / "runtime" / "edgeq-run"),
                           "--self-test", "--json"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                          timeout=600)
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr


def _to_matmul_nbits(model: onnx.ModelProto, block: int = 32) -> tuple[onnx.ModelProto, dict]:
    """``model`` with each MatMul by a weight of its own (float32 ``[K, N]``, K a multiple of ``block``) made ONNX
    Runtime's com.microsoft.MatMulNBits as its documentation defines it (written here from that definition, the form
    its ``matmul_4bits_quantizer`` writes): per block of K, asymmetric 4-bit codes ``q = clip(round(w / scale) +
    zp, 0, 15)``, B ``[N, blocks, block / 2]`` two codes a byte low first, float32 scales ``[N * blocks]``, zero
    points packed two a byte. Returns (model, {B's name: codes [N, K]})."""
    from onnx import helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    nodes, written, dropped = [], {}, set()
    for node in graph.node:
        w = consts.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.dims[0] % block or readers[node.input[1]] != 1:
            nodes.append(node)
            continue
        array = numpy_helper.to_array(w).astype(np.float32)
        k, n = array.shape
        blocks = array.T.reshape(n, k // block, block)
        lo, hi = np.minimum(blocks.min(axis=2), 0), np.maximum(blocks.max(axis=2), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
        q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        zpad = np.concatenate([zp, np.zeros((n, (k // block) % 2), np.uint8)], axis=1)
        zpacked = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
        base = node.input[1] + "_nbits"
        graph.initializer.extend([numpy_helper.from_array(packed, base + "_b"),
                                  numpy_helper.from_array(scale.reshape(-1), base + "_scales"),
                                  numpy_helper.from_array(zpacked, base + "_zp")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], base + "_b", base + "_scales", base + "_zp"],
                                      list(node.output), domain="com.microsoft", K=k, N=n, bits=4, block_size=block))
        written[base + "_b"] = q.reshape(n, k)
        dropped.add(node.input[1])
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, written


def test_matmul_nbits_imports_as_onnxruntime_runs_it_and_int4_keeps_its_codes(decoders):
    """A decoder whose products are com.microsoft.MatMulNBits (4-bit codes, scales and zero points per block of
    32): imported as ONNX Runtime defines it, an fp32 build generates ONNX Runtime's greedy tokens for that model;
    an int4 build streams the model's own codes, not codes of its own (every product's panels unpacked are the
    MatMulNBits codes), with its scales and minimums (-zp * scale)."""
    from edgeq.backends.cpu import decoder as cpu
    from edgeq.llm.package import host_steps
    from edgeq.targets import profiles

    model, written = _to_matmul_nbits(onnx.load(decoders["tiny-llama"]))
    assert len(written) >= 7 * 2  # q, k, v, o and the three FFN products of each layer, at least
    steps = build.import_steps(model, context=40, buckets=[4, 8], capacities=[16])
    assert sorted(steps.codes) == sorted(re.sub(r"\W", "_", b) + "_dequantized" for b in written)
    target = profiles()["host"].tvm_target()
    executable, weights = cpu.build(steps.mod, steps.weights, target)
    runner, exported = host_steps(steps, executable, weights), reference.Exported(model)
    for prompt in PROMPTS:
        assert list(generate.generate(np, runner, prompt, 24, generate.Sampler(np))) == exported.greedy(prompt, 24)
    executable, weights = cpu.build(steps.mod, steps.weights, target, bits=4, codes=steps.codes)
    for b, q in written.items():
        name = re.sub(r"\W", "_", b) + "_dequantized"
        (panels,) = [a for n, a in weights.items() if n.startswith(name + "_q4panels")]
        unpacked = np.stack([panels & 15, panels >> 4], axis=-2)  # [n / nb, k / 8, nb, half, byte]
        nb = panels.shape[2]
        assert np.array_equal(unpacked.transpose(1, 3, 4, 0, 2).reshape(q.shape[1], q.shape[0]), q.T), b
        codes, scales, lowest = steps.codes[name]
        (got,) = [a for n, a in weights.items() if n == f"{name}_minimums{nb}"]
        assert got.dtype == lowest.dtype and np.array_equal(got.transpose(1, 0, 2).reshape(lowest.shape), lowest)
    runner = host_steps(steps, executable, weights)
    assert len(list(generate.generate(np, runner, PROMPTS[0], 8, generate.Sampler(np)))) == 8
    # a form edgeq does not read (8-bit codes, or g_idx) is named in one line
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "bits").i = 8
    with pytest.raises(ModelError, match=r"MatMulNBits .*\(bits=8\) cannot be imported; edgeq reads 4-bit"):
        decoder.expand_matmul_nbits(model, "tiny.onnx")
