"""Device profiles: one TOML file per device, all with the same shape.

Device facts live in the ``*.toml`` files beside this module, not in code. ``host`` is the only profile
with values detected at run time (``"detect"`` in its file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import platform
import re
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (JetPack 6): the same parser, from PyPI
    import tomli as tomllib

from edgeq.errors import DeviceError


@dataclasses.dataclass(frozen=True)
class CpuSpec:
    triple: str
    mcpu: str
    cores: int

    @property
    def arch(self) -> str:
        """The machine name ``uname -m`` prints on the device (``aarch64``, ``x86_64``)."""
        return self.triple.split("-", 1)[0]


@dataclasses.dataclass(frozen=True)
class CudaSpec:
    arch: str  # "sm_87"
    version: str  # CUDA version of the JetPack the device runs, "12.6"
    gpu: str = ""
    # shared memory a kernel may use without opting in (cudaFuncSetAttribute), which TVM's launches do not:
    # 48 KiB on every architecture since Kepler; TVM's GPU rules size their tiles by it (and warn where a target lacks it)
    max_shared_memory_per_block: int = 49152
    # the GPU's streaming multiprocessors and the shared memory one block may have when it opts in (TVM's CUDA
    # runtime does, for dynamic shared memory): what edgeq's CUTLASS tile table sizes its tiles by; 0: unknown
    sm_count: int = 0
    shared_memory_per_block_optin: int = 0
    # for the roofline estimate of benchmarks/gpu_kernels.py (0: unknown): the GPU clock, dense tensor-core
    # operations per clock per SM (a multiply-add counts 2), shared memory per SM, and the memory bandwidth
    clock_mhz: int = 0
    int8_ops_per_clock_per_sm: int = 0
    fp16_ops_per_clock_per_sm: int = 0
    shared_memory_per_sm: int = 0
    memory_bandwidth_gbs: float = 0.0

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def compute_version(self) -> str:
        """``sm_87`` -> ``8.7``, the form TVM's ``Device.compute_version`` reports."""
        digits = self.arch.removeprefix("sm_")
        return f"{digits[:-1]}.{digits[-1]}"


@dataclasses.dataclass(frozen=True)
class PowerSpec:
    tegrastats_rails: tuple[str, ...] = ()
    hwmon_glob: str = ""
    hwmon_rails: dict[str, int] = dataclasses.field(default_factory=dict)
    nvpmodel_modes: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    family: str
    aliases: tuple[str, ...]
    cpu: CpuSpec
    cuda: CudaSpec | None
    memory_mb: int
    software: dict[str, str]
    power: PowerSpec
    mender_device_types: tuple[str, ...] = ()  # [mender] device_types: what Mender images of the device report

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def host_target_dict(self, reciprocal: bool = True) -> dict[str, Any]:
        """The LLVM target of the CPU. ``reciprocal`` (LLVM's ``fast-math-arcp``): a division by a constant
        becomes a multiply by its reciprocal (every quantize is ``round(x / scale)``: a ``vdivps`` per vector,
        the costliest instruction of an int8 epilogue; the quotient may differ in its last bit, which moves a
        rounded integer when the quotient is a tie). For edgeq's own quantization that is right: its scales
        and the golden outputs come from the same code. A model's own QuantizeLinear / DynamicQuantizeLinear
        is defined by ONNX as a division and is built without it (``edgeq.package``), as ONNX Runtime computes it."""
        target = {"kind": "llvm", "mtriple": self.cpu.triple, "mcpu": self.cpu.mcpu, "num-cores": self.cpu.cores}
        return {**target, "fast-math-arcp": True} if reciprocal else target

    def tvm_target(self, reciprocal: bool = True):
        """The TVM target: CUDA with an LLVM host for Jetsons, plain LLVM for CPU profiles (``reciprocal``:
        ``host_target_dict``)."""
        import tvm  # deferred: listing devices must not pay for importing TVM

        host = self.host_target_dict(reciprocal)
        if self.cuda:
            return tvm.target.Target({"kind": "cuda", "arch": self.cuda.arch,
                                      "max_shared_memory_per_block": self.cuda.max_shared_memory_per_block}, host=host)
        return tvm.target.Target(host)

    def device_record(self):
        """What a bundle's manifest says of its device (``contract.DeviceRecord``), power rails included, so
        that readers of a bundle never look the profile up again."""
        from edgeq.templates import contract

        cuda, power = self.cuda, self.power
        rails = (contract.PowerRecord(tegrastats_rails=list(power.tegrastats_rails), hwmon_glob=power.hwmon_glob,
                                      hwmon_rails=dict(power.hwmon_rails),
                                      nvpmodel_modes=[dict(m) for m in power.nvpmodel_modes] or None)
                 if power.tegrastats_rails or power.hwmon_rails else None)
        return contract.DeviceRecord(
            profile=self.name, description=self.description, family=self.family, kind=self.kind,
            arch=self.cpu.arch, host_triple=self.cpu.triple, mcpu=self.cpu.mcpu, cores=self.cpu.cores,
            cuda_arch=cuda.arch if cuda else None, cuda_version=cuda.version if cuda else None,
            jetpack=self.software.get("jetpack"), l4t=self.software.get("l4t"), power=rails)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kind"] = self.kind
        return out


