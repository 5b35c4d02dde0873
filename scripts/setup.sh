#!/usr/bin/env bash
# What edgeq needs on a fresh Debian/Ubuntu machine (x86_64 or aarch64 host): the aarch64 cross compiler, a C
# compiler, binutils, and the Python packages in a virtual environment in the checkout, .venv (edgeq editable;
# the CUDA 12 NVRTC wheels for JetPack 6 targets are default dependencies). With --tests also what only the
# tests use: qemu-user, OpenSSH's server, Mender's tools (mender-artifact, mender-client), chromium, GStreamer, the
# image decoders edgeq-run dlopens (and their arm64 builds for qemu), git, and edgeq's test extras. Stock system Pythons refuse `pip install` outside a venv (externally managed), so
# nothing is installed into the interpreter itself. .venv is made from $PYTHON (default python3; 3.10 to
# 3.13), reused when it exists, and made again when PYTHON names another interpreter than the one it has.
# Activate it with `. .venv/bin/activate`. With --zoo also .venv-export: torch, torchvision and transformers for exporting
# the torchvision models and language models the tests and benchmarks use.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PYTHON_GIVEN=${PYTHON:+yes}
PYTHON=${PYTHON:-python3}
ZOO=""
TESTS=""
for arg in "$@"; do
    case "$arg" in
        --zoo) ZOO=yes ;;
        --tests) TESTS=yes ;;
        *) echo "setup: unknown option $arg (give --tests, --zoo or nothing)" >&2; exit 2 ;;
    esac
done

py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
# which installation an interpreter (or a venv's) is: version and real base prefix
py_base() { "$1" -c 'import os, sys; print("%d.%d" % sys.version_info[:2], os.path.realpath(sys.base_prefix))' 2>/dev/null; }

# Is .venv to be made (again)? Missing, broken (its interpreter gone), or not of the interpreter PYTHON names.
make_venv=""
if [ ! -x "$VENV/bin/python" ] || [ -z "$(py_version "$VENV/bin/python")" ]; then
    make_venv=yes
elif [ -n "$PYTHON_GIVEN" ] && [ "$(py_base "$VENV/bin/python")" != "$(py_base "$PYTHON")" ]; then
    make_venv=yes
fi
if [ -n "$make_venv" ] || { [ -n "$ZOO" ] && [ ! -x .venv-export/bin/python ]; }; then
    if ! command -v "$PYTHON" >/dev/null; then
        echo "setup: $PYTHON not found; install it, or pick another interpreter: PYTHON=python3.X bash scripts/setup.sh" >&2
        exit 1
    fi
    version=$(py_version "$PYTHON" || true)
    case "$version" in
        3.1[0-3]) ;;
        "") echo "setup: $PYTHON does not run ($("$PYTHON" -c pass 2>&1 | head -n 1)); PYTHON=python3.X bash scripts/setup.sh picks another" >&2
            exit 1 ;;
        *) echo "setup: $PYTHON is Python $version; edgeq needs 3.10 to 3.13 (PYTHON=python3.X bash scripts/setup.sh)" >&2
           exit 1 ;;
    esac
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v cc >/dev/null || need+=(gcc)
command -v g++ >/dev/null || need+=(g++)  # tests: TVM-written CUDA kernels run on the host (tests/cuda_on_host.py)
command -v readelf >/dev/null || need+=(binutils)         # ELF checks of every file in a bundle
if [ -n "$TESTS" ]; then  # what only the tests use
    [ -x /usr/sbin/sshd ] || need+=(openssh-server)   # the fleet tests run real sshd hosts on loopback
    command -v ssh-keygen >/dev/null || need+=(openssh-client)
    command -v qemu-aarch64 >/dev/null || need+=(qemu-user)   # runs aarch64 bundles (edgeq-run) in the tests
    command -v git >/dev/null || need+=(git)                  # tests/test_install.py installs the checkout's files
    command -v mender-artifact >/dev/null || need+=(mender-artifact)  # tests/test_mender.py: Mender's own artifact tool
    command -v mender >/dev/null || need+=(mender-client)      # ... and its client, installing edgeq's artifacts
    command -v unshare >/dev/null || need+=(util-linux)        # the client runs in a private mount namespace
    # edgeq-run and run.py --input VIDEO reach the system's GStreamer, as a device's (JetPack ships it); the tests make
    # their videos with gst-launch-1.0 (MJPEG in AVI from plugins-good, H.264 from plugins-ugly's x264enc)
    command -v gst-launch-1.0 >/dev/null || need+=(gstreamer1.0-tools)
    for pkg in gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-ugly gstreamer1.0-libav; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    # edgeq-run --input IMAGE dlopens the system's decoders, as a device's: libpng 1.6 and libjpeg-turbo's TurboJPEG
    ldconfig -p 2>/dev/null | grep -q 'libpng16.so.16 ' || need+=(libpng16-16)
    if ! ldconfig -p 2>/dev/null | grep -q 'libturbojpeg.so.0 '; then
        if grep -qi '^ID=ubuntu' /etc/os-release 2>/dev/null; then need+=(libturbojpeg); else need+=(libturbojpeg0); fi
    fi
