"""``edgeq package`` of a decoder language model (``edgeq.llm.decoder.is_decoder``): its steps compiled for a
CPU profile, the tokenizer and the chat template carried, a greedy self-test recorded and checked against
ONNX Runtime on the model as exported, and the bundle written with the loaders' generation code.

The bundle is a regular one (manifest, checksums, signature, runtime/) whose manifest has a ``generate``
record (``contract.GenerateRecord``): run.py reads it and generates (``--prompt``); its golden file holds the
self-test's prompt ids and the greedy tokens after them.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from edgeq.errors import ModelError, UsageError

SELF_TEST_TEXT = "The capital of France is"
SELF_TEST_TOKENS = 16
DEFAULT_CONTEXT = 512
WEIGHT_BITS = {"fp32": None, "int8": 8, "int4": 4}  # weight-only: edgeq.llm.cpu.quantize_groups


def package_decoder(args, progress, check):
    """Package the decoder ``args.model`` (a ``PackageArgs``); ``check(args) -> Setup`` is the package job's check
    stage (the profile, its backend, the compilers, the output folder). Returns (setup, ``Written``)."""
    from edgeq.runtime.assemble import assemble

    if args.precision not in WEIGHT_BITS:
        raise UsageError(f"--precision {args.precision} is not available for language models; use fp32, or int8 or "
                         "int4 (weight-only)")
    bits = WEIGHT_BITS[args.precision]
    unused = [flag for flag, value in (("--calibrate", args.quantize), ("--postprocess", args.postprocess),
                                       ("--records", args.records), ("--golden-input", args.golden_input),
                                       ("--export-qdq", args.export_qdq), ("--preprocess", args.preprocess),
                                       ("--input-shape", args.input_shapes), ("--const", args.consts)) if value]
    if unused:
        raise UsageError(f"{unused[0]} is for image and tensor models; {Path(args.model).name} is a language model "
                         "(a decoder with a KV cache): leave it out")
    setup = None
    try:
        with progress.stage("check", f"device {args.device}, compilers, output folder"):
            setup = check(dataclasses.replace(args, precision="fp32"))  # (its precision checks are an image model's)
            if getattr(setup.backend, "build_decoder", None) is None:
                raise UsageError(f"language models are packaged for CPU profiles so far; {setup.profile.name}'s "
                                 f"{setup.backend.name.upper()} backend has no decoder build: use a CPU profile "
                                 "(jetson-orin-cpu for an Orin's CPU, or host)")
        with progress.stage("load", f"read {args.model} and its tokenizer"):
            loaded = load(args)
        with progress.stage("import", f"decoder -> prefill and decode steps, {loaded.context} tokens of context"):
            from edgeq.llm.build import import_steps

            steps = import_steps(loaded.model, loaded.context, name=Path(args.model).name)
        with progress.stage("compile", f"the steps for {setup.profile.name}"):
            library = setup.output.staging / "model.so"
            executable, weights = _compile(steps, setup, library, bits)
        with progress.stage("golden", "greedy tokens of the self-test prompt on the build host"):
            prompt = loaded.self_test_prompt
            tokens = _host_tokens(steps, setup, executable, weights, prompt, bits)
        with progress.stage("reference", "the tokens checked against ONNX Runtime on the model as exported"):
            reference = _reference_check(loaded.model, prompt, tokens, progress, bits)
        runtime = None
        if args.runtime != "none":
            with progress.stage("runtime", f"runtime/ for {setup.profile.cpu.arch}"):
                runtime = assemble(setup.profile, setup.backend, setup.toolchain.cxx, setup.output.staging,
                                   note=progress.note)
        with progress.stage("bundle", f"write {setup.output.out_dir / setup.bundle_name} and .tar.gz"):
            written = _write(args, setup, loaded, steps, weights, prompt, tokens, reference, runtime, progress, bits)
    except BaseException:
        if setup is not None and setup.output is not None and setup.output.created_out_dir:
            shutil.rmtree(setup.output.out_dir, ignore_errors=True)
        raise
    finally:
        if setup is not None and setup.output is not None:
            shutil.rmtree(setup.output.staging, ignore_errors=True)
    return setup, written


class Loaded:
    """The decoder, its tokenizer (parsed tokenizer.json, or None), the chat template's two halves and stop ids."""

    def __init__(self, model, path: Path, sha256: str, context: int, tokenizer_path: Path | None, tokenizer,
                 chat: tuple[str, str] | None, stop: list[int]):
        from edgeq.llm import decoder

        self.model, self.path, self.sha256, self.context = model, path, sha256, context
        self.layout = decoder.read_layout(model, path.name)
        self.tokenizer_path, self.tokenizer, self.chat, self.stop = tokenizer_path, tokenizer, chat, stop

    @property
    def self_test_prompt(self) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(SELF_TEST_TEXT)
        return [(7 * i + 1) % self.layout.vocab for i in range(6)]


