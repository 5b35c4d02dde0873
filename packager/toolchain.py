"""Find the compilers a build needs: the C++ (cross) compiler and a CUDA toolkit that fits the device.

CUDA device code must be built by a toolkit whose major version matches the CUDA the device's JetPack
ships: a cubin from CUDA 13 does not load under a CUDA 12 driver (apache/tvm#17543). Two kinds are found:

* ``nvcc`` toolkits (``$EDGEQ_CUDA_HOME``, ``$CUDA_HOME``, ``$CUDA_PATH``, ``nvcc`` on PATH,
  ``/usr/local/cuda*``), driven through TVM's ``nvcc`` compile mode, producing a fatbin;
* NVRTC from NVIDIA's PyPI wheels (``pip install 'edgeq[jetson]'``), driven through TVM's ``nvrtc`` mode,
  producing a cubin. PyPI's ``nvidia-cuda-nvcc-cu12`` has ``ptxas`` but no ``nvcc`` driver, so for
  JetPack 6 (CUDA 12) NVRTC is the toolkit a plain ``pip install`` can provide; that wheel's ``crt/``
  headers are what NVRTC needs for tensor-core (wmma) kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from edgeq.cache import cache_dir
from edgeq.errors import ToolchainError
from edgeq.targets import Profile


# ---------------------------------------------------------------------------------------------------
# The C++ compiler that links the exported library
# ---------------------------------------------------------------------------------------------------


def host_triple() -> str:
    return f"{platform.machine()}-linux-gnu"


def cxx_for(profile: Profile) -> str:
    """The C++ compiler that links code for ``profile``: the system one, or the Debian cross compiler."""
    native = profile.cpu.triple == host_triple()
    name = "g++" if native else f"{profile.cpu.triple}-g++"
    path = shutil.which(name)
    if path is None:
        package = "g++" if native else f"g++-{profile.cpu.triple.replace('_', '-')}"
        what = "C++ compiler" if native else "cross compiler"
        raise ToolchainError(
            f"{what} '{name}' for {profile.name} not found on PATH; install it: sudo apt-get install {package}"
        )
    return path


# ---------------------------------------------------------------------------------------------------
# CUDA toolkits
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceMath:
    """The float semantics a CUDA build compiles with, as the manifest records them: decided by edgeq, not TVM's
    ``--use_fast_math`` (why, and what int8 kernels do about ``expf``: ``backends/cuda/device_math.py``)."""

    fast_math: bool = False  # --use_fast_math's math-function mapping (__USE_FAST_MATH__)
    ftz: bool = False  # denormals flushed to zero
    prec_div: bool = True  # IEEE round-to-nearest division
    prec_sqrt: bool = True  # IEEE round-to-nearest square root
    fmad: bool = False  # a * b + c contracted into one FMA
    expf: str = "__expf"  # what a plain expf() in the source becomes (NVRTC's front end maps it under TVM's option)

    def nvrtc_options(self) -> str:
        """What edgeq appends to TVM's NVRTC options (after its ``--use_fast_math``, so these win)."""
        flag = {True: "true", False: "false"}
        return (f"--ftz={flag[self.ftz]} --prec-div={flag[self.prec_div]} --prec-sqrt={flag[self.prec_sqrt]} "
                f"--fmad={flag[self.fmad]}" + ("" if self.fast_math else " -U__USE_FAST_MATH__"))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self),
                "int8_exp": "exp_rn (edgeq's: correctly rounded float32 operators; the same bits on host and device)"}

    @classmethod
    def for_build(cls, kind: str, precision: str) -> DeviceMath:
        """What a build of ``precision`` with a toolkit of ``kind`` ("nvrtc" or "nvcc") compiles with: IEEE division
        and square root, denormals kept, no fast math; and no contraction into FMA where the graph rounds floats to
        int8 (int8, mixed: an FMA's one rounding can move a value across k + 1/2), contraction kept where nothing is
        rounded to an integer (fp32, fp16: an FMA is the more accurate, and a CUDA-core convolution's inner loop
        is FMAs). nvcc mode: TVM's nvcc path takes no extra option, so --fmad is nvcc's default (on)."""
        if kind != "nvrtc":
            return cls(fmad=True, expf="expf")
        return EXACT if precision in ("int8", "mixed") else FLOAT

EXACT = DeviceMath()  # builds that round floats to int8
FLOAT = DeviceMath(fmad=True)  # builds that do not
FAST = DeviceMath(fast_math=True, ftz=True, prec_div=False, prec_sqrt=False, fmad=True)  # TVM's, for comparison



