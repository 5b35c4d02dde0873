"""The fuzz corpora as regression tests (#41, #66): every input benchmarks/fuzz.sh kept (tests/fuzz/corpus/<target>/:
the seeds, what grew coverage, and each input that once crashed) replayed through edgeq-run's targets, built with
g++ under AddressSanitizer and UndefinedBehaviorSanitizer; and run.py's (tests/fuzz/run_py_fuzz.py, fuzzed with
Atheris: ``fuzz.sh --python``), which replay their own corpus (tests/fuzz/corpus-py/<target>/) and edgeq-run's, fed
the same way. A refusal is the right answer; a sanitizer report, a crash or an exception that is not a refusal
fails the test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgeq.runtime.assemble import generated_headers, package_dir

sys.path.insert(0, str(Path(__file__).resolve().parent / "fuzz"))
import run_py_fuzz  # noqa: E402 - tests/fuzz/, beside the C++ targets

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


@pytest.mark.parametrize("target", run_py_fuzz.TARGETS)
def test_run_pys_readers_replay_both_corpora(target):
    """Each input of run.py's corpus and of edgeq-run's for the same target through run.py's reader: taken or
    refused with the reader's own error, never another exception."""
    files = sorted(p for folder in (CORPUS / target, CORPUS.parent / "corpus-py" / target) if folder.is_dir()
                   for p in folder.iterdir() if p.is_file())
    assert len(files) >= 2, f"no corpus for {target}; run benchmarks/fuzz.sh --python"
    failed = []
    for path in files:
        try:
            run_py_fuzz.run_one(target, path.read_bytes())
        except Exception as err:  # noqa: BLE001 - any exception but a refusal is a finding
            failed.append(f"{path.relative_to(ROOT)}: {type(err).__name__}: {err}"[:300])
    assert failed == [], "\n".join(failed[:10])


def test_run_pys_targets_catch_what_they_are_built_to_catch():
    """The Python targets are not replays that cannot fail: a reader raising something other than its refusal,
    and a pipeline that would read back another file name than the one given, are findings."""
    from edgeq.templates import video

    with pytest.raises(ValueError, match="unknown target"):
        run_py_fuzz.run_one("nonsense", b"")
    original = video.quote
    try:
        video.quote = lambda text: '"%s"' % text  # the escaping forgotten: a quote in a URL ends the value early
        with pytest.raises(AssertionError):
            run_py_fuzz.run_one("video", b'rtsp://cam/a"b')
    finally:
        video.quote = original
    run_py_fuzz.run_one("video", b'rtsp://cam/a"b')
