#!/usr/bin/env python3
"""The Python loader of an edgeq bundle: checks, runs, self-tests and benchmarks the model in this folder.

    python3 run.py --check                  only check that this machine can run the bundle
    python3 run.py --self-test              run the golden input, compare with the outputs in the manifest
    python3 run.py --input NAME=x.npy [--output out.npz]
    python3 run.py --benchmark 100 [--warmup 10] [--json]
    python3 run.py --input VIDEO|/dev/videoN|csi://N|rtsp://...|gst:PIPELINE [--output out.mp4|DIR/] [--json]

Needs numpy and the TVM runtime (the apache-tvm version in manifest.json). Where Python has no TVM (or no
numpy), it hands over to the bundle's native loader runtime/edgeq-run, which takes the same flags and needs
nothing installed. On a CUDA 12 device (JetPack 6) it loads the bundle's CUDA bridge (runtime/libcudart.so.13)
before TVM, so a pip-installed apache-tvm (built for CUDA 13) reaches the GPU.

Before anything is loaded, safebundle.py (beside this file) checks the manifest's shape (contract.py) and
every file against its size and SHA-256; when this device trusts a signing key ($EDGEQ_TRUSTED_KEY, else
/etc/edgeq/trusted.pub), the manifest must carry a valid signature by it. A refusal is one line on stderr.
Exit status: 0 ok, 1 self-test failed, 2 usage, 4 this machine cannot run the bundle, 7 the bundle is damaged
or refused, 9 a video source failed, stopped or fell silent (130: Ctrl-C during a video, after its summary). Shipped as is in every bundle (the same file for all); the bundle's facts come from manifest.json.
"""

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # files in this folder are data: none may stand in for a module (json, numpy, tvm) imported below

import argparse  # noqa: E402
import ctypes  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_LOADER = os.path.join(HERE, "runtime", "edgeq-run")
MAX_RUNS = 1000000  # --benchmark / --warmup
TRUSTED_KEY = os.environ.get("EDGEQ_TRUSTED_KEY") or "/etc/edgeq/trusted.pub"
# TVM's thread pool assumes two hardware threads per core and, unless told, uses half the CPUs; inference
# gets every CPU this process may run on (set TVM_NUM_THREADS to choose).
THREADS_GIVEN = "TVM_NUM_THREADS" in os.environ
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
os.environ.setdefault("TVM_NUM_THREADS", str(CPUS))


