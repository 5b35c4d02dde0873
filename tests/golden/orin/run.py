#!/usr/bin/env python3
"""Loader for the edgeq bundle "mobilenet_cnn-jetson-orin-nano-000000000000" (mobilenet_cnn for jetson-orin-nano).

Needs numpy and the TVM runtime (apache-tvm 0.27.0.post1). Where Python has no TVM (or no numpy), it
hands over to the bundle's native loader runtime/edgeq-run, which takes the same flags and needs nothing
installed. On a CUDA 12 device (JetPack 6) it loads the bundle's CUDA bridge
(runtime/libcudart.so.13) before TVM, so a pip-installed apache-tvm (built for CUDA 13) reaches the GPU.

    python run.py --self-test                       run the golden input, compare with the manifest
    python run.py --input input=x.npy --output out.npz
    python run.py --benchmark 100 [--warmup 10] [--json]
    python run.py --check                           only check that this machine can run the bundle

Made by edgeq 0.1.0. Before anything is loaded, the manifest is checked against this
machine and every file against its SHA-256; a mismatch stops with a one-line reason. When this device
trusts a signing key ($EDGEQ_TRUSTED_KEY, else /etc/edgeq/trusted.pub), the manifest must carry a valid
signature by it (manifest.sig); an unsigned bundle is refused.
"""

import argparse
import base64
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE_LOADER = os.path.join(HERE, "runtime", "edgeq-run")
SCHEMA_VERSION = 2
MAX_MANIFEST_BYTES = 4 << 20
MAX_RUNS = 1000000  # --benchmark / --warmup
MAX_INPUT_BYTES = int(os.environ.get("EDGEQ_MAX_INPUT_BYTES") or 4 << 30)  # one --input .npy
TRUSTED_KEY = os.environ.get("EDGEQ_TRUSTED_KEY") or "/etc/edgeq/trusted.pub"
# TVM's thread pool assumes two hardware threads per core and, unless told, uses half the CPUs; inference
# gets every CPU this process may run on (set TVM_NUM_THREADS to choose).
if hasattr(os, "sched_getaffinity"):
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


class BundleCheckError(Exception):
    pass


BRIDGE_PROBLEM = []  # why the CUDA bridge cannot reach a CUDA 12 runtime, reported after the driver check


def load_cuda_bridge(manifest):
    """Give TVM's CUDA backend (linked to CUDA 13's libcudart.so.13) the device's CUDA 12 runtime through the
    bundle's bridge. Takes the verified manifest (the bridge is loaded only after every file's hash matched);
    must run before ``import tvm``; does nothing where the bundle has no bridge."""
    bridge = (manifest.get("runtime") or {}).get("cuda_bridge")
    if not isinstance(bridge, dict) or manifest["device"]["arch"] != platform.machine():
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
        raise BundleCheckError("this Python has no %s and the bundle carries no runtime (packaged with --runtime none); "
                               "pip install numpy apache-tvm==%s" % (missing, "0.27.0.post1"))
    sys.stdout.flush()
    os.execv(NATIVE_LOADER, [NATIVE_LOADER, "--bundle", HERE] + list(argv))


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_signature(manifest_bytes):
    """With a trusted key on this device, the manifest must be signed by it. Fails closed."""
    if not os.path.exists(TRUSTED_KEY):
        return
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        raise BundleCheckError("a trusted key is configured (%s) but the 'cryptography' package is missing" % TRUSTED_KEY)
    try:
        with open(TRUSTED_KEY, "rb") as f:
            key = serialization.load_pem_public_key(f.read())
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    except (OSError, ValueError) as err:
        raise BundleCheckError("cannot read the trusted key %s: %s" % (TRUSTED_KEY, err))
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ed25519

    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise BundleCheckError("the trusted key %s is not an ed25519 key" % TRUSTED_KEY)
    try:
        with open(os.path.join(HERE, "manifest.sig"), "rb") as f:
            sig = json.loads(f.read(1 << 20).decode("utf-8"))
        signature = base64.b64decode(sig["signature"], validate=True)
        if sig.get("algorithm") != "ed25519" or not isinstance(sig.get("key_id"), str):
            raise ValueError
    except OSError:
        raise BundleCheckError("this device trusts %s but the bundle is not signed (no manifest.sig)" % TRUSTED_KEY)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise BundleCheckError("manifest.sig is malformed")
    if sig["key_id"] != hashlib.sha256(raw).hexdigest()[:16]:
        raise BundleCheckError("the bundle is signed by another key (%s) than the trusted one" % sig["key_id"])
    try:
        key.verify(signature, manifest_bytes)
    except InvalidSignature:
        raise BundleCheckError("the signature does not match manifest.json (changed after signing?)")


