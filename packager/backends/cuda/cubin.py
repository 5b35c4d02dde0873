"""The CUDA device code (cubins) a TVM library carries, read from the library's bytes."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

EM_CUDA = 190


@dataclasses.dataclass(frozen=True)
class CudaImage:
    """One CUDA device-code ELF (cubin) embedded in a library, whole: cuobjdump can read ``data``."""

    arch: str
    offset: int
    data: bytes


def cuda_images(library: Path) -> list[CudaImage]:
    """The CUDA cubins embedded in a library (TVM keeps them, bare or inside a fatbin, in its module blob).

    A library built where TVM's CUDA backend did not run carries CUDA *source*, and this returns [].
    """
    data = library.read_bytes()
    images = []
    start = data.find(b"\x7fELF", 1)
    while start != -1:
        header = data[start : start + 64]
        if len(header) == 64 and header[4] == 2 and struct.unpack_from("<H", header, 18)[0] == EM_CUDA:
            flags = struct.unpack_from("<I", header, 48)[0]
            # CUDA ELF ABI version 8+ (CUDA 12.8 and later) moved the SM number to bits 8..15.
            sm = (flags >> 8) & 0xFF if header[8] >= 8 else flags & 0xFF
            phoff, shoff = struct.unpack_from("<QQ", header, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 54)
            size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
            images.append(CudaImage(f"sm_{sm}", start, data[start : start + size]))
        start = data.find(b"\x7fELF", start + 1)
    return images


def cuda_device_code(library: Path) -> list[str]:
    """The SM architectures of the CUDA device code embedded in a library."""
    return sorted({image.arch for image in cuda_images(library)})


def cuda_tool(name: str) -> str | None:
    """cuobjdump / nvdisasm: from NVIDIA's PyPI wheels (edgeq's test extra) or a CUDA toolkit on PATH."""
    import shutil
    import sysconfig

    wheel_bin = Path(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin", name)
    return str(wheel_bin) if wheel_bin.exists() else shutil.which(name)