def load(args) -> Loaded:
    import onnx

    from edgeq.llm import decoder

    path = Path(args.model)
    try:
        data = path.read_bytes()
        model = onnx.load_from_string(data)
    except Exception as err:  # noqa: BLE001 - unreadable or not ONNX: said in one line
        raise ModelError(f"cannot read {path}: {err}") from None
    layout = decoder.read_layout(model, path.name)
    context = args.max_context or DEFAULT_CONTEXT
    if not 32 <= context <= 32768:
        raise UsageError(f"--max-context {context}: give 32 to 32768 tokens")
    tokenizer_path = Path(args.tokenizer) if args.tokenizer else path.with_name("tokenizer.json")
    tokenizer = chat = None
    stop: list[int] = []
    if tokenizer_path.is_file():
        tokenizer, chat, stop = _tokenizer(tokenizer_path, layout.vocab)
    elif args.tokenizer:
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file")
    else:
        tokenizer_path = None
    return Loaded(model, path, hashlib.sha256(data).hexdigest(), context, tokenizer_path, tokenizer, chat, stop)


def _tokenizer(path: Path, vocab: int):
    """(Tokenizer, chat template halves or None, stop ids) of ``tokenizer.json`` and the files beside it that
    Hugging Face writes (tokenizer_config.json: eos_token, chat_template; chat_template.jinja)."""
    from edgeq.templates import tokenizer as tok

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read the tokenizer {path}: {err}") from None
    problem = tok.supported(data) if isinstance(data, dict) else "it is not a tokenizer.json object"
    if problem:
        raise UsageError(f"the tokenizer {path} is not supported: {problem}; package without it (--tokenizer of "
                         "another file, or none beside the model) and give token ids with run.py --prompt-ids")
    tokenizer = tok.Tokenizer(data)
    largest = max(tokenizer.by_id)
    if largest >= vocab:
        raise UsageError(f"the tokenizer {path} has token id {largest}, past the model's {vocab} logits: it is not "
                         "this model's tokenizer")
    config_path = path.with_name("tokenizer_config.json")
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError:
            config = {}
    template = config.get("chat_template")
    if path.with_name("chat_template.jinja").is_file():
        template = path.with_name("chat_template.jinja").read_text(encoding="utf-8")
    stop = []
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and eos in tokenizer.added:
        stop.append(tokenizer.added[eos])
    chat = _chat_halves(template, config) if isinstance(template, str) else None
    return tokenizer, chat, stop


def _chat_halves(template: str, config: dict) -> tuple[str, str] | None:
    """The chat template rendered around one user message: the text before it and after it (where the
    assistant's answer starts). None where the template does not render."""
    import jinja2

    marker = "\x00EDGEQ_MESSAGE\x00"
    try:
        text = jinja2.Environment().from_string(template).render(
            messages=[{"role": "user", "content": marker}], add_generation_prompt=True,
            bos_token=config.get("bos_token") or "", eos_token=config.get("eos_token") or "")
    except jinja2.TemplateError:
        return None
    if text.count(marker) != 1:
        return None
    before, after = text.split(marker)
    return before, after


def _compile(steps, setup, library: Path, bits: int | None):
    from edgeq.compile import export
    from edgeq.errors import ToolchainError
    from edgeq.runtime.elf import machine as elf_machine
    from edgeq.tvm_env import import_tvm

    import_tvm()
    executable, weights = setup.backend.build_decoder(steps.mod, steps.weights, setup.profile.tvm_target(), bits,
                                                      steps.codes)
    export(executable, library, setup.toolchain)
    machine = elf_machine(library)
    if machine != setup.profile.cpu.arch:
        raise ToolchainError(f"the exported library is {machine}, not {setup.profile.cpu.arch}; check the cross "
                             f"compiler {setup.toolchain.cxx}")
    return executable, weights


