"""edgeq-run's fuzz corpus as a regression test (#41): every input benchmarks/fuzz.sh kept (tests/fuzz/corpus/
<target>/: the seeds, what grew coverage, and each input that once crashed) replayed through the same targets,
built with g++ under AddressSanitizer and UndefinedBehaviorSanitizer. A refusal is the right answer; a
sanitizer report, a crash or an exception that is not a refusal fails the test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edgeq.runtime.assemble import generated_headers, package_dir

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
TARGETS = ("json", "manifest", "npy", "png", "jpeg", "yolo")
SANITIZERS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all")


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed")
    build = tmp_path_factory.mktemp("fuzz")
    for name, text in generated_headers().items():
        (build / name).write_bytes(text)
    binary = build / "edgeq-run-fuzz"
    proc = subprocess.run(["g++", "-std=c++17", "-O1", "-g", "-ffp-contract=off", "-DEDGEQ_FUZZ_REPLAY", *SANITIZERS,
                           f"-I{build}", f"-I{ROOT / 'templates' / 'native'}", f"-I{package_dir('tvm_ffi') / 'include'}",
                           str(ROOT / "tests" / "fuzz" / "edgeq_run_fuzz.cc"), "-o", str(binary), "-ldl"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return binary


@pytest.mark.parametrize("target", TARGETS)
def test_the_fuzz_corpus_replays_clean_under_asan_and_ubsan(replay, target):
    files = sorted(p for p in (CORPUS / target).iterdir() if p.is_file())
    assert len(files) >= 2, f"tests/fuzz/corpus/{target} holds no corpus; run benchmarks/fuzz.sh"
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
    proc = subprocess.run([str(replay), target, *map(str, files)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"{target}: {len(files)} inputs"


def test_a_target_finds_what_it_is_built_to_find(replay, tmp_path):
    """The replay is not a test that cannot fail: the .npy header that once read past its end (a 'shape' key with
    nothing after its colon, found by fuzz.sh) is refused now; before, UBSan stopped the replay here."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape':"
    npy = tmp_path / "colon-at-end.npy"
    npy.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    proc = subprocess.run([str(replay), "npy", str(npy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "npy: 1 inputs", proc.stderr
    proc = subprocess.run([str(replay), "nonsense", str(npy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown target" in proc.stderr