fi
# Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a package of its own: python3-venv, python3.X-venv
if [ -n "$make_venv$ZOO" ] && ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    need+=("$(basename "$(command -v "$PYTHON")")-venv")
fi
want_chromium=""
[ -z "$TESTS" ] || command -v chromium >/dev/null || want_chromium=yes  # the --report test opens the HTML in a headless browser
if [ ${#need[@]} -gt 0 ] || [ -n "$want_chromium" ]; then
    $SUDO apt-get update -qq
    # Debian calls it chromium; Ubuntu has only a snap wrapper (chromium-browser), which does not run here
    if [ -n "$want_chromium" ]; then
        if [ -n "$(apt-cache policy chromium 2>/dev/null | sed -n 's/^ *Candidate: //p' | grep -v '(none)')" ]; then
            echo "setup: installing Debian package: chromium"
            DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
        else
            echo "setup: no chromium package here (Ubuntu ships it as a snap): the test that opens an HTML report in a headless browser needs one"
        fi
    fi
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${need[*]}"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
# the aarch64 libpng, zlib and libturbojpeg for the qemu test of edgeq-run --input IMAGE: Debian's arm64 packages,
# downloaded and unpacked into build/arm64-decoders, not installed (an installed arm64 libc6 in /lib/aarch64-linux-gnu
# would be preferred by qemu's loader over the cross toolchain's, and slows every aarch64 test 100-fold). Debian only
# (Ubuntu serves arm64 from another mirror); where it fails, the test says why it skips.
decoders="$PWD/build/arm64-decoders"  # (the checkout: cd above)
if [ -n "$TESTS" ] && [ ! -e "$decoders/libturbojpeg.so.0" ] && grep -qi '^ID=debian' /etc/os-release 2>/dev/null; then
    echo "setup: fetching Debian's arm64 libpng16-16, zlib1g and libturbojpeg0 into build/arm64-decoders (not installed)"
    debs="$(mktemp -d)"
    { { dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64; } &&
      $SUDO apt-get update -qq &&
      (cd "$debs" && apt-get download -qq libpng16-16:arm64 zlib1g:arm64 libturbojpeg0:arm64 2>/dev/null) &&
      for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/tree"; done &&
      mkdir -p "$decoders" && cp -a "$debs"/tree/usr/lib/aarch64-linux-gnu/*.so* "$debs"/tree/lib/aarch64-linux-gnu/*.so* "$decoders"/ 2>/dev/null;
      [ -e "$decoders/libturbojpeg.so.0" ]; } ||
        echo "setup: could not fetch the arm64 decoders; tests/test_images.py skips its aarch64 test"
    rm -rf "$debs"
fi
# ... and Debian's arm64 GStreamer for the qemu test of edgeq-run --input VIDEO: the libraries and the few plugins the
# test's pipelines use, unpacked into build/arm64-gstreamer/{lib,plugins} (not installed, as above)
gst_arm64="$PWD/build/arm64-gstreamer"
if [ -n "$TESTS" ] && [ ! -e "$gst_arm64/plugins/libgstapp.so" ] && grep -qi '^ID=debian' /etc/os-release 2>/dev/null; then
    echo "setup: fetching Debian's arm64 GStreamer into build/arm64-gstreamer (not installed)"
    debs="$(mktemp -d)"
    pkgs="libgstreamer1.0-0 libgstreamer-plugins-base1.0-0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good libglib2.0-0
          libffi8 libpcre2-8-0 libunwind8 libdw1 libelf1 liblzma5 libbz2-1.0 libzstd1 libcap2 liborc-0.4-0
          libjpeg62-turbo zlib1g libmount1 libselinux1 libblkid1"
    { { dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64; } &&
      $SUDO apt-get update -qq &&
      (cd "$debs" && apt-get download -qq $(for p in $pkgs; do echo "$p:arm64"; done) 2>/dev/null) &&
      for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/tree"; done &&
      mkdir -p "$gst_arm64/lib" "$gst_arm64/plugins" &&
      cp -a "$debs"/tree/usr/lib/aarch64-linux-gnu/*.so* "$debs"/tree/lib/aarch64-linux-gnu/*.so* "$gst_arm64/lib/" 2>/dev/null;
      for plugin in coreelements app videotestsrc videoconvertscale playback typefindfunctions avi jpeg isomp4; do
          cp "$debs/tree/usr/lib/aarch64-linux-gnu/gstreamer-1.0/libgst$plugin.so" "$gst_arm64/plugins/" || break
      done;
      [ -e "$gst_arm64/plugins/libgstisomp4.so" ]; } ||
        echo "setup: could not fetch Debian's arm64 GStreamer; tests/test_video.py skips its aarch64 test"
    rm -rf "$debs"
fi

if [ -n "$make_venv" ]; then
    echo "setup: making $VENV from $(command -v "$PYTHON") (Python $(py_version "$PYTHON"))"
    "$PYTHON" -m venv --clear "$VENV"
fi
PY="$VENV/bin/python"
# Installed already from this very pyproject.toml into this interpreter (with the test extras where --tests
# asks for them), and edgeq runs: nothing to do.
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $(py_version "$PY") $PWD"
have="$(cat "$VENV/.edgeq-setup" 2>/dev/null || true)"
extras=""
[ -n "$TESTS" ] && extras="[test]"
if { [ "$have" = "$stamp [test]" ] || { [ -z "$TESTS" ] && [ "$have" = "$stamp " ]; }; } &&
        "$VENV/bin/edgeq" --version >/dev/null 2>&1; then
    echo "setup: $VENV is up to date"
else
    echo "setup: installing edgeq${extras} and its Python dependencies into $VENV (the first time about 250 MB to download)"
    "$PY" -m pip install --disable-pip-version-check -e ".${extras}"
    echo "$stamp ${extras}" > "$VENV/.edgeq-setup"
fi
echo "setup: fetching the aarch64 TVM runtime and CUDA header wheels a Jetson bundle carries (cached)"
"$PY" -m edgeq.runtime.assemble
if [ -n "$ZOO" ]; then
    # torch + torchvision in an environment of their own, used only to export the torchvision zoo
    # (examples/export_torchvision.py): tvm-ffi imports torch whenever it is importable, which would add
    # seconds to every edgeq command. These pins are the builds this project tests with. On x86_64 torch
    # 2.13.0 is the CPU build where pip finds it (1 GB; the CUDA build PyPI has is 5.5 GB and filled CI's
    # disk), and torchvision goes in without its dependencies, which would pull that CUDA build back in:
    # beside a CPU torch its detection operators do not load, which no classification model uses.
    case "$(uname -m)" in
        aarch64) torch_pins=(torch==2.9.1) vision_pin=torchvision==0.24.1 ;;
        *) torch_pins=(torch==2.13.0) vision_pin=torchvision==0.28.0 ;;
    esac
    if [ ! -x .venv-export/bin/python ]; then
        echo "setup: making .venv-export (torch, torchvision and transformers, to export the torchvision zoo and language models)"
        "$PYTHON" -m venv .venv-export
    fi
    pip_export=(.venv-export/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir)
    # transformers (and accelerate, gguf: loading a GGUF checkpoint) export the language models (examples/export_llm.py)
    "${pip_export[@]}" "${torch_pins[@]}" "onnx>=1.21" numpy pillow transformers==5.25.0 accelerate==1.16.0 gguf==0.19.0
    "${pip_export[@]}" --no-deps "$vision_pin"
fi
echo "setup: done ($("$VENV/bin/edgeq" --version), Python $(py_version "$PY") in $VENV; activate it with: . $VENV/bin/activate)"
