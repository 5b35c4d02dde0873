"""The light CLI: verbs that need no compiler run without importing TVM, tvm_ffi or ONNX.

Each command runs in a fresh interpreter (``edgeq.cli.main.main([...])``), which then reports the modules it
loaded; the verbs must still do their whole job there. The choices the parsers offer come from
``edgeq.choices``; the library's defaults must agree with the CLI's.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import make_models
from conftest import run_cli
from sshd import free_port

COMPILER = ("tvm", "tvm_ffi", "onnx")  # never loaded by a light verb
# edgeq modules that pull the compiler or numpy-heavy code in
HEAVY_EDGEQ = ("edgeq.compile", "edgeq.graph", "edgeq.load", "edgeq.package", "edgeq.quantize", "edgeq.relax_import",
               "edgeq.onnx_ops", "edgeq.backends.cpu", "edgeq.rpc.bench", "edgeq.rpc.tune", "edgeq.runtime.assemble")

CHILD = """
import json, sys
from edgeq.cli.main import main
code = main(json.loads(sys.argv[1]))
with open(sys.argv[2], "w") as report:
    json.dump({"code": code, "modules": sorted(sys.modules)}, report)
"""


@dataclasses.dataclass
class Light:
    code: int
    stdout: str
    stderr: str
    modules: set[str]

    def loaded(self, *names: str) -> list[str]:
        """Those of ``names`` (or their submodules) this run imported."""
        return sorted(m for m in self.modules if any(m == n or m.startswith(n + ".") for n in names))


def light(tmp_path: Path, *argv, env: dict | None = None, cwd: Path | None = None) -> Light:
    """Run ``edgeq ARGV`` in a fresh interpreter and assert it loaded neither the compiler nor ONNX."""
    report = tmp_path / f"modules-{os.urandom(4).hex()}.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps([str(a) for a in argv]), str(report)],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, **(env or {})})
    assert report.exists(), proc.stderr
    data = json.loads(report.read_text())
    res = Light(data["code"], proc.stdout, proc.stderr, set(data["modules"]))
    assert not res.loaded(*COMPILER), (argv, res.loaded(*COMPILER))
    assert not res.loaded(*HEAVY_EDGEQ), (argv, res.loaded(*HEAVY_EDGEQ))
    return res


def no_numpy(res: Light) -> None:
    assert not res.loaded("numpy"), res.loaded("numpy")


# ---- parsing only: --version, --help, usage errors ----------------------------------------------------


def test_version_and_help_list_every_verb_with_its_help(tmp_path):
    from edgeq import __version__
    from edgeq.cli.main import VERBS, build_parser

    version = light(tmp_path, "--version")
    assert version.code == 0 and version.stdout.strip() == f"edgeq {__version__}"
    no_numpy(version)

    helped = light(tmp_path, "--help")
    assert helped.code == 0
    no_numpy(helped)
    subparsers = next(a for a in build_parser()._actions if a.dest == "verb")
    helps = {action.dest: action.help for action in subparsers._choices_actions}
    assert list(helps) == list(VERBS)
    text = " ".join(helped.stdout.split())
    for verb, help_text in helps.items():
        assert help_text and f"{verb} {' '.join(help_text.split())}" in text, verb


@pytest.mark.parametrize("argv", [["package", "--help"], ["bench", "--help"], ["tune", "--help"], ["rpc", "serve", "--help"],
                                  ["fleet", "status", "--help"], ["rollback", "--help"], ["install", "--help"]],
                         ids=lambda argv: "-".join(argv))
def test_verb_help_is_light(tmp_path, argv):
    res = light(tmp_path, *argv)
    assert res.code == 0 and "usage: edgeq" in res.stdout
    no_numpy(res)


def test_package_help_offers_the_library_choices(tmp_path):
    from edgeq.choices import CALIBRATION_METHODS, DEFAULT_METHOD, PRECISIONS, RUNTIME_CHOICES

    text = light(tmp_path, "package", "--help").stdout
    assert "{" + ",".join(PRECISIONS) + "}" in text and "{" + ",".join(RUNTIME_CHOICES) + "}" in text
    assert "{" + ",".join(CALIBRATION_METHODS) + "}" in text and f"(default: {DEFAULT_METHOD})" in text


@pytest.mark.parametrize("argv, words", [
    ([], ["give a command: devices, package"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["package", "model.onnx"], ["--device"]),
    (["package", "model.onnx", "--device", "host", "--precision", "int3"], ["invalid choice: 'int3'", "fp32"]),
    (["package", "model.onnx", "--device", "host", "--calibration", "max"], ["invalid choice: 'max'", "mse"]),
    (["bench", "b.tar.gz", "--power", "rapl"], ["invalid choice: 'rapl'", "tegrastats"]),
], ids=["no-verb", "unknown-verb", "no-device", "bad-precision", "bad-calibration", "bad-power"])
def test_usage_errors_are_light(tmp_path, argv, words):
    res = light(tmp_path, *argv)
    assert res.code == 2 and res.stdout == ""
    line, = res.stderr.splitlines()
    assert line.startswith("edgeq: error: ")
    for word in words:
        assert word in line


# ---- devices -------------------------------------------------------------------------------------------


def test_devices_lists_every_profile_without_tvm(tmp_path):
    """The host profile's CPU name comes from LLVM inside TVM: found once, then remembered in the cache."""
    from edgeq.targets import profiles

    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = devices_json(cache)  # may load TVM: nothing is cached yet
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "cache" / "edgeq" / "host-cpu").iterdir())
    res = light(tmp_path, "devices", "--json", env=cache)
    assert res.code == 0 and res.stdout == first.stdout
    no_numpy(res)
    listed = {p["name"]: p for p in json.loads(res.stdout)}
    assert list(listed) == list(profiles())
    assert listed["host"]["cpu"]["mcpu"] == profiles()["host"].cpu.mcpu not in ("", "detect")

    table = light(tmp_path, "devices", env=cache)
    assert table.code == 0
    for name in profiles():
        assert name in table.stdout


