"""run.py and edgeq-run on the same generated documents (#41): seeded manifests, images, .npy inputs and weight and
golden tables, valid and damaged (tests/differential.py makes them). The exit status, the answer and the
output bytes must agree; a refusal is one line with nothing written. benchmarks/differential.py runs more."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import differential

from edgeq.templates import imaging

CASES = 300


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return differential.package(tmp_path_factory.mktemp("differential"))


def test_both_loaders_agree_on_generated_documents(bundle, tmp_path):
    cases = differential.cases(41, CASES, bundle, tmp_path / "scratch")
    bad, codes = differential.run_cases(bundle, cases, tmp_path / "work")
    assert not bad, f"{len(bad)} of {CASES} cases differ:\n" + "\n".join(bad[:10])
    # the cases reach every class of answer, not only refusals: accepted, self-test failed, usage, damaged bundle
    assert codes.get(0, 0) >= CASES // 5 and codes.get(2, 0) >= CASES // 20 and codes.get(7, 0) >= CASES // 10, codes
    assert codes.get(1, 0) >= 1, codes


def _case(bundle, tmp_path, name, args, files=None):
    case = differential.Case(name, args, files or {})
    work = tmp_path / name
    work.mkdir()
    return differential.run_both(bundle, case, work)


def test_what_the_loaders_once_read_differently(bundle, tmp_path):
    """Each of these differed before (found by the generator): now both give the same answer."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    x = np.random.default_rng(0).standard_normal(differential.SHAPE).astype(np.float32)
    # a Fortran-order .npy: edgeq-run refused it, run.py (numpy) read it; both read it now, as the same tensor
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asfortranarray(x))
    (tmp_path / "f.npy").write_bytes(buf.getvalue())
    py, native = _case(bundle, tmp_path, "fortran", ["--input", f"x={tmp_path / 'f.npy'}", "--json"])
    assert py.code == native.code == 0 and py.outputs == native.outputs, (py.stderr, native.stderr)
    assert py.outputs["y"].endswith(x.tobytes())
    # manifest fields only run.py's contract checked (golden.seed), only edgeq-run checked (golden.format), or
    # each read its own way (device.cuda_arch not text): refused alike now, exit 7, one line
    for name, change in (("seed", ("golden", "seed", [])), ("format", ("golden", "format", "stretch")),
                         ("cuda-arch", ("device", "cuda_arch", 1 << 40)), ("bytes", ("weights", "bytes", None))):
        m = json.loads(json.dumps(manifest))
        if change[2] is None:
            del m[change[0]][change[1]]
        else:
            m[change[0]][change[1]] = change[2]
        py, native = _case(bundle, tmp_path, name, ["--self-test", "--json"], {"manifest.json": json.dumps(m).encode()})
        assert py.code == native.code == 7, (name, py.stderr, native.stderr)
        assert py.stderr.count("\n") == native.stderr.count("\n") == 1
    # a golden table without an output's entry: run.py crashed (KeyError), edgeq-run refused
    m = json.loads(json.dumps(manifest))
    m["golden"]["tensors"] = [t for t in m["golden"]["tensors"] if t["name"] != "output:y"]
    py, native = _case(bundle, tmp_path, "golden-entry", ["--self-test"], {"manifest.json": json.dumps(m).encode()})
    assert py.code == native.code == 7 and "the golden file has no output:y" in py.stderr + native.stderr
    assert differential.disagreement(py, native) is None
    # an expected output of another shape: both report the same tolerance, from the expected values as they are
    m = json.loads(json.dumps(manifest))
    entry = next(t for t in m["golden"]["tensors"] if t["name"] == "output:logits")
    entry["shape"] = [entry["shape"][1]]
    py, native = _case(bundle, tmp_path, "golden-shape", ["--self-test", "--json"], {"manifest.json": json.dumps(m).encode()})
    assert py.code == native.code == 1 and json.loads(py.stdout) == json.loads(native.stdout), (py.stdout, native.stdout)


def test_the_comparison_itself_finds_differences(bundle, tmp_path):
    """The judge is not one that cannot fail: a different exit, answer or output byte, a refusal in two lines,
    or a refusal that wrote its outputs is each a disagreement."""
    ok = differential.Result(0, '{"top": []}', "", {"y": b"1"})
    assert differential.disagreement(ok, ok) is None
    assert "exit" in differential.disagreement(ok, differential.Result(2, "", "x\n", None))
    assert "answers" in differential.disagreement(ok, differential.Result(0, '{"top": [1]}', "", {"y": b"1"}))
    assert "bytes" in differential.disagreement(ok, differential.Result(0, '{"top": []}', "", {"y": b"2"}))
    refused = differential.Result(7, "", "one line\n", None)
    assert differential.disagreement(refused, differential.Result(7, "", "two\nlines\n", None))
    assert "wrote" in differential.disagreement(refused, differential.Result(7, "", "one line\n", {"y": b""}))


