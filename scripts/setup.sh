#!/usr/bin/env bash
# Everything edgeq and its tests need on a fresh Debian/Ubuntu machine (x86_64 or aarch64 host):
# the aarch64 cross compiler, qemu-user, a C compiler, and the Python packages (edgeq editable, with the CUDA 12
# NVRTC wheels for JetPack 6 targets and the test tools). With --zoo also .venv-export: torch and torchvision
# for exporting the torchvision models the tests and benchmarks/zoo.py use.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v cc >/dev/null || need+=(gcc)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)   # the fleet tests run real sshd hosts on loopback
command -v ssh-keygen >/dev/null || need+=(openssh-client)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)   # runs aarch64 bundles (edgeq-run) in the tests
command -v readelf >/dev/null || need+=(binutils)         # ELF checks of every file in a bundle
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
echo "setup: installing edgeq and its Python dependencies"
"$PYTHON" -m pip install -q --disable-pip-version-check -e ".[jetson,test]"
echo "setup: fetching the aarch64 TVM runtime and CUDA header wheels a Jetson bundle carries (cached)"
"$PYTHON" -m edgeq.runtime.wheels
if [ "${1:-}" = "--zoo" ]; then
    # torch + torchvision in an environment of their own, used only to export the torchvision zoo
    # (examples/export_torchvision.py): tvm-ffi imports torch whenever it is importable, which would add
    # seconds to every edgeq command. These pins are the builds this project tests with.
    case "$(uname -m)" in
        aarch64) torch_pins=(torch==2.9.1 torchvision==0.24.1) ;;
        *) torch_pins=(torch==2.14.1 torchvision==0.29.1) ;;
    esac
    if [ ! -x .venv-export/bin/python ]; then
        echo "setup: making .venv-export (torch and torchvision, to export the torchvision zoo)"
        "$PYTHON" -m venv .venv-export
    fi
    .venv-export/bin/python -m pip install -q --disable-pip-version-check "${torch_pins[@]}" "onnx>=1.21"
fi
echo "setup: done ($("$PYTHON" -m edgeq --version))"