def host_steps(steps, executable, weights):
    """A ``generate.Steps`` of a host executable."""
    from edgeq.templates import generate
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm import relax

    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(executable, dev)
    lay = steps.layout
    return generate.VmSteps(np, tvm, vm, dev, [tvm.runtime.tensor(w, dev) for w in weights.values()],
                            [_step_json(s) for s in steps.steps], steps.context, lay.ids_dtype, lay.mask_dtype)


def _step_json(step) -> dict:
    return {"function": step.function, "kind": step.kind, "prompt": step.prompt, "capacity": step.capacity,
            "inputs": [name for name, _, _ in step.inputs]}


def _host_tokens(steps, setup, executable, weights, prompt: list[int], bits: int | None) -> list[int]:
    """The self-test's greedy tokens, computed on this machine (a host build of the steps for a cross target)."""
    from edgeq import backends
    from edgeq.targets import profiles
    from edgeq.templates import generate
    from edgeq.tvm_env import import_tvm

    if setup.profile.name != "host":
        import_tvm()
        host = profiles()["host"]
        executable, weights = backends.for_profile(host).build_decoder(steps.mod, steps.weights, host.tvm_target(),
                                                                       bits, steps.codes)
    runner = host_steps(steps, executable, weights)
    return list(generate.generate(np, runner, prompt, SELF_TEST_TOKENS, generate.Sampler(np)))


def _reference_check(model, prompt: list[int], tokens: list[int], progress, bits: int | None):
    """fp32: the tokens must equal ONNX Runtime's. Weight-only int8/int4 change the model, so their tokens are
    reported against it (how many agree before the first difference), not required to equal it; that the build
    computes its own quantized model right is what the self-test's recorded tokens hold on the device."""
    import onnxruntime

    from edgeq.llm.reference import Exported
    from edgeq.templates import contract

    want = Exported(model).greedy(prompt, len(tokens))
    if bits is not None:
        agree = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(tokens))
        progress.note(f"int{bits} weight-only: {agree} of {len(tokens)} greedy tokens equal ONNX Runtime fp32's "
                      "before the first difference")
        return contract.ReferenceCheck(
            reference=f"onnxruntime {onnxruntime.__version__}", graph="the model as exported, fp32",
            checked=f"the build's greedy tokens (int{bits} weight-only) on the self-test prompt",
            rtol=0.0, atol=0.0, atol_scaled_by="tokens compared", max_abs_diff=0.0,
            outputs=[{"output": "tokens", "count": len(tokens), "equal_before_first_difference": agree,
                      "ok": True}], result="not conclusive: a weight-only quantized model is compared, not required "
            "to agree", note=f"{agree}/{len(tokens)} tokens equal")
    same = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    if same is not None:
        raise ModelError(f"the build's greedy tokens differ from ONNX Runtime's on the model as exported at token "
                         f"{same} ({tokens[same]} against {want[same]}); nothing was written")
    progress.note(f"reference check passed: {len(tokens)} greedy tokens equal to ONNX Runtime's")
    return contract.ReferenceCheck(
        reference=f"onnxruntime {onnxruntime.__version__}", graph="the model as exported (symbolic lengths, cache "
        "grown by concatenation)", checked="the build's greedy tokens on the self-test prompt (host build)",
        rtol=0.0, atol=0.0, atol_scaled_by="tokens compared exactly", max_abs_diff=0.0,
        outputs=[{"output": "tokens", "count": len(tokens), "ok": True}], result="passed")


