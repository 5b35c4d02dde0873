"""edgeq's CUDA 12 bridge: a libcudart.so.13 that forwards the TVM CUDA runtime's calls to libcudart.so.12.

The bridge is built for the host and, with the Debian cross compiler, for aarch64 (run under
qemu-aarch64). A fake libcudart.so.12 (tests/native/fake_cudart12.c) stands in for the device's CUDA 12
runtime; tests/native/read_props.c calls the bridge the way TVM does and prints what it got.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgeq.errors import ToolchainError
from edgeq.runtime import bridge
from edgeq.runtime.bridge import build_bridge, cudart_imports, cuda12_headers, cuda13_headers, device_prop_fields
from edgeq.runtime.wheels import fetch, installed_version

NATIVE = Path(__file__).resolve().parent / "native"
HOST = platform.machine()
ARCHES = ("x86_64", "aarch64")
QEMU = {"aarch64": ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"], "x86_64": ["qemu-x86_64", "-L", "/usr/x86_64-linux-gnu"]}

# nm -D --undefined-only libtvm_runtime_cuda.so | grep cuda, for apache-tvm 0.27.0.post1 (both machines)
TVM_CUDART_IMPORTS = sorted(
    """cudaDeviceGetAttribute cudaEventCreate cudaEventDestroy cudaEventElapsedTime cudaEventRecord
    cudaEventSynchronize cudaFree cudaFreeHost cudaGetDevice cudaGetDeviceCount cudaGetDeviceProperties
    cudaGetErrorName cudaGetErrorString cudaGetLastError cudaGraphDestroy cudaGraphExecDestroy
    cudaGraphInstantiate cudaGraphLaunch cudaMalloc cudaMallocHost cudaMemGetInfo cudaMemcpyAsync
    cudaMemcpyPeerAsync cudaPeekAtLastError cudaSetDevice cudaStreamBeginCapture cudaStreamCreate
    cudaStreamCreateWithFlags cudaStreamDestroy cudaStreamEndCapture cudaStreamSynchronize
    cudaStreamWaitEvent""".split()
)
# what fake_cudart12.c sets by name (the other fields get a pattern)
FAKE = {
    "totalGlobalMem": 0x123456789,
    "major": 8,
    "minor": 7,
    "multiProcessorCount": 16,
    "maxGridSize": [1, 2, 3],
    "warpSize": 32,
    "l2CacheSize": 4 << 20,
    "unifiedFunctionPointers": 1,
}
GLIBC_OF_JETPACK6 = (2, 35)  # Ubuntu 22.04


def _cc(arch: str) -> str:
    return "gcc" if arch == HOST else f"{arch}-linux-gnu-gcc"


def _compile(cc: str, *args) -> None:
    proc = subprocess.run([cc, "-O1", "-Wall", *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


class Built:
    """The bridge, the fake libcudart.so.12 and the reader, for one machine."""

    def __init__(self, arch: str, root: Path, headers: dict[str, Path]):
        self.arch, cc = arch, _cc(arch)
        if shutil.which(cc) is None:
            pytest.skip(f"no {cc}")
        self.runner = [] if arch == HOST else QEMU[arch]
        if self.runner and shutil.which(self.runner[0]) is None:
            pytest.skip(f"no {self.runner[0]}")
        if arch == HOST:
            import tvm

            self.tvm_lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
        else:
            wheel = fetch("apache-tvm", installed_version("apache-tvm"), arch)
            self.tvm_lib = root / "libtvm_runtime_cuda.so"
            self.tvm_lib.write_bytes(wheel.read("tvm/lib/libtvm_runtime_cuda.so"))
        self.imports = cudart_imports(self.tvm_lib)
        self.bridge = build_bridge(self.imports, cc, root / "bridge", headers["12"], headers["13"])
        self.fake = root / "fake" / "libcudart.so.12"
        self.fake.parent.mkdir()
        _compile(cc, "-shared", "-fPIC", "-I", headers["12"], "-I", headers["12crt"], "-I", self.bridge.parent,
                 "-Wl,-soname,libcudart.so.12", "-o", self.fake, NATIVE / "fake_cudart12.c",
                 NATIVE / "fake_cudart12_rest.c")
        self.reader = root / "read_props"
        # RPATH (not RUNPATH): it wins over LD_LIBRARY_PATH and ld.so.cache, which has the host's real
        # libcudart.so.13
        _compile(cc, "-I", headers["13"], "-I", self.bridge.parent, "-o", self.reader, NATIVE / "read_props.c",
                 self.bridge, f"-Wl,-rpath,{self.bridge.parent}", "-Wl,--disable-new-dtags", "-ldl")

    def read(self, env: dict[str, str]) -> dict:
        clean = {k: v for k, v in os.environ.items() if k not in ("EDGEQ_CUDART", "LD_LIBRARY_PATH", "LD_PRELOAD")}
        proc = subprocess.run([*self.runner, str(self.reader)], env={**clean, **env}, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def headers() -> dict[str, Path]:
    return {"12": cuda12_headers(), "12crt": bridge.wheel_headers(bridge.CUDA12_CRT), "13": cuda13_headers()}


@pytest.fixture(scope="module")
def built(tmp_path_factory, headers):
    cache: dict[str, Built] = {}

    def get(arch: str) -> Built:
        if arch not in cache:
            cache[arch] = Built(arch, tmp_path_factory.mktemp(f"bridge-{arch}"), headers)
        return cache[arch]

    return get


def _readelf(*args) -> str:
    return subprocess.run(["readelf", *map(str, args)], capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------------------------------------------------------
# Imports and exports
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
def test_bridge_exports_exactly_the_tvm_imports(built, arch):
    b = built(arch)
    assert b.imports == TVM_CUDART_IMPORTS
    assert f"Library soname: [{bridge.SONAME}]" in _readelf("-d", b.bridge)
    machine = {"x86_64": "X86-64", "aarch64": "AArch64"}[arch]
    assert re.search(rf"Machine:\s+.*{machine}", _readelf("-h", b.bridge))
    exports = {}
    for line in _readelf("--dyn-syms", "-W", b.bridge).splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[3] == "FUNC" and fields[4] == "GLOBAL" and fields[6] != "UND":
            name, _, version = fields[7].partition("@@")
            exports[name] = version
    assert sorted(exports) == sorted([*TVM_CUDART_IMPORTS, *bridge.EXTRA_EXPORTS])
    assert set(exports.values()) == {"libcudart.so.13"}
    glibc = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+\.\d+)", _readelf("-V", b.bridge))}
    assert max(glibc) <= GLIBC_OF_JETPACK6


def test_unknown_import_or_compiler_stops_the_build(headers, tmp_path):
    with pytest.raises(ToolchainError, match=r"imports cudaFooBar, which edgeq's CUDA 12 bridge does not forward"):
        build_bridge(["cudaMalloc", "cudaFooBar"], "gcc", tmp_path, headers["12"], headers["13"])
    with pytest.raises(ToolchainError, match="'no-such-linux-gnu-gcc' .* not found"):
        build_bridge(["cudaMalloc"], "no-such-linux-gnu-gcc", tmp_path, headers["12"], headers["13"])
    assert not (tmp_path / bridge.SONAME).exists()


def test_device_prop_fields_differ_as_expected(headers):
    fields12, fields13 = device_prop_fields(headers["12"]), device_prop_fields(headers["13"])
    assert fields12["maxGridSize"] == "int maxGridSize[3]" and fields13["uuid"] == "cudaUUID_t uuid"
    assert [n for n in fields12 if n not in fields13] == [
        "clockRate", "deviceOverlap", "kernelExecTimeoutEnabled", "computeMode", "maxTexture1DLinear",
        "memoryClockRate", "singleToDoublePrecisionPerfRatio", "cooperativeMultiDeviceLaunch", "reserved2",
        "reserved1",
    ]
    assert [n for n in fields13 if n not in fields12] == [
        "deviceNumaConfig", "deviceNumaId", "mpsEnabled", "hostNumaId", "gpuPciDeviceID", "gpuPciSubsystemID",
        "hostNumaMultinodeIpcSupported",
    ]


# ---------------------------------------------------------------------------------------------------
# Running it against the fake libcudart.so.12
# ---------------------------------------------------------------------------------------------------


def _common_fields(headers) -> list[str]:
    fields12, fields13 = device_prop_fields(headers["12"]), device_prop_fields(headers["13"])
    return [n for n, decl in fields13.items() if fields12.get(n) == decl and not n.startswith("reserved")]


@pytest.mark.parametrize("arch", ARCHES)
def test_device_properties_are_translated(built, headers, arch):
    b = built(arch)
    out = b.read({"EDGEQ_CUDART": str(b.fake), "LD_LIBRARY_PATH": str(b.bridge.parent)})
    assert out["provider"] == str(b.bridge)
    assert out["target"] == str(b.fake) and out["bridge_error"] is None
    assert (out["count_rc"], out["count"], out["rc"]) == (0, 1, 0)
    assert out["error_string"] == "fake: no error"
    assert out["canary_ok"] and out["sizeof"] == 1008
    assert out["name"] == "edgeq-fake-gpu"
    assert {key: out[key] for key in FAKE} == FAKE

    # every shared field has what the fake wrote at its place in the CUDA 12 struct
    order12 = list(device_prop_fields(headers["12"]))
    assert list(out["fields"]) == _common_fields(headers)
    written = bytearray(out["sizeof"])
    for name, (offset, value) in out["fields"].items():
        value = bytes.fromhex(value)
        written[offset:offset + len(value)] = b"\x01" * len(value)
        if name == "name":
            assert value == b"edgeq-fake-gpu".ljust(256, b"\0")
        elif name not in FAKE:
            k = order12.index(name)
            assert value == bytes((7 * k + j + 1) & 0xFF for j in range(len(value))), name
    # everything else (fields new in CUDA 13, reserved, padding) is zero
    whole = bytes.fromhex(out["struct"])
    assert all(byte == 0 for byte, mark in zip(whole, written) if not mark)


@pytest.mark.parametrize("arch", ARCHES)
def test_libcudart12_found_on_the_loader_path(built, arch):
    b = built(arch)
    out = b.read({"LD_LIBRARY_PATH": f"{b.bridge.parent}:{b.fake.parent}"})
    assert out["target"] == str(b.fake) and out["rc"] == 0 and out["name"] == "edgeq-fake-gpu"


def _cudart12_on_host() -> bool:
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libcudart.so.12 " in cache or any(
        Path(p).exists() for p in ["/usr/local/cuda/lib64/libcudart.so.12"]
    ) or bool(list(Path("/usr/local").glob("cuda-12*/**/libcudart.so.12")))


@pytest.mark.parametrize("arch", ARCHES)
def test_without_libcudart12_calls_fail_and_say_where_it_looked(built, arch):
    if arch == HOST and _cudart12_on_host():
        pytest.skip("this host has a libcudart.so.12")
    b = built(arch)
    nowhere = "/nonexistent/libcudart.so.12"
    out = b.read({"EDGEQ_CUDART": nowhere, "LD_LIBRARY_PATH": str(b.bridge.parent)})
    assert out["provider"] == str(b.bridge)
    assert (out["count_rc"], out["rc"]) == (35, 35) and out["target"] is None
    error = out["bridge_error"]
    assert error.startswith(f"libcudart.so.12 not found (tried: $EDGEQ_CUDART={nowhere} (")
    for place in ("libcudart.so.12 on the loader path", "/usr/local/cuda/lib64/libcudart.so.12",
                  "/usr/local/cuda-12*/targets/aarch64-linux/lib/libcudart.so.12",
                  "/usr/local/cuda-12*/lib64/libcudart.so.12"):
        assert place in error
    assert "\n" not in error and error in out["error_string"] and error in out["error_name"]
    assert out["canary_ok"] and set(bytes.fromhex(out["struct"])) == {0xCD}  # untouched
    if arch == HOST:
        unset = b.read({"LD_LIBRARY_PATH": str(b.bridge.parent)})
        assert unset["bridge_error"].startswith("libcudart.so.12 not found (tried: $EDGEQ_CUDART unset, ")


# ---------------------------------------------------------------------------------------------------
# The TVM wheel's CUDA runtime on top of the bridge and NVIDIA's libcudart.so.12 (x86_64 wheel)
# ---------------------------------------------------------------------------------------------------

TVM_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # edgeq's CUDA driver stub
    lib = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)  # the bridge
    import tvm
    out = {"enabled": tvm.runtime.enabled("cuda"), "exist": tvm.cuda(0).exist}
    count = ctypes.c_int(-1)
    out["count_rc"] = lib.cudaGetDeviceCount(ctypes.byref(count))
    for name in ("edgeq_cudart_bridge_target", "edgeq_cudart_bridge_error"):
        getattr(lib, name).restype = ctypes.c_char_p
        value = getattr(lib, name)()
        out[name] = value and value.decode()
    out["maps"] = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcuda" in line})
    print(json.dumps(out))
    """
)