def test_a_jpeg_libjpeg_only_warns_about_is_read_alike(bundle, tmp_path):
    """Garbage between two JPEG markers: libjpeg warns ("Corrupt JPEG data: 3 extraneous bytes before marker")
    and Pillow decoded the image on, while libturbojpeg refuses it. run.py decoded it and answered, edgeq-run
    refused. Both decode JPEGs with libturbojpeg now (imaging.decode_jpeg), so both refuse, in one line."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (24, 20, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    dht = data.index(b"\xff\xc4")
    damaged = data[:dht] + b"\x01\x02\x03" + data[dht:]
    with Image.open(io.BytesIO(damaged)) as image:  # Pillow alone reads it (what run.py did)
        image.load()
    (tmp_path / "warned.jpg").write_bytes(damaged)
    py, native = _case(bundle, tmp_path, "warned", ["--input", str(tmp_path / "warned.jpg"), "--json"])
    assert differential.disagreement(py, native) is None, (py.code, py.stderr, native.code, native.stderr)
    assert py.code == native.code == 2 and len(py.stderr.strip().splitlines()) == 1, py.stderr
    # the undamaged file: both read it, to the same answer
    (tmp_path / "plain.jpg").write_bytes(data)
    py, native = _case(bundle, tmp_path, "plain", ["--input", str(tmp_path / "plain.jpg"), "--json"])
    assert py.code == native.code == 0 and differential.disagreement(py, native) is None


def _library_file(soname: str) -> Path | None:
    """Where this machine's dlopen finds ``soname`` (the file, links resolved), or None."""
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return None
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith(soname.split(".so")[0] + ".so"):
            return Path(path).resolve()
    return None


@pytest.mark.parametrize("kind, soname", [("jpeg", "libturbojpeg.so.0"), ("png", "libpng16.so.16")])
def test_a_missing_decoding_library_is_refused_alike(bundle, tmp_path, kind, soname):
    """Where the library edgeq-run decodes an image kind with is missing, run.py refuses it too, with the same
    line: before, run.py decoded it with Pillow and answered while edgeq-run refused (#66 item 6). The library
    is hidden from both, as a process, in a mount namespace of its own (/dev/null over the file)."""
    from PIL import Image

    library = _library_file(soname)
    if library is None:
        pytest.skip(f"{soname} is not installed here (scripts/setup.sh --tests installs it)")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind /dev/null "$0"', str(library)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace to hide {soname} in: {probe.stderr.strip()}")
    image = tmp_path / f"photo.{'jpg' if kind == 'jpeg' else 'png'}"
    Image.fromarray(np.random.default_rng(4).integers(0, 255, (24, 20, 3), dtype=np.uint8)).save(
        image, "JPEG" if kind == "jpeg" else "PNG", **({"progressive": True} if kind == "jpeg" else {}))
    hide = ["unshare", "-m", "sh", "-c", 'mount --bind /dev/null "$0" && exec "$@"', str(library)]
    results = {}
    for loader, command in (("py", [sys.executable, str(bundle / "run.py")]),
                            ("native", [str(bundle / "runtime" / "edgeq-run")])):
        for hidden in (False, True):
            out = tmp_path / f"{loader}-{hidden}.npz"
            proc = subprocess.run([*(hide if hidden else []), *command, "--input", str(image), "--json", "--output",
                                   str(out)], capture_output=True, text=True, cwd=bundle, timeout=300)
            results[loader, hidden] = (proc.returncode, proc.stdout, proc.stderr, out.exists())
    # with the library both read the image, to the same answer
    assert results["py", False][0] == results["native", False][0] == 0, results
    assert json.loads(results["py", False][1]) == json.loads(results["native", False][1])
    # without it both refuse, exit 2, in the same one line, writing nothing
    want = imaging.JPEG_LIBRARY_MISSING if kind == "jpeg" else imaging.PNG_LIBRARY_MISSING
    for loader in ("py", "native"):
        code, _, stderr, wrote = results[loader, True]
        assert code == 2 and not wrote, (loader, results[loader, True])
        assert len(stderr.strip().splitlines()) == 1 and stderr.strip().endswith(want), (loader, stderr)