_SECTIONS = {"cpu": dict, "memory": dict, "power": dict}
_REQUIRED = {"name": str, "description": str, "family": str, "aliases": list}


def _parse(text: str, source: str) -> Profile:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise DeviceError(f"device profile {source} is not valid TOML: {err}") from None
    for key, typ in {**_REQUIRED, **_SECTIONS}.items():
        if not isinstance(raw.get(key), typ):
            raise DeviceError(f"device profile {source} needs '{key}' ({typ.__name__})")
    try:
        cpu = CpuSpec(**raw["cpu"])
        cuda = CudaSpec(**raw["cuda"]) if "cuda" in raw else None
        power = raw["power"]
        return Profile(
            name=raw["name"],
            description=raw["description"],
            family=raw["family"],
            aliases=tuple(raw["aliases"]),
            cpu=cpu,
            cuda=cuda,
            memory_mb=int(raw["memory"].get("total_mb", 0)),
            software=dict(raw.get("software", {})),
            power=PowerSpec(
                tegrastats_rails=tuple(power.get("tegrastats_rails", ())),
                hwmon_glob=power.get("hwmon_glob", ""),
                hwmon_rails=dict(power.get("hwmon_rails", {})),
                nvpmodel_modes=tuple(power.get("nvpmodel_modes", ())),
            ),
            mender_device_types=_mender_device_types(raw.get("mender", {}), source),
        )
    except TypeError as err:
        raise DeviceError(f"device profile {source} has an unexpected field: {err}") from None


def _mender_device_types(section, source: str) -> tuple[str, ...]:
    types = section.get("device_types", []) if isinstance(section, dict) else None
    if not isinstance(types, list) or not all(isinstance(t, str) and t for t in types):
        raise DeviceError(f"device profile {source}: [mender] device_types must be a list of names")
    return tuple(types)


def _detect_host(profile: Profile) -> Profile:
    """Fill the ``detect`` fields of the host profile from this machine."""
    machine = platform.machine()
    mem_kb = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            mem_kb = int(meminfo.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    cpu = CpuSpec(
        triple=f"{machine}-linux-gnu",
        mcpu=_host_cpu_name(),
        cores=len(os.sched_getaffinity(0)),
    )
    return dataclasses.replace(profile, cpu=cpu, memory_mb=mem_kb // 1024)


_CPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
# /proc/cpuinfo fields LLVM's host CPU detection depends on (x86: CPUID's identity and features; Arm: the parts)
_CPUINFO_KEYS = {"vendor_id", "cpu family", "model", "model name", "stepping", "flags", "CPU implementer",
                 "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features"}


def _host_cpu_name() -> str:
    """LLVM's name for this machine's CPU (``-mcpu=native``), from TVM; kept in edgeq's cache per CPU and TVM
    build, so that listing or resolving profiles loads TVM (about a second) only the first time."""
    key = _host_cpu_key()
    path = None
    if key:
        from edgeq.cache import cache_dir

        path = cache_dir() / "host-cpu" / key
        try:
            name = path.read_text(encoding="ascii").strip()
            if _CPU_NAME.fullmatch(name):
                return name
        except (OSError, UnicodeDecodeError):
            pass
    from edgeq.tvm_env import import_tvm

    name = str(import_tvm().target.codegen.llvm_get_system_cpu())
    if path is not None and _CPU_NAME.fullmatch(name):
        _remember(path, name)
    return name


def _remember(path: Path, name: str) -> None:
    """Write ``name`` to ``path`` whole or not at all; a cache that cannot be written is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(name + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _host_cpu_key() -> str | None:
    """What the host CPU name depends on, hashed: the CPU as /proc/cpuinfo describes it and the TVM library
    that names it. None (no caching) where either cannot be read."""
    try:
        spec = importlib.util.find_spec("tvm")
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            lines = {line.strip() for line in cpuinfo if line.split(":", 1)[0].strip() in _CPUINFO_KEYS}
        if spec is None or not spec.origin or not lines:
            return None
        libraries = sorted(Path(spec.origin).parent.joinpath("lib").glob("libtvm*.so"))
        stamps = [f"{lib}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}" for lib in libraries]
    except (OSError, ImportError, ValueError):
        return None
    text = "\n".join([platform.machine(), os.environ.get("TVM_LIBRARY_PATH", ""), *stamps, *sorted(lines)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@cache
def profiles() -> dict[str, Profile]:
    """All device profiles shipped with edgeq, by name (``host`` detected)."""
    found = {}
    for entry in sorted(resources.files(__name__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            profile = _parse(entry.read_text(encoding="utf-8"), entry.name)
            if profile.cpu.triple == "detect":
                profile = _detect_host(profile)
            found[profile.name] = profile
    return found


def resolve(name: str) -> tuple[Profile, str | None]:
    """The profile for a device name or alias, and a note when an alias chose it."""
    table = profiles()
    if name in table:
        return table[name], None
    for profile in table.values():
        if name in profile.aliases:
            return profile, f"'{name}' is an alias: using the {profile.family} default profile '{profile.name}'"
    raise DeviceError(f"unknown device '{name}'; valid devices: {', '.join(table)} (see 'edgeq devices')")