def _sibling(name, module_name):
    """A module of this folder, by path: nothing else in the folder can stand in for it or for numpy/tvm."""
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(HERE, name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


sys.dont_write_bytecode = True  # importing the two modules below must not add __pycache__ to the bundle
safebundle = _sibling("safebundle.py", "edgeq_bundle_safebundle")
contract = safebundle.contract
imaging = _sibling("imaging.py", "edgeq_bundle_imaging")
video = _sibling("video.py", "edgeq_bundle_video")
Exit = contract.LoaderExit
MAX_INPUT_BYTES = int(os.environ.get("EDGEQ_MAX_INPUT_BYTES") or contract.MAX_INPUT_BYTES)  # one --input .npy


class LoaderError(Exception):
    """A refusal: ``str()`` is the one-line reason, ``status`` the exit status."""

    def __init__(self, message, status=Exit.DEVICE):
        super().__init__(message)
        self.status = status


BRIDGE_PROBLEM = []  # why the CUDA bridge cannot reach a CUDA 12 runtime, reported after the driver check


def load_cuda_bridge(manifest):
    """Give TVM's CUDA backend (linked to CUDA 13's libcudart.so.13) the device's CUDA 12 runtime through the
    bundle's bridge. Takes the verified manifest (the bridge is loaded only after every file's hash matched);
    must run before ``import tvm``; does nothing where the bundle has no bridge."""
    bridge = manifest.runtime.cuda_bridge if manifest.runtime else None
    if not bridge or manifest.device.arch != platform.machine():
        return
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)  # a CUDA 13 runtime of the device's own
        return
    except OSError:
        pass
    try:
        lib = ctypes.CDLL(os.path.join(HERE, str(bridge.get("file"))), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        BRIDGE_PROBLEM.append("cannot load the bundle's CUDA bridge: %s" % err)
        return
    lib.edgeq_cudart_bridge_error.restype = ctypes.c_char_p
    problem = lib.edgeq_cudart_bridge_error()
    if problem:
        BRIDGE_PROBLEM.append(problem.decode("utf-8", "replace"))


def hand_over(argv, missing):
    """No TVM (or numpy) for this Python: run the bundle with its native loader, which checks everything itself."""
    if not os.path.isfile(NATIVE_LOADER):
        raise LoaderError("this Python has no %s and the bundle carries no runtime (packaged with --runtime none); "
                          "pip install numpy and the apache-tvm version manifest.json names" % missing)
    sys.stdout.flush()
    try:
        os.execv(NATIVE_LOADER, [NATIVE_LOADER, "--bundle", HERE] + list(argv))
    except OSError as err:  # another machine's binary (ENOEXEC), or not executable here
        import platform

        arch = verified_manifest().device.arch
        raise LoaderError("this Python has no %s, and the bundle's native loader cannot run here (%s): the bundle is "
                          "for %s, this machine is %s" % (missing, err.strerror or err, arch, platform.machine()),
                          Exit.DEVICE)


def verified_manifest(verify=True):
    """The manifest checked by safebundle.py (signature where a key is trusted, every file's size and hash),
    and the CUDA bridge loaded: all before TVM. Files the manifest does not list are ignored: nothing loads them."""
    try:
        key = safebundle.load_public_key(TRUSTED_KEY) if os.path.exists(TRUSTED_KEY) else None
        if verify:
            manifest = safebundle.verify_dir(HERE, key, extra_files=True)
        else:
            with open(os.path.join(HERE, contract.MANIFEST), "rb") as f:
                manifest = safebundle.parse_manifest(f.read(safebundle.MAX_MANIFEST_BYTES + 1))
    except safebundle.BundleRefused as err:
        raise LoaderError(str(err), Exit.BUNDLE)
    except OSError as err:
        raise LoaderError("cannot read the bundle: %s" % (err.strerror or err), Exit.BUNDLE)
    load_cuda_bridge(manifest)
    return manifest


def cuda_driver_version():
    """(major, minor) of the installed CUDA driver, or None when there is none."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
        return version.value // 1000, (version.value % 1000) // 10
    except (OSError, AttributeError):
        return None


def check_machine(manifest, tvm):
    """Refuse, with one reason, a machine this bundle cannot run on. Runs before the library is loaded."""
    device = manifest.device
    machine = platform.machine()
    if machine != device.arch:
        raise LoaderError("this bundle is for %s (%s) but this machine is %s" % (device.arch, device.profile, machine))
    if tvm.__version__.split(".")[:2] != manifest.tvm_version.split(".")[:2]:
        raise LoaderError("this bundle was built with TVM %s but the runtime here is %s; install apache-tvm==%s"
                          % (manifest.tvm_version, tvm.__version__, manifest.tvm_version))
    if not device.cuda_arch:
        return tvm.cpu(0)
    toolkit = manifest.toolchain.cuda_toolkit
    driver = cuda_driver_version()
    if driver is None:
        raise LoaderError("this bundle needs a CUDA GPU (%s) but no CUDA driver was found" % device.cuda_arch)
    if toolkit is not None and driver[0] < toolkit.major:
        raise LoaderError("this bundle was built with CUDA %s but the driver here is CUDA %d.%d; it needs a CUDA %d.x "
                          "driver or newer" % (toolkit.version, driver[0], driver[1], toolkit.major))
    if BRIDGE_PROBLEM:
        raise LoaderError(BRIDGE_PROBLEM[0])
    if not tvm.runtime.enabled("cuda"):
        raise LoaderError("the TVM runtime here is built without CUDA; install a CUDA-enabled TVM runtime")
    dev = tvm.cuda(0)
    if not dev.exist:
        raise LoaderError("this bundle needs a CUDA GPU (%s) but none is visible" % device.cuda_arch)
    have_arch = "sm_" + dev.compute_version.replace(".", "")
    if have_arch != device.cuda_arch:
        raise LoaderError("this bundle carries code for %s but the GPU here is %s" % (device.cuda_arch, have_arch))
    return dev


def read_tensor(np, name, entry):
    """One array of an edgeq-raw-1 file (little-endian, C order, at the manifest's offset)."""
    dtype = np.dtype(entry.dtype).newbyteorder("<")
    count = int(np.prod(entry.shape, dtype=np.int64))
    flat = np.fromfile(os.path.join(HERE, name), dtype=dtype, count=count, offset=entry.offset)
    if flat.size != count:
        raise LoaderError("bundle file %s is shorter than the manifest says" % name, Exit.BUNDLE)
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(entry.shape)


def _straight(lib):
    """Whether the VM program runs straight through: no branch instruction in its text (TVM's
    ``Executable::AsText``: ``If`` and ``goto``). False where the text cannot be had."""
    try:
        text = lib["as_text"]()
    except Exception:  # noqa: BLE001 - a runtime without it: treated as branching
        return False
    return not any(line.split(None, 1)[0] in ("If", "goto") for line in text.splitlines() if line.strip())


def _address(tensor):
    try:
        return tensor.data_ptr()
    except Exception:  # noqa: BLE001 - an older runtime: no address, no sharing
        return None


def _view(np, tensor):
    """A numpy array sharing ``tensor``'s storage (DLPack), or None where numpy cannot take it."""
    try:
        return np.from_dlpack(tensor)
    except Exception:  # noqa: BLE001 - numpy without DLPack, a dtype it lacks (bfloat16): copied instead
        return None


class Model:
    """The bundle's model, loaded: ``Model().run({name: array})`` returns ``{output name: array}``."""

    def __init__(self, manifest=None, verify=True):
        """``manifest``: one already checked by ``verified_manifest``; else it is done here."""
        self.manifest = manifest or verified_manifest(verify)
        import numpy as np
        import tvm
        from tvm.runtime.vm import VirtualMachine

        self.np = np
        self.tvm = tvm
        self.dev = check_machine(self.manifest, tvm)
        lib = tvm.runtime.load_module(os.path.join(HERE, self.manifest.library.file))
        self.vm = VirtualMachine(lib, self.dev)
        weights = self.manifest.weights
        problem = contract.argument_count_problem(self.vm._get_function_arity("main"), self.manifest)
        if problem:
            raise LoaderError(problem, Exit.BUNDLE)
        self.params = [tvm.runtime.tensor(read_tensor(np, weights.file, t), self.dev) for t in weights.tensors]
        # input name -> the device tensor its values are copied into, allocated once: a fresh one per call
        # cost a page-faulting allocation each time (40 us of MNASNet's 1.2 ms on a 2-core x86)
        self.staged = {}
        # Model.arrays: which results are allocated afresh by each call (None: not learnt yet)
        self.fresh, self.probe = None, None
        # (read on the CPU only: only there are results handed over without a copy)
        self.straight = self.dev.dlpack_device_type() == 1 and _straight(lib)  # kDLCPU

    def arguments(self, inputs):
        np = self.np
        specs = self.manifest.inputs
        args = []
        for spec in specs:
            if spec.name not in inputs:
                raise LoaderError("input '%s' is missing; the model's inputs are: %s"
                                  % (spec.name, ", ".join(s.name for s in specs)), Exit.USAGE)
            array = np.asarray(inputs[spec.name])
            if list(array.shape) != spec.shape or str(array.dtype) != spec.dtype:
                raise LoaderError("input '%s' must be %s %s, got %s %s" % (
                    spec.name, spec.dtype, "x".join(map(str, spec.shape)), array.dtype,
                    "x".join(map(str, array.shape))), Exit.USAGE)
            staged = self.staged.get(spec.name)
            if staged is None:
                staged = self.staged[spec.name] = self.tvm.runtime.empty(spec.shape, spec.dtype, self.dev)
            staged.copyfrom(np.require(array, requirements="C"))
            args.append(staged)
        unknown = set(inputs) - {s.name for s in specs}
        if unknown:
            raise LoaderError("unknown input(s): %s" % ", ".join(sorted(unknown)), Exit.USAGE)
        return args + self.params

    def run(self, inputs):
        args = self.arguments(inputs)
        try:
            result = self.vm["main"](*args)
        except Exception as err:  # noqa: BLE001 - TVM raises by its error's kind; edgeq-run refuses the same way
            line = (str(err).strip().splitlines() or [""])[0]
            raise LoaderError("running the model failed: %s: %s" % (type(err).__name__, line), Exit.BUNDLE)
        results = [result] if isinstance(result, self.tvm.runtime.Tensor) else list(result)
        specs = self.manifest.outputs
        if len(results) != len(specs):
            raise LoaderError("the model returned %d outputs, the manifest lists %d" % (len(results), len(specs)),
                              Exit.BUNDLE)
        for spec, r in zip(specs, results):
            problem = contract.output_problem(spec, str(r.dtype), r.shape)
            if problem:
                raise LoaderError(problem, Exit.BUNDLE)
        return {spec.name: array for spec, array in zip(specs, self.arrays(results))}

    def arrays(self, results):
        """The VM's results as numpy arrays. Copying one costs what a layer does (LR-ASPP's 1x21x224x224 map,
        4.2 MB: 0.45 ms of a 5.1 ms run on a 2-core x86), so a result the VM allocated for this call is handed
        over as it is: the array shares its storage, which lives as long as the array does. A result whose
        storage outlives the call (a constant, a weight, the staged input, or a view of one), and one that
        shares storage with another result, is copied: written into, it would change the next call's
        results. Which results are fresh is learnt from the first two calls, the first one's results held
        so that the second cannot be given their storage: a fresh result has another address each time. A
        GPU bundle's results and a program with branches (where a result may be fresh in one call and a
        constant in the next) are always copied."""
        if self.fresh is None and self.probe is None:  # the first call
            if self.straight:
                self.probe = results
            else:
                self.fresh = [False] * len(results)
            return [r.numpy() for r in results]
        if self.fresh is None:  # the second
            self.fresh = [_address(r) != _address(p) for r, p in zip(results, self.probe)]
            self.probe = None
        arrays, spans = [], []  # spans: the bytes of the results handed over so far
        for r, fresh in zip(results, self.fresh):
            view = _view(self.np, r) if fresh else None
            if view is not None and view.nbytes:
                start, end = view.ctypes.data, view.ctypes.data + view.nbytes
                if any(a < end and start < b for a, b in spans):
                    view = None  # a view of another result
                else:
                    spans.append((start, end))
            arrays.append(r.numpy() if view is None else view)
        return arrays

    def benchmark(self, inputs, repeat, warmup):
        """``contract.latency_statistics`` of ``repeat`` timed runs after ``warmup``, and the runs themselves."""
        args = self.arguments(inputs)
        for _ in range(warmup):
            self.vm["main"](*args)
        self.dev.sync()
        timer = self.vm.time_evaluator("main", self.dev, number=1, repeat=repeat)
        samples = [t * 1e3 for t in timer(*args).results]
        stats = contract.latency_statistics(samples, self.manifest.batch)
        return dict(stats, warmup=warmup, samples_ms=[contract.significant(t) for t in samples])


def golden_problem(manifest):
    """What keeps the golden table from testing the model, or None: an input or output without its entry, or an
    input's entry not as the model takes it (edgeq-run's GoldenProblem: the same, in the same order)."""
    entries = {t.name: t for t in manifest.golden.tensors}
    for kind, specs in (("input", manifest.inputs), ("output", manifest.outputs)):
        for spec in specs:
            key = "%s:%s" % (kind, spec.name)
            entry = entries.get(key)
            if entry is None:
                return "the golden file has no %s; package the bundle again" % key
            if kind == "input" and (entry.shape != spec.shape or entry.dtype != spec.dtype):
                return "the golden file's %s is %s %s, not %s %s as the model takes it" % (
                    key, entry.dtype, "x".join(map(str, entry.shape)), spec.dtype, "x".join(map(str, spec.shape)))
    return None


def self_test(model):
    np = model.np
    golden = model.manifest.golden
    problem = golden_problem(model.manifest)
    if problem:
        raise LoaderError(problem, Exit.BUNDLE)
    arrays = {t.name: read_tensor(np, golden.file, t) for t in golden.tensors}
    inputs = {s.name: arrays["input:" + s.name] for s in model.manifest.inputs}
    expected = {s.name: arrays["output:" + s.name] for s in model.manifest.outputs}
    outputs = model.run(inputs)
    report, ok = [], True
    for name, want in expected.items():
        got = outputs[name]
        atol = golden.tolerance(float(np.max(np.abs(want))) if want.size else 1.0)
        outside = 0
        if got.shape == want.shape:  # values outside the tolerance: golden.outliers of them may be (an unstable int8 graph)
            outside = int(np.count_nonzero(~np.isclose(got, want, rtol=golden.rtol, atol=atol, equal_nan=True)))
        close = got.shape == want.shape and outside <= golden.allowed_outside(want.size)
        diff = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else float("inf")
        row = {"output": name, "max_abs_diff": float("%.4g" % diff), "rtol": golden.rtol,
               "atol": float("%.4g" % atol), "ok": close}
        if golden.outliers:
            row.update(outside=outside, allowed=golden.allowed_outside(want.size))
        report.append(row)
        ok = ok and close
    return ok, report


class LanguageModel:
    """A language-model bundle, loaded: its steps on the device (``generate.VmSteps``) and its tokenizer (or None)."""

    def __init__(self, manifest, tvm):
        import numpy as np
        from tvm.runtime.vm import VirtualMachine

        generate = _sibling(contract.GENERATE, "edgeq_bundle_generate")
        self.manifest, self.np, self.generate = manifest, np, generate
        spec = manifest.generate
        dev = check_machine(manifest, tvm)
        vm = VirtualMachine(tvm.runtime.load_module(os.path.join(HERE, manifest.library.file)), dev)
        params = [tvm.runtime.tensor(read_tensor(np, manifest.weights.file, t), dev) for t in manifest.weights.tensors]
        self.steps = generate.VmSteps(np, tvm, vm, dev, params, [s.to_json() for s in spec.steps], spec.context,
                                      spec.ids_dtype, spec.mask_dtype)
        self.tokenizer = self.read_tokenizer(manifest)

    @staticmethod
    def read_tokenizer(manifest):
        """The bundle's tokenizer (tokenizer.py), or None where it was packaged without one."""
        spec = manifest.generate
        if not spec.tokenizer:
            return None
        tokenizer = _sibling(contract.TOKENIZER_PY, "edgeq_bundle_tokenizer")
        try:
            return tokenizer.Tokenizer.from_file(os.path.join(HERE, spec.tokenizer))
        except (OSError, ValueError, KeyError) as err:
            raise LoaderError("the bundle's tokenizer cannot be read (%s); package the bundle again" % err,
                              Exit.BUNDLE)

    def tokens(self, prompt, max_tokens, sampler, stop=()):
        """The generated token ids, one at a time (``generate.generate``); a prompt past the context is refused."""
        vocab = self.manifest.generate.vocab
        if any(t >= vocab for t in prompt):
            raise LoaderError("prompt token id %d is outside the vocabulary (0..%d)" % (max(prompt), vocab - 1),
                              Exit.USAGE)
        try:
            for token in self.generate.generate(self.np, self.steps, prompt, max_tokens, sampler, stop):
                yield token
        except self.generate.ContextFull as err:
            raise LoaderError("%s; give a shorter prompt, or package with a larger --max-context" % err, Exit.USAGE)


def prompt_text(text, flag):
    """A prompt as text: bytes that are not UTF-8 (they reach Python as lone surrogates) are refused, as edgeq-run
    refuses them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise LoaderError("%s is not UTF-8 text (byte %d)" % (flag, len(text[:err.start].encode("utf-8", "surrogateescape"))),
                          Exit.USAGE)
    return text


def language_self_test(model):
    """The recorded prompt's greedy tokens, compared exactly with those recorded at build time."""
    np = model.np
    golden = model.manifest.golden
    arrays = {t.name: read_tensor(np, golden.file, t) for t in golden.tensors}
    if "prompt" not in arrays or "tokens" not in arrays:
        raise LoaderError("the golden file has no prompt and tokens; package the bundle again", Exit.BUNDLE)
    want = [int(t) for t in arrays["tokens"]]
    got = list(model.tokens([int(t) for t in arrays["prompt"]], len(want), model.generate.Sampler(np)))
    matched = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    ok = got == want
    return ok, [{"output": "tokens", "count": len(want), "matched": matched, "ok": ok}]


def run_language_model(manifest, tvm, args):
    import time

    if args.input or args.benchmark:
        raise LoaderError("this bundle is a language model: give --prompt TEXT (or --prompt-ids) and --max-tokens N; "
                          "--json reports tokens per second", Exit.USAGE)
    if args.tokenize is not None:  # the text's token ids, without running the model
        tokenizer = LanguageModel.read_tokenizer(manifest)
        if tokenizer is None:
            raise LoaderError("this bundle has no tokenizer (packaged without tokenizer.json)", Exit.USAGE)
        ids = tokenizer.encode(prompt_text(args.tokenize, "--tokenize"))
        print(json.dumps({"ids": ids}) if args.json else json.dumps(ids))
        return Exit.OK
    model = LanguageModel(manifest, tvm)
    if args.self_test:
        ok, report = language_self_test(model)
        report_self_test(ok, report, args.json)
        if not ok:
            return Exit.SELF_TEST_FAILED
    if args.prompt is None and args.prompt_ids is None:
        return Exit.OK
    spec = manifest.generate
    tokenizer = model.tokenizer
    if args.prompt is not None:
        if tokenizer is None:
            raise LoaderError("this bundle has no tokenizer (packaged without tokenizer.json): give --prompt-ids",
                              Exit.USAGE)
        text = prompt_text(args.prompt, "--prompt")
        if args.chat:
            if spec.chat_prefix is None:
                raise LoaderError("this bundle has no chat template: leave out --chat", Exit.USAGE)
            text = spec.chat_prefix + text + spec.chat_suffix
        prompt = tokenizer.encode(text)
    else:
        if args.chat:
            raise LoaderError("--chat wraps a --prompt TEXT; --prompt-ids are taken as they are", Exit.USAGE)
        prompt = list(args.prompt_ids)
    sampler = model.generate.Sampler(model.np, args.temperature, args.top_p, args.seed)
    decoder = sys.modules["edgeq_bundle_tokenizer"].Decoder(tokenizer) if tokenizer is not None else None
    start = time.perf_counter()
    first = None
    generated = []
    out = sys.stdout
    stop = set() if args.ignore_eos else set(spec.stop)
    for token in model.tokens(prompt, args.max_tokens, sampler, stop):
        if first is None:
            first = time.perf_counter()
        generated.append(token)
        text = decoder.push(token) if decoder is not None else None
        if args.json:
            out.write(json.dumps({"token": token, "text": text}) + "\n")
        elif text is not None:
            out.write(text)
        else:
            out.write("%d " % token)
        out.flush()
    end = time.perf_counter()
    tail = decoder.flush() if decoder is not None else ""
    decode_tokens = len(generated) - 1
    summary = {"prompt_tokens": len(prompt), "tokens": len(generated),
               "stopped": "stop token" if generated and generated[-1] in stop else
               ("context full" if len(prompt) + len(generated) >= spec.context else "max tokens"),
               "first_token_ms": round((first - start) * 1e3, 2),
               "decode_tokens_per_s": round(decode_tokens / (end - first), 2) if decode_tokens > 0 else None}
    if args.json:
        if tail:
            out.write(json.dumps({"token": None, "text": tail}) + "\n")
        out.write(json.dumps({"summary": summary}) + "\n")
    else:
        out.write(tail + "\n")
        print("[%d prompt tokens, %d generated (%s); first token %.1f ms, %s tokens/s]" % (
            summary["prompt_tokens"], summary["tokens"], summary["stopped"], summary["first_token_ms"],
            summary["decode_tokens_per_s"]), file=sys.stderr)
    return Exit.OK


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Run the edgeq bundle in %s." % HERE)
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy|IMAGE|VIDEO",
                        help="an input array (.npy); repeat for each model input; or a PNG/JPEG image, prepared as the "
                             "bundle was packaged (--preprocess); or a video source: a file (.mp4, .mkv, .avi), a camera "
                             "(/dev/videoN, csi://N), a stream (rtsp://...) or gst:PIPELINE ending in appsink")
    parser.add_argument("--output", metavar="FILE.npz|DIR", help="where to write the outputs: a .npz, or a folder of NAME.npy "
                        "(default: print a summary); for a video, a video file (.mp4, .mkv, .avi, .mov) or a folder of "
                        "PNG frames, the answers drawn")
    parser.add_argument("--self-test", action="store_true", help="run the golden input and compare with the manifest")
    parser.add_argument("--benchmark", type=int, metavar="N", help="time N inferences after warm-up")
    parser.add_argument("--warmup", type=int, default=10, metavar="N", help="warm-up runs before --benchmark (default 10)")
    parser.add_argument("--check", action="store_true", help="only check that this machine can run the bundle")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--timeout", type=float, default=video.DEFAULT_TIMEOUT_S, metavar="S",
                        help="a video source that delivers no frame for S seconds ends the run (default %g)"
                        % video.DEFAULT_TIMEOUT_S)
    parser.add_argument("--prompt", metavar="TEXT", help="language models: generate after TEXT, streaming the tokens")
    parser.add_argument("--prompt-ids", metavar="ID,ID,...", help="language models: the prompt as token ids")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="language models: tokens to generate at most (default 128)")
    parser.add_argument("--chat", action="store_true",
                        help="language models: wrap the prompt in the model's chat template (one user message)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="language models: sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="language models: sample from the most likely tokens whose probability reaches P (default 1)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="language models: the sampler's seed (default 0)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="language models: go on past the end-of-answer token (to time --max-tokens tokens)")
    parser.add_argument("--tokenize", metavar="TEXT", help="language models: print TEXT's token ids (the model is not run)")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="video: decode, prepare, infer and answer one frame after the other (default: the next "
                             "frames are decoded and prepared while the model runs)")
    args = parser.parse_args(argv)
    if not 0 < args.timeout <= 3600:
        parser.error("--timeout needs seconds from 0 to 3600")
    if args.benchmark is not None and not 1 <= args.benchmark <= MAX_RUNS:
        parser.error("--benchmark needs N from 1 to %d" % MAX_RUNS)
    if not 0 <= args.warmup <= MAX_RUNS:
        parser.error("--warmup needs N from 0 to %d" % MAX_RUNS)
    if not 1 <= args.max_tokens <= MAX_RUNS:
        parser.error("--max-tokens needs N from 1 to %d" % MAX_RUNS)
    if not 0 <= args.temperature <= 100:
        parser.error("--temperature needs T from 0 to 100")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p needs P above 0 and at most 1")
    if not 0 <= args.seed < 1 << 64:
        parser.error("--seed needs S from 0 to %d" % ((1 << 64) - 1))
    if args.prompt is not None and args.prompt_ids is not None:
        parser.error("give --prompt or --prompt-ids, not both")
    if args.prompt_ids is not None:
        try:
            args.prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            parser.error("--prompt-ids needs token ids separated by commas, e.g. 1,504,3458")
        if not args.prompt_ids or min(args.prompt_ids) < 0:
            parser.error("--prompt-ids needs at least one token id, none negative")
    prompted = args.prompt is not None or args.prompt_ids is not None or args.tokenize is not None
    if not (args.self_test or args.benchmark or args.check or args.input or prompted):
        parser.error("give --self-test, --benchmark N, --check or --input NAME=FILE.npy")  # (edgeq-run's words)
    return args