def test_tvm_cuda_runtime_loads_through_the_bridge(built):
    nvidia_cuda_runtime = pytest.importorskip("nvidia.cuda_runtime")
    if HOST != "x86_64":
        pytest.skip("the installed TVM wheel is checked on x86_64 hosts")
    from edgeq.tvm_env import _build_driver_stub

    b = built(HOST)
    cu12 = Path(list(nvidia_cuda_runtime.__path__)[0], "lib", "libcudart.so.12")
    assert cu12.is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEQ_CUDART", "LD_PRELOAD")}
    env["LD_LIBRARY_PATH"] = f"{b.bridge.parent}:{cu12.parent}"
    proc = subprocess.run([sys.executable, "-c", TVM_SCRIPT, str(_build_driver_stub()), str(b.bridge)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["enabled"] is True and out["exist"] is False
    assert out["count_rc"] != 0  # NVIDIA's runtime on a stub driver: no device
    assert Path(out["edgeq_cudart_bridge_target"]).resolve() == cu12.resolve()
    assert out["edgeq_cudart_bridge_error"] is None
    maps = {Path(p).resolve() for p in out["maps"]}
    assert b.bridge.resolve() in maps and cu12.resolve() in maps
    assert not [p for p in maps if p.name.startswith("libcudart.so.13") and p != b.bridge.resolve()], maps