@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    kind: str  # "nvcc" or "nvrtc": TVM's TVM_CUDA_COMPILE_MODE
    version: tuple[int, int]
    root: str  # what TVM reads as CUDA_PATH
    source: str  # where it was found, for humans
    archs: tuple[str, ...]  # real architectures it can emit, "sm_87"

    @property
    def version_str(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    @property
    def output_format(self) -> str:
        return "fatbin" if self.kind == "nvcc" else "cubin"

    def describe(self) -> str:
        return f"CUDA {self.version_str} {self.kind} ({self.source})"

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "version": self.version_str,
            "source": self.source,
            "output_format": self.output_format,
        }

    @contextlib.contextmanager
    def active(self, math: DeviceMath | None = None) -> Iterator[None]:
        """Make TVM's CUDA compile callback use this toolkit, with edgeq's device math (``math``, default
        ``EXACT``; not TVM's ``--use_fast_math``), for the duration of a build."""
        env = {"TVM_CUDA_COMPILE_MODE": self.kind, "CUDA_PATH": self.root}
        if self.kind == "nvcc":
            env["PATH"] = os.path.join(self.root, "bin") + os.pathsep + os.environ.get("PATH", "")
            env["TVM_CUDA_NVCC_NO_FAST_MATH"] = "1"
        else:  # after TVM's options, and before whatever the caller added (CUTLASS's include folder)
            extra = os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS", "")
            env["TVM_CUDA_NVRTC_EXTRA_OPTS"] = f"{(math or EXACT).nvrtc_options()} {extra}".strip()
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _nvcc_roots() -> list[str]:
    roots = [os.environ.get(var) for var in ("EDGEQ_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")]
    on_path = shutil.which("nvcc")
    if on_path:
        roots.append(str(Path(on_path).resolve().parent.parent))
    roots += sorted(glob.glob("/usr/local/cuda*"))
    seen, out = set(), []
    for root in filter(None, roots):
        real = os.path.realpath(root)
        is_toolkit = os.access(os.path.join(real, "bin", "nvcc"), os.X_OK) and os.path.isfile(
            os.path.join(real, "include", "cuda_runtime.h")
        )
        if real not in seen and is_toolkit:
            seen.add(real)
            out.append(real)
    return out


def _nvcc_toolkit(root: str) -> CudaToolkit | None:
    nvcc = os.path.join(root, "bin", "nvcc")
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        codes = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+)\.(\d+)", version)
    if not match:
        return None
    archs = tuple(sorted(set(re.findall(r"\bsm_\d+[af]?\b", codes))))
    return CudaToolkit("nvcc", (int(match[1]), int(match[2])), root, f"nvcc at {root}", archs)


def _nvrtc_toolkit() -> CudaToolkit | None:
    try:
        from cuda.bindings import nvrtc
        import nvidia.cuda_cccl
        import nvidia.cuda_runtime
    except ImportError:
        return None
    try:
        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None
        err, archs = nvrtc.nvrtcGetSupportedArchs()
    except Exception:  # the bindings raise a plain RuntimeError when libnvrtc cannot be found
        return None
    runtime_include = Path(list(nvidia.cuda_runtime.__path__)[0], "include")
    cccl_include = Path(list(nvidia.cuda_cccl.__path__)[0], "include")
    # TVM's NVRTC mode reads headers from $CUDA_PATH/include, $CUDA_PATH/targets/<arch>-linux/include and its
    # cccl/: lay the wheels' header folders out that way. crt/ (mma.h: the wmma fragments of tensor-core
    # kernels, which the runtime wheel's mma.h includes) is in the nvcc wheel; without it tensor-core
    # schedules fail the build check and the CUDA backend's pipeline falls back to kernels without tensor cores.
    links = {"include": runtime_include, f"targets/{platform.machine()}-linux/include/cccl": cccl_include}
    crt = _crt_include()
    if crt is not None:
        links[f"targets/{platform.machine()}-linux/include/crt"] = crt
    root = _header_root(f"nvrtc-{major}.{minor}", links)
    return CudaToolkit(
        "nvrtc",
        (major, minor),
        str(root),
        f"NVRTC {major}.{minor} from PyPI wheels",
        tuple(f"sm_{a}" for a in archs),
    )


def _header_root(name: str, links: dict[str, Path]) -> Path:
    """A folder of symlinks (relative path -> header folder), one per set of targets: Python environments
    with their own wheels get their own folder, so none relinks what a concurrent build is reading. Made in
    a temporary folder and renamed into place."""
    digest = hashlib.sha256("\0".join(f"{k}={v}" for k, v in sorted(links.items())).encode()).hexdigest()[:12]
    root = cache_dir() / f"{name}-{digest}"
    if root.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    for rel, dest in links.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).symlink_to(dest, target_is_directory=True)
    try:
        os.rename(tmp, root)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _crt_include() -> Path | None:
    """CUDA's crt/ headers from the ``nvidia-cuda-nvcc-cu12`` wheel, if it is installed."""
    try:
        import nvidia.cuda_nvcc
    except ImportError:
        return None
    for base in nvidia.cuda_nvcc.__path__:
        crt = Path(base, "include", "crt")
        if (crt / "mma.h").is_file():
            return crt
    return None


@cache
def cuda_toolkits() -> tuple[CudaToolkit, ...]:
    found = [tk for tk in map(_nvcc_toolkit, _nvcc_roots()) if tk]
    nvrtc = _nvrtc_toolkit()
    if nvrtc:
        found.append(nvrtc)
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """Everything outside Python that a build for one profile uses; recorded in the manifest."""

    cxx: str
    cuda_toolkit: CudaToolkit | None  # the device code's compiler, for profiles with a GPU (edgeq.backends.cuda)

    def to_dict(self) -> dict:
        return {"cxx": self.cxx, "cuda_toolkit": self.cuda_toolkit.to_dict() if self.cuda_toolkit else None}