def is_image(path):
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return False
    return imaging.is_image(head)


def read_image(np, name, path, manifest):
    """An image made into the input tensor exactly as the bundle was calibrated (imaging.image_tensor)."""
    pre = manifest.preprocess
    if pre is None:
        raise LoaderError("--input %s is an image, and this bundle was packaged without --preprocess: give "
                          "NAME=FILE.npy, or package it with --preprocess" % path, Exit.USAGE)
    if name is not None and name != pre.input:
        raise LoaderError("--input %s=%s: images go to input '%s' (--preprocess)" % (name, path, pre.input), Exit.USAGE)
    try:
        pixels = imaging.decode_image(np, path)
        return pre.input, imaging.image_tensor(np, pixels, pre), pixels.shape[:2]
    except (imaging.ImageError, OSError) as err:
        raise LoaderError(str(err).splitlines()[0] if str(err) else type(err).__name__, Exit.USAGE)


def read_inputs(specs, manifest=None):
    """{input name: array}, and the (height, width) of the image given, if one was."""
    import numpy as np

    inputs, image_hw = {}, None
    for spec in specs:
        name, sep, path = spec.partition("=")
        given = path if sep else spec
        if os.path.exists(given) and not os.path.isfile(given):
            # a FIFO, a device or a folder is never opened (a FIFO with no writer would block); edgeq-run says the same
            raise LoaderError("--input %s is not a regular file" % given, Exit.USAGE)
        if not sep or is_image(path):
            key, value, image_hw = read_image(np, name if sep else None, path if sep else spec, manifest)
            inputs[key] = value
            continue
        try:
            with open(path, "rb") as f:  # read as edgeq-run reads it (contract.read_npy): the size bounded first
                dtype, shape, data, fortran = contract.read_npy(f, MAX_INPUT_BYTES)
        except OSError as err:
            raise LoaderError("cannot read --input %s: %s" % (spec, err.strerror or err), Exit.USAGE)
        except contract.ContractError as err:
            raise LoaderError("cannot read --input %s: %s" % (spec, err), Exit.USAGE)
        array = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
        array = array.reshape(shape[::-1]).transpose() if fortran else array.reshape(shape)
        inputs[name] = np.array(array, dtype=dtype, order="C")
    return inputs, image_hw