def _write(args, setup, loaded: Loaded, steps, weights: dict, prompt: list[int], tokens: list[int], reference,
           runtime, progress, bits: int | None):
    from edgeq import bundle
    from edgeq.backends.cpu import decoder as cpu_decoder
    from edgeq.runtime.assemble import check_elves
    from edgeq.runtime.elf import machine as elf_machine
    from edgeq.templates import contract, generate, tokenizer

    staging = setup.output.staging
    library = staging / contract.LIBRARY
    table = bundle.write_tensors(staging / contract.WEIGHTS, list(weights.items()))
    golden = bundle.write_tensors(staging / contract.GOLDEN, [("prompt", np.array(prompt, np.int64)),
                                                              ("tokens", np.array(tokens, np.int64))])
    extra = [contract.GENERATE, contract.TOKENIZER_PY]
    shutil.copyfile(generate.__file__, staging / contract.GENERATE)
    shutil.copyfile(tokenizer.__file__, staging / contract.TOKENIZER_PY)
    if loaded.tokenizer_path is not None:
        shutil.copyfile(loaded.tokenizer_path, staging / contract.TOKENIZER)
        extra.append(contract.TOKENIZER)
    extra += list(runtime.files) if runtime else []
    identity = bundle.identity_fields(setup, args.release, args.precision, [contract.LIBRARY, contract.WEIGHTS, *extra])
    lay = steps.layout
    decode = next(s for s in reversed(steps.steps) if s.kind == "decode")  # the largest capacity's
    inputs = [contract.TensorSpec(name=n, shape=list(shape), dtype=dtype) for n, shape, dtype in decode.inputs
              if not n.startswith("past_key_values.")]
    nbytes = int(sum(w.nbytes for w in weights.values()))
    manifest = contract.Manifest(
        **identity,
        model=contract.ModelRecord(file=loaded.path.name, sha256=loaded.sha256,
                                   opset=max((o.version for o in loaded.model.opset_import if o.domain in ("", "ai.onnx")),
                                             default=0),
                                   producer=f"{loaded.model.producer_name} {loaded.model.producer_version}".strip()),
        inputs=inputs,
        outputs=[contract.TensorSpec(name="logits", shape=[1, 1, lay.vocab], dtype="float32")],
        device=setup.profile.device_record(),
        toolchain=contract.ToolchainRecord.from_json(setup.toolchain.to_dict(), "toolchain"),
        library=contract.LibraryRecord(file=contract.LIBRARY, machine=elf_machine(library), cuda_device_code=[],
                                       bytes=library.stat().st_size),
        weights=contract.WeightsRecord(file=contract.WEIGHTS, format=contract.TENSOR_FORMAT, count=len(weights),
                                       dtypes=sorted({str(w.dtype) for w in weights.values()}), bytes=nbytes,
                                       file_bytes=(staging / contract.WEIGHTS).stat().st_size, tensors=table),
        golden=contract.GoldenRecord(file=contract.GOLDEN, format=contract.TENSOR_FORMAT, tensors=golden, seed=0,
                                     float_inputs="none: token ids", computed_with="host build, greedy",
                                     rtol=0.0, atol=0.0, atol_scaled_by="tokens compared exactly"),
        reference_check=reference,
        quantization=None,
        runtime=contract.RuntimeRecord.from_json(runtime.record, "runtime") if runtime else None,
        build={"args": {**args.to_dict(), "max_context": loaded.context}, "stage_seconds": dict(progress.seconds)},
        compatibility=check_elves(staging, [contract.LIBRARY, *runtime.files], setup.profile) if runtime else None,
        generate=contract.GenerateRecord(
            context=steps.context, steps=[contract.StepRecord(**_step_json(s)) for s in steps.steps],
            layers=lay.layers, kv_heads=lay.kv_heads, head_dim=lay.head_dim, vocab=lay.vocab,
            ids_dtype=lay.ids_dtype, mask_dtype=lay.mask_dtype or "int64", cache_dtype=lay.cache_dtype,
            tokenizer=contract.TOKENIZER if loaded.tokenizer_path is not None else None,
            chat_prefix=loaded.chat[0] if loaded.chat else None, chat_suffix=loaded.chat[1] if loaded.chat else None,
            stop=loaded.stop, self_test_tokens=len(tokens), weight_bits=bits,
            weight_group=cpu_decoder.GROUP if bits else None, weight_scheme=cpu_decoder.SCHEMES.get(bits),
            activation_bits=cpu_decoder.ACTIVATION_BITS.get(bits)),
        files={}, sizes={},
    )
    manifest = bundle.write_bundle(staging, manifest, extra, setup.signing_key)
    mtime = int(datetime.datetime.fromisoformat(identity["created"]).timestamp())
    return bundle.place(manifest, setup.output, setup.bundle_name, mtime, progress)