def load_manifest():
    try:
        with open(os.path.join(HERE, "manifest.json"), "rb") as f:
            manifest_bytes = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as err:
        raise BundleCheckError("cannot read manifest.json: %s" % err.strerror)
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise BundleCheckError("manifest.json is larger than %d bytes" % MAX_MANIFEST_BYTES)
    check_signature(manifest_bytes)
    try:
        manifest = json.loads(manifest_bytes.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise BundleCheckError("manifest.json is not valid JSON: %s" % str(err)[:100])
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise BundleCheckError(
            "manifest schema_version %r is not %d; use the run.py shipped with this bundle"
            % (manifest.get("schema_version") if isinstance(manifest, dict) else None, SCHEMA_VERSION)
        )
    check_shape(manifest)
    return manifest


def check_shape(manifest):
    """The parts of the manifest this loader reads have the types it expects (one line otherwise)."""
    def tensor(t, stored):
        return (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                and isinstance(t.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in t["shape"])
                and (not stored or all(isinstance(t.get(k), int) and t[k] >= 0 for k in ("offset", "bytes"))))

    files = manifest.get("files")
    ok = (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
          and isinstance(manifest.get("device"), dict) and isinstance(manifest["device"].get("arch"), str)
          and isinstance(manifest.get("tvm_version"), str) and isinstance(manifest.get("toolchain"), dict)
          and all(isinstance(manifest.get(k), list) and all(tensor(t, False) for t in manifest[k])
                  for k in ("inputs", "outputs"))
          and all(isinstance(manifest.get(k), dict) and isinstance(manifest[k].get("file"), str)
                  for k in ("library", "weights", "golden"))
          and all(isinstance(manifest[k].get("tensors"), list) and all(tensor(t, True) for t in manifest[k]["tensors"])
                  for k in ("weights", "golden"))
          and (manifest.get("runtime") is None or (
              isinstance(manifest["runtime"], dict) and isinstance(manifest["runtime"].get("loader"), str)
              and isinstance(manifest["runtime"].get("libraries"), list))))
    if not ok:
        raise BundleCheckError("manifest.json does not have the shape of an edgeq bundle manifest; re-copy the bundle")


def verified_manifest(verify=True):
    """The manifest, its signature and every file checked, and the CUDA bridge loaded: all before TVM."""
    manifest = load_manifest()
    if verify:
        check_files(manifest)
    load_cuda_bridge(manifest)
    return manifest


def check_files(manifest):
    for name, want in sorted(manifest["files"].items()):
        path = os.path.join(HERE, name)
        if not os.path.isfile(path):
            raise BundleCheckError("bundle file %s is missing" % name)
        if _sha256(path) != want:
            raise BundleCheckError("bundle file %s does not match its SHA-256 in the manifest; re-copy the bundle" % name)


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
    device = manifest["device"]
    machine = platform.machine()
    if machine != device["arch"]:
        raise BundleCheckError(
            "this bundle is for %s (%s) but this machine is %s" % (device["arch"], device["profile"], machine)
        )
    have_tvm = tvm.__version__.split(".")[:2]
    want_tvm = manifest["tvm_version"].split(".")[:2]
    if have_tvm != want_tvm:
        raise BundleCheckError(
            "this bundle was built with TVM %s but the runtime here is %s; install apache-tvm==%s"
            % (manifest["tvm_version"], tvm.__version__, manifest["tvm_version"])
        )
    cuda_arch = device.get("cuda_arch")
    if not cuda_arch:
        return tvm.cpu(0)
    toolkit = manifest["toolchain"]["cuda_toolkit"]
    driver = cuda_driver_version()
    if driver is None:
        raise BundleCheckError("this bundle needs a CUDA GPU (%s) but no CUDA driver was found" % cuda_arch)
    want_major = int(toolkit["version"].split(".")[0])
    if driver[0] < want_major:
        raise BundleCheckError(
            "this bundle was built with CUDA %s but the driver here is CUDA %d.%d; it needs a CUDA %d.x driver or newer"
            % (toolkit["version"], driver[0], driver[1], want_major)
        )
    if BRIDGE_PROBLEM:
        raise BundleCheckError(BRIDGE_PROBLEM[0])
    if not tvm.runtime.enabled("cuda"):
        raise BundleCheckError("the TVM runtime here is built without CUDA; install a CUDA-enabled TVM runtime")
    dev = tvm.cuda(0)
    if not dev.exist:
        raise BundleCheckError("this bundle needs a CUDA GPU (%s) but none is visible" % cuda_arch)
    have_arch = "sm_" + dev.compute_version.replace(".", "")
    if have_arch != cuda_arch:
        raise BundleCheckError("this bundle carries code for %s but the GPU here is %s" % (cuda_arch, have_arch))
    return dev


class Model:
    """The bundle's model, loaded: ``Model().run({name: array})`` returns ``{output name: array}``."""

    def __init__(self, manifest=None, verify=True):
        """``manifest``: one already loaded and checked by ``verified_manifest``; else it is done here."""
        self.manifest = manifest or verified_manifest(verify)
        import numpy as np
        import tvm
        from tvm.runtime.vm import VirtualMachine

        self.np = np
        self.tvm = tvm
        self.dev = check_machine(self.manifest, tvm)
        lib = tvm.runtime.load_module(os.path.join(HERE, self.manifest["library"]["file"]))
        self.vm = VirtualMachine(lib, self.dev)
        weights = self.manifest["weights"]
        self.params = [tvm.runtime.tensor(read_tensor(np, weights["file"], t), self.dev) for t in weights["tensors"]]

    def arguments(self, inputs):
        np = self.np
        args = []
        for spec in self.manifest["inputs"]:
            if spec["name"] not in inputs:
                raise BundleCheckError("input '%s' is missing; the model's inputs are: %s"
                                       % (spec["name"], ", ".join(s["name"] for s in self.manifest["inputs"])))
            array = np.asarray(inputs[spec["name"]])
            if list(array.shape) != spec["shape"] or str(array.dtype) != spec["dtype"]:
                raise BundleCheckError("input '%s' must be %s %s, got %s %s" % (
                    spec["name"], spec["dtype"], "x".join(map(str, spec["shape"])),
                    array.dtype, "x".join(map(str, array.shape))))
            args.append(self.tvm.runtime.tensor(np.require(array, requirements="C"), self.dev))
        unknown = set(inputs) - {s["name"] for s in self.manifest["inputs"]}
        if unknown:
            raise BundleCheckError("unknown input(s): %s" % ", ".join(sorted(unknown)))
        return args + self.params

    def run(self, inputs):
        result = self.vm["main"](*self.arguments(inputs))
        results = [result] if isinstance(result, self.tvm.runtime.Tensor) else list(result)
        return {spec["name"]: r.numpy() for spec, r in zip(self.manifest["outputs"], results)}

    def benchmark(self, inputs, repeat, warmup):
        args = self.arguments(inputs)
        for _ in range(warmup):
            self.vm["main"](*args)
        self.dev.sync()
        timer = self.vm.time_evaluator("main", self.dev, number=1, repeat=repeat)
        times_ms = sorted(t * 1e3 for t in timer(*args).results)
        np = self.np
        first = self.manifest["inputs"][0]["shape"] if self.manifest["inputs"] else []
        batch = first[0] if first else 1
        median = float(np.median(times_ms))
        return {
            "runs": repeat,
            "warmup": warmup,
            "min_ms": times_ms[0],
            "median_ms": median,
            "mean_ms": float(np.mean(times_ms)),
            "p90_ms": float(np.percentile(times_ms, 90)),
            "p99_ms": float(np.percentile(times_ms, 99)),
            "max_ms": times_ms[-1],
            "throughput_per_s": batch * 1e3 / median,
        }


def read_tensor(np, name, entry):
    """One array of an edgeq-raw-1 file (little-endian, C order, at the manifest's offset)."""
    dtype = np.dtype(entry["dtype"]).newbyteorder("<")
    count = int(np.prod(entry["shape"], dtype=np.int64))
    flat = np.fromfile(os.path.join(HERE, name), dtype=dtype, count=count, offset=entry["offset"])
    if flat.size != count:
        raise BundleCheckError("bundle file %s is shorter than the manifest says" % name)
    return flat.astype(dtype.newbyteorder("="), copy=False).reshape(entry["shape"])


def self_test(model):
    np = model.np
    golden = model.manifest["golden"]
    arrays = {t["name"]: read_tensor(np, golden["file"], t) for t in golden["tensors"]}
    inputs = {s["name"]: arrays["input:" + s["name"]] for s in model.manifest["inputs"]}
    expected = {s["name"]: arrays["output:" + s["name"]] for s in model.manifest["outputs"]}
    outputs = model.run(inputs)
    report, ok = [], True
    for name, want in expected.items():
        got = outputs[name]
        atol = golden["atol"] * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
        close = got.shape == want.shape and bool(np.allclose(got, want, rtol=golden["rtol"], atol=atol))
        diff = float(np.max(np.abs(got.astype(np.float64) - want))) if got.shape == want.shape else float("inf")
        report.append({"output": name, "max_abs_diff": diff, "rtol": golden["rtol"], "atol": atol, "ok": close})
        ok = ok and close
    return ok, report


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Run the edgeq bundle %s." % "mobilenet_cnn-jetson-orin-nano-000000000000")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                        help="an input array (.npy); repeat for each model input")
    parser.add_argument("--output", metavar="FILE.npz", help="where to write the outputs (default: print a summary)")
    parser.add_argument("--self-test", action="store_true", help="run the golden input and compare with the manifest")
    parser.add_argument("--benchmark", type=int, metavar="N", help="time N inferences after warm-up")
    parser.add_argument("--warmup", type=int, default=10, metavar="N", help="warm-up runs before --benchmark (default 10)")
    parser.add_argument("--check", action="store_true", help="only check that this machine can run the bundle")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args(argv)
    if args.benchmark is not None and not 1 <= args.benchmark <= MAX_RUNS:
        parser.error("--benchmark needs N from 1 to %d" % MAX_RUNS)
    if not 0 <= args.warmup <= MAX_RUNS:
        parser.error("--warmup needs N from 0 to %d" % MAX_RUNS)
    if not (args.self_test or args.benchmark or args.check or args.input):
        parser.error("give --self-test, --benchmark N, --check or --input NAME=FILE.npy")
    return args


def read_inputs(specs):
    import numpy as np

    inputs = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise BundleCheckError("--input '%s' is not NAME=FILE.npy" % spec)
        try:
            with open(path, "rb") as f:  # the header alone first: the size is bounded before anything is read
                major, _ = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
            nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if nbytes > MAX_INPUT_BYTES:
                raise BundleCheckError("--input %s declares %d bytes, more than %d; raise EDGEQ_MAX_INPUT_BYTES to read it"
                                       % (spec, nbytes, MAX_INPUT_BYTES))
            inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise BundleCheckError("cannot read --input %s: %s" % (spec, str(err).splitlines()[0] if str(err) else
                                                                     type(err).__name__))
    return inputs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        try:
            import numpy  # noqa: F401
        except ImportError:
            hand_over(argv, "numpy")
        if importlib.util.find_spec("tvm") is None:  # not imported yet: the CUDA bridge must load first
            hand_over(argv, "tvm")
        manifest = verified_manifest()
        try:
            import tvm
        except ImportError:
            hand_over(argv, "a working tvm")
        if args.check:
            check_machine(manifest, tvm)
            print(json.dumps({"ok": True}) if args.json else "ok: this machine can run %s" % manifest["bundle_id"])
            return 0
        inputs = read_inputs(args.input)
        model = Model(manifest)
        if args.self_test:
            ok, report = self_test(model)
            if args.json:
                print(json.dumps({"ok": ok, "outputs": report}))
            else:
                for row in report:
                    print("%-4s %s: max |diff| %.3g (rtol %g, atol %.3g)" % (
                        "ok" if row["ok"] else "FAIL", row["output"], row["max_abs_diff"], row["rtol"], row["atol"]))
                print("self-test %s" % ("passed" if ok else "FAILED"))
            if not ok:
                return 1
        if args.benchmark:
            if not inputs:
                np = model.np
                inputs = {s["name"]: np.zeros(s["shape"], s["dtype"]) for s in model.manifest["inputs"]}
            stats = model.benchmark(inputs, args.benchmark, args.warmup)
            if args.json:
                print(json.dumps(stats))
            else:
                print("%d runs: min %.3f ms  median %.3f ms  p90 %.3f ms  p99 %.3f ms  (%.1f inferences/s)" % (
                    stats["runs"], stats["min_ms"], stats["median_ms"], stats["p90_ms"], stats["p99_ms"],
                    stats["throughput_per_s"]))
        elif inputs:
            outputs = model.run(inputs)
            if args.output:
                try:
                    model.np.savez(args.output, **outputs)
                except OSError as err:
                    raise BundleCheckError("cannot write --output %s: %s" % (args.output, err.strerror or err))
            if args.json:
                print(json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in outputs.items()}))
            elif not args.output:
                for name, value in outputs.items():
                    print("%s: %s %s" % (name, value.dtype, "x".join(map(str, value.shape))))
        return 0
    except BundleCheckError as err:
        print("run.py: error: %s" % err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