def report_self_test(ok, report, as_json):
    if as_json:
        print(json.dumps({"ok": ok, "outputs": report}))
        return
    for row in report:
        if "matched" in row:  # a language model's tokens
            print("%-4s %s: %d of %d recorded greedy tokens matched in order" % (
                "ok" if row["ok"] else "FAIL", row["output"], row["matched"], row["count"]))
            continue
        print("%-4s %s: max |diff| %.3g (rtol %g, atol %.3g)" % (
            "ok" if row["ok"] else "FAIL", row["output"], row["max_abs_diff"], row["rtol"], row["atol"]))
    print("self-test %s" % ("passed" if ok else "FAILED"))


def safe_file_name(name):
    """An output's file name in an --output folder: what edgeq-run's SafeFileName makes of it."""
    out = "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "_" for c in name)
    return "_" + out if not out or out[0] == "." else out


def write_file_atomic(path, write):
    """``write(file)`` into a new file beside ``path`` (never through a link left under the temporary name),
    renamed over ``path``: a link at ``path`` is replaced, not followed (as edgeq-run writes)."""
    tmp = "%s.tmp%d" % (path, os.getpid())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        if os.path.lexists(tmp) and not os.path.islink(tmp):
            os.unlink(tmp)
        raise LoaderError("cannot write %s: %s" % (path, err.strerror or err), Exit.USAGE)