def test_devices_ignores_a_damaged_cpu_cache(tmp_path):
    from edgeq.targets import profiles

    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert devices_json(cache).returncode == 0
    (entry,) = (tmp_path / "cache" / "edgeq" / "host-cpu").iterdir()
    entry.write_text("znver4 -mattr=+evil\n")  # never a target option: asked of TVM again, and remembered
    again = devices_json(cache)
    assert again.returncode == 0
    assert {p["name"]: p for p in json.loads(again.stdout)}["host"]["cpu"]["mcpu"] == profiles()["host"].cpu.mcpu
    assert entry.read_text().strip() == profiles()["host"].cpu.mcpu


def devices_json(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeq", "devices", "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


# ---- keygen, verify, inspect, install, flash, fleet, rollback on a real bundle -----------------------------


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> dict[str, Path]:
    """A tiny example model packaged for the host and signed with a key made by the light keygen."""
    out = tmp_path_factory.mktemp("light")
    keys = light(out, "keygen", "--out", out / "keys", "--json")
    assert keys.code == 0, keys.stderr
    made = json.loads(keys.stdout)
    assert Path(made["private_key"]).is_file() and Path(made["public_key"]).is_file() and made["key_id"]
    model = out / "tiny.onnx"
    onnx.save_model(make_models.mobilenet_cnn(size=8, width=4, classes=3), model)
    res = run_cli("package", model, "--device", "host", "-o", out / "dist", "-q", "--json",
                  "--sign-key", made["private_key"], "--release", "3")
    assert res.code == 0, res.stderr
    result = json.loads(res.stdout)
    return {"dir": Path(result["bundle_dir"]), "archive": Path(result["archive"]), "pub": Path(made["public_key"]),
            "id": result["bundle_id"], "out": out}


def test_keygen_writes_a_key_pair(tmp_path):
    res = light(tmp_path, "keygen", "--out", tmp_path / "k")
    assert res.code == 0 and "private key" in res.stdout
    assert (tmp_path / "k" / "edgeq_signing.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k" / "edgeq_signing.pub").is_file()


@pytest.mark.parametrize("form", ["dir", "archive"])
def test_verify_checks_the_signature(tmp_path, signed, form):
    res = light(tmp_path, "verify", signed[form], "--pub", signed["pub"])
    assert res.code == 0, res.stderr
    assert res.stdout.startswith(f"ok: {signed['id']} (release 3): ") and "signature verified" in res.stdout
    no_numpy(res)
    other = light(tmp_path, "keygen", "--out", tmp_path / "other")
    assert other.code == 0
    wrong = light(tmp_path, "verify", signed[form], "--pub", tmp_path / "other" / "edgeq_signing.pub")
    assert wrong.code == 7 and "refused" in wrong.stderr


@pytest.mark.parametrize("form", ["dir", "archive"])
def test_inspect_prints_the_manifest(tmp_path, signed, form):
    res = light(tmp_path, "inspect", signed[form])
    assert res.code == 0, res.stderr
    no_numpy(res)  # reading a manifest is edgeq.templates.contract and safebundle: standard library
    text = " ".join(res.stdout.split())
    for words in (f"bundle {signed['id']}", "tiny.onnx (sha256", "fp32", "host: ", "input float32 1x3x8x8",
                  "logits float32 1x3", "runtime/edgeq-run", "with edgeq "):
        assert words in text, words
    raw = light(tmp_path, "inspect", signed[form], "--json")
    assert raw.code == 0 and json.loads(raw.stdout) == json.loads((signed["dir"] / "manifest.json").read_text())


def test_install_verifies_and_installs(tmp_path, signed):
    root = tmp_path / "root"
    res = light(tmp_path, "install", signed["archive"], "--root", root, "--pub", signed["pub"], "--json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout)["bundle_id"] == signed["id"]
    assert (root / "current").resolve() == (root / "releases" / signed["id"]).resolve()
    no_numpy(res)
    repaired = light(tmp_path, "install", "--root", root, "--repair-state")
    assert repaired.code == 0 and "release 3" in repaired.stdout


def fleet_file(tmp_path: Path, signed) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    port = free_port()  # nothing listens there
    host_key = ed25519.Ed25519PrivateKey.generate().public_key()
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{port} " + host_key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + "\n")
    (tmp_path / "fleet.toml").write_text("\n".join([
        'known_hosts = "known_hosts"', "connect_timeout = 3", "command_timeout = 10", f'public_key = "{signed["pub"]}"',
        "[[hosts]]", 'name = "dev0"', 'address = "127.0.0.1"', f"port = {port}", f'user = "{getpass.getuser()}"',
        'root = "/nonexistent/edgeq-root"', 'tags = ["canary"]']) + "\n")
    return tmp_path / "fleet.toml"


def test_flash_fleet_and_rollback_need_no_compiler(tmp_path, signed):
    fleet = fleet_file(tmp_path, signed)
    dry = light(tmp_path, "flash", signed["archive"], "--fleet", fleet, "--dry-run", "--json")
    assert dry.code == 0, dry.stderr
    assert json.loads(dry.stdout)["waves"] == [["dev0"]]
    status = light(tmp_path, "fleet", "status", "--fleet", fleet, "--json")
    assert status.code == 1 and "connect" in json.loads(status.stdout)[0]["error"]
    back = light(tmp_path, "rollback", "--fleet", fleet, "--json")
    assert back.code == 1 and json.loads(back.stdout)["hosts"][0]["state"] == "failed"


# ---- one definition of each choice and default ---------------------------------------------------------


def test_the_library_uses_the_cli_choices():
    import edgeq.choices as choices
    import edgeq.package
    import edgeq.quantize
    import edgeq.rpc.bench
    from edgeq.quantize.calibrators import CALIBRATORS

    assert edgeq.package.PRECISIONS is choices.PRECISIONS
    assert edgeq.package.RUNTIME_CHOICES is choices.RUNTIME_CHOICES
    assert edgeq.quantize.DEFAULT_METHOD is choices.DEFAULT_METHOD
    assert tuple(CALIBRATORS) == choices.CALIBRATION_METHODS
    assert edgeq.rpc.bench.POWER_SOURCES == choices.POWER_SOURCES


def defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_cli_defaults_are_the_library_defaults():
    from edgeq.cli.main import build_parser
    from edgeq.package import PackageArgs
    from edgeq.quantize import QuantizeArgs
    from edgeq.rpc.bench import BenchArgs

    parser = build_parser()
    package = parser.parse_args(["package", "m.onnx", "--device", "host"])
    lib = defaults(PackageArgs)
    assert (package.output, package.precision, package.runtime, package.name, package.release, package.records,
            package.sign_key) == (lib["output"], lib["precision"], lib["runtime"], lib["name"], lib["release"],
                                  lib["records"], lib["sign_key"])
    quantize = defaults(QuantizeArgs)
    assert (package.calibration, package.percentile, package.calib_samples, package.accuracy_budget, package.eval) == (
        quantize["method"], quantize["percentile"], quantize["samples"], quantize["accuracy_budget"], quantize["eval"])
    bench = parser.parse_args(["bench", "b.tar.gz"])
    lib = defaults(BenchArgs)
    for name in ("rpc", "key", "repeat", "warmup", "power", "timeout", "session_timeout"):
        assert getattr(bench, name) == lib[name], name