def output_folder(output):
    """The --output folder, made if missing, never a symbolic link (the loader often runs as root: no writes
    through links)."""
    folder = output.rstrip("/") or "/"
    if os.path.islink(folder):
        raise LoaderError("--output %s is a symbolic link; give the folder it points to" % output, Exit.USAGE)
    if not os.path.isdir(folder):
        try:
            os.mkdir(folder, 0o755)
        except OSError as err:
            raise LoaderError("cannot make the output folder %s: %s" % (output, err.strerror or err), Exit.USAGE)
    return folder


def write_outputs(np, output, outputs):
    """FILE.npz: one archive; anything else: a folder (made if missing, never a symbolic link) of NAME.npy."""
    if output.endswith(".npz"):
        write_file_atomic(output, lambda f: np.savez(f, **outputs))
        return
    folder = output_folder(output)
    for name, value in outputs.items():
        write_file_atomic(os.path.join(folder, safe_file_name(name) + ".npy"), lambda f, v=value: np.save(f, v))


def answer(model, outputs, image_hw):
    """("top" | "detections", rows) of the bundle's --postprocess, or None."""
    post = model.manifest.postprocess
    if post is None:
        return None
    if post.kind == "classify":
        return "top", imaging.classify(model.np, outputs[post.output], post)
    selected = next(s for s in model.manifest.outputs if s.name == post.selected)
    return "detections", imaging.yolo(model.np, outputs, post, selected.real_rows(outputs), model.manifest.preprocess,
                                       image_hw)


def run_inputs(model, inputs, args, image_hw=None):
    outputs = model.run(inputs)
    real = {spec.name: spec.real_rows(outputs) for spec in model.manifest.outputs}  # padded outputs: rows counted
    try:
        found = answer(model, outputs, image_hw)
    except imaging.ImageError as err:  # a selected row outside the head
        raise LoaderError(str(err), Exit.BUNDLE)
    if args.output:  # written once the answer is made: a bundle refused while making it leaves no file
        write_outputs(model.np, args.output, outputs)
    if args.json:
        summary = {}
        for k, v in outputs.items():
            summary[k] = {"shape": list(v.shape), "dtype": str(v.dtype)}
            if real.get(k) is not None:
                summary[k]["rows"] = real[k]
        print(json.dumps(summary if found is None else {found[0]: found[1], "outputs": summary}))
    elif found is not None:
        print(imaging.describe_top(found[1]) if found[0] == "top" else imaging.describe_detections(found[1]))
    elif not args.output:
        for name, value in outputs.items():
            print("%s: %s %s%s" % (name, value.dtype, "x".join(map(str, value.shape)),
                                   "" if real.get(name) is None else " (%d real rows)" % real[name]))

def write_png(path, pixels):
    """An 8-bit RGB PNG of ``pixels`` (numpy uint8 [H, W, 3]), written atomically."""
    import struct
    import zlib

    h, w = pixels.shape[:2]

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\0" + pixels[y].tobytes() for y in range(h))
    data = (imaging.PNG_MAGIC + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    write_file_atomic(path, lambda f: f.write(data))


def frame_folder(output):
    """The --output folder of a video run (made if missing, never a link); None without --output."""
    if not output:
        return None
    if output.endswith((".npz", ".npy")):
        raise LoaderError("--output %s: a video's answers are drawn on its frames: give a video file (%s) or a folder "
                          "for PNG frames (DIR/)" % (output, ", ".join(sorted(video.VIDEO_MUXERS))), Exit.USAGE)
    return output_folder(output)


QUEUE_FRAMES = 4  # frames decoded and prepared ahead of the model


def run_stream(model, spec, args):
    """Every frame of a video source through the image path's preprocessing, the model and its answer: one line
    (or JSON line) per frame, then the frames, frames per second, drops and per-stage p50/p99. Pipelined: a
    thread decodes and prepares the next frames while the model runs, through a queue of QUEUE_FRAMES; a live
    source drops the oldest queued frame when the model falls behind (counted), a file never drops one."""
    import threading

    np = model.np
    pre = model.manifest.preprocess
    if pre is None:
        raise LoaderError("--input %s is a video, and this bundle was packaged without --preprocess: package it with "
                          "--preprocess" % spec, Exit.USAGE)
    to_video = bool(args.output) and os.path.splitext(args.output)[1].lower() in video.VIDEO_MUXERS
    folder = None if to_video else frame_folder(args.output)
    start = video.now()
    try:
        source = video.Source(spec, args.timeout)
        writer = video.Writer(args.output, video.gstreamer().have) if to_video else None
    except video.VideoError as err:
        raise LoaderError(str(err), Exit.USAGE)
    times = video.StageTimes()
    state = {"dropped": 0, "answered": 0, "error": None, "done": False, "stop": False}
    queue, cond = [], threading.Condition()

    def next_frame(index):
        t0 = video.now()
        frame = source.read(np)
        t1 = video.now()
        if frame is None:
            return None
        pixels, pts = frame
        tensor = imaging.image_tensor(np, pixels, pre)
        times.add("decode", t1 - t0)
        times.add("preprocess", video.now() - t1)
        return index, pts, pixels, tensor

    def produce():
        index = 0
        try:
            while not state["stop"]:
                item = next_frame(index)
                if item is None:
                    break
                index += 1
                with cond:
                    while len(queue) >= QUEUE_FRAMES and not source.live and not state["stop"]:
                        cond.wait()
                    if len(queue) >= QUEUE_FRAMES:  # live: the oldest frame goes
                        queue.pop(0)
                        state["dropped"] += 1
                    queue.append(item)
                    cond.notify_all()
        except video.VideoError as err:
            state["error"] = err
        finally:
            with cond:
                state["done"] = True
                cond.notify_all()

    def answer_frame(item):
        index, pts, pixels, tensor = item
        t0 = video.now()
        outputs = model.run({pre.input: tensor})
        t1 = video.now()
        try:
            found = answer(model, outputs, pixels.shape[:2])
        except imaging.ImageError as err:
            raise LoaderError(str(err), Exit.BUNDLE)
        if folder is not None or writer is not None:
            drawn = imaging.draw_detections(np, pixels, found[1]) if found and found[0] == "detections" else pixels
            if folder is not None:
                write_png(os.path.join(folder, "frame_%06d.png" % index), drawn)
            else:
                try:
                    writer.write(np, drawn, pts, source.rate)
                except video.VideoError as err:
                    raise LoaderError(str(err), Exit.USAGE)
        times.add("postprocess", video.now() - t1)
        times.add("infer", t1 - t0)
        state["answered"] += 1
        when = None if pts is None else round(pts, 6)
        if args.json:
            row = {"frame": index, "time": when}
            if found is None:
                row["outputs"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outputs.items()}
            else:
                row[found[0]] = found[1]
            print(json.dumps(row))
        else:
            text = ("" if found is None else imaging.describe_top(found[1]) if found[0] == "top"
                    else imaging.describe_detections(found[1]))
            print("frame %d%s" % (index, "" if when is None else " at %.3f s" % when))
            if text:
                print("\n".join("  " + line for line in text.splitlines()))
        sys.stdout.flush()

    # Ctrl-C stops the run at the next frame through a flag, not an exception: a KeyboardInterrupt raised between a
    # lock's acquire and its with-block (CPython checks signals there) left the queue's lock held, and the decoding
    # thread waiting on it forever (seen once in CI: run.py did not exit). A second Ctrl-C interrupts at once.
    import signal

    asked = []

    def on_interrupt(signum, frame):
        asked.append(signum)
        state["stop"] = source.cancel = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_interrupt) if main_thread else None
    interrupted = False
    finished = False  # False: a refusal is on its way up; the video being written is removed
    try:
        if args.no_pipeline:
            index = 0
            while not state["stop"]:
                try:
                    item = next_frame(index)
                except video.VideoError as err:
                    state["error"] = err
                    break
                if item is None:
                    break
                answer_frame(item)
                index += 1
        else:
            worker = threading.Thread(target=produce, name="edgeq-decode", daemon=True)
            worker.start()
            while True:
                with cond:
                    while not queue and not state["done"] and not state["stop"]:
                        cond.wait(0.5)
                    if not queue or state["stop"]:
                        break
                    item = queue.pop(0)
                    cond.notify_all()
                answer_frame(item)
        finished = True
        interrupted = bool(asked)
    except KeyboardInterrupt:
        interrupted = finished = True
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
        with cond:
            state["stop"] = True
            cond.notify_all()
        source.cancel = True
        if not args.no_pipeline:
            worker.join()
        if writer is not None and not finished:
            writer.discard()
    seconds = video.now() - start
    source.close()
    if writer is not None:  # the frames answered, also where the source stopped or Ctrl-C came
        try:
            writer.close()
        except video.VideoError as err:
            raise LoaderError(str(err), Exit.USAGE)
    error = state["error"]
    summary = {"source": source.name, "live": source.live, "pipelined": not args.no_pipeline,
               "frames": state["answered"], "seconds": round(seconds, 3),
               "fps": round(state["answered"] / seconds, 2) if seconds > 0 else 0.0,
               "dropped": state["dropped"], "stages": times.summary(contract.percentile)}
    if interrupted or error is not None:
        summary["stopped"] = "interrupted" if interrupted else str(error)
    print(json.dumps({"summary": summary}) if args.json else video.describe_summary(summary))
    if interrupted:
        return 130
    if error is not None:
        raise LoaderError(str(error), Exit.SOURCE)
    return Exit.OK


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        try:
            __import__("numpy")
        except ImportError:
            hand_over(argv, "numpy")
        if importlib.util.find_spec("tvm") is None:  # not imported yet: the CUDA bridge must load first
            hand_over(argv, "tvm")
        manifest = verified_manifest()
        streams = [(spec, video.stream_input(spec)) for spec in args.input if video.stream_input(spec)]
        if streams and not args.no_pipeline and not THREADS_GIVEN and not manifest.device.cuda_arch and CPUS > 1:
            # the decoding and preprocessing thread gets a core of its own: a thread pool on every core would stall
            # on it (measured: benchmarks/streams.py)
            os.environ["TVM_NUM_THREADS"] = str(CPUS - 1)
        try:
            import tvm
        except ImportError:
            hand_over(argv, "a working tvm")
        if args.check:
            check_machine(manifest, tvm)
            print(json.dumps({"ok": True}) if args.json else "ok: this machine can run %s" % manifest.bundle_id)
            return Exit.OK
        if manifest.generate is not None:
            return run_language_model(manifest, tvm, args)
        if args.prompt is not None or args.prompt_ids is not None or args.tokenize is not None:
            raise LoaderError("--prompt, --prompt-ids and --tokenize are for language-model bundles; this one is not",
                              Exit.USAGE)
        if streams and (len(args.input) > 1 or args.benchmark or args.self_test):
            raise LoaderError("--input %s is a video source: give it alone, without --self-test or --benchmark"
                              % streams[0][0], Exit.USAGE)
        if streams:
            spec, (name, path) = streams[0]
            pre = manifest.preprocess
            if name is not None and pre is not None and name != pre.input:
                raise LoaderError("--input %s: video frames go to input '%s' (--preprocess)" % (spec, pre.input),
                                  Exit.USAGE)
            return run_stream(Model(manifest), path, args)
        inputs, image_hw = read_inputs(args.input, manifest)
        model = Model(manifest)
        if args.self_test:
            ok, report = self_test(model)
            report_self_test(ok, report, args.json)
            if not ok:
                return Exit.SELF_TEST_FAILED
        if args.benchmark:
            np = model.np
            inputs = inputs or {s.name: np.zeros(s.shape, s.dtype) for s in manifest.inputs}
            stats = model.benchmark(inputs, args.benchmark, args.warmup)
            print(json.dumps(stats) if args.json else contract.describe_latency(stats))
        elif inputs:
            run_inputs(model, inputs, args, image_hw)
        return Exit.OK
    except LoaderError as err:
        print("run.py: error: %s" % err, file=sys.stderr)
        return err.status


if __name__ == "__main__":
    sys.exit(int(main()))
