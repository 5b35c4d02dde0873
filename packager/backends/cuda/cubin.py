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


def elf_symbol_sizes(cubin: bytes, prefix: str) -> dict[str, int]:
    """{symbol: st_size} of the ELF64 symbols whose names start with ``prefix`` (a cubin's ``.symtab``)."""
    sections = _sections(cubin)
    out = {}
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, _info, _other, _shndx, _value, size = struct.unpack_from("<IBBHQQ", cubin, off)
            start = strtab[4] + name_off
            name = cubin[start:cubin.index(b"\0", start)].decode()
            if name.startswith(prefix):
                out[name[len(prefix):]] = size
    return out


def _sections(cubin: bytes) -> list[tuple]:
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]


def section_sizes(cubin: bytes) -> dict[str, int]:
    """{section name: size} of a cubin (``.nv.global``: its uninitialized ``__device__`` variables)."""
    sections = _sections(cubin)
    names = sections[struct.unpack_from("<H", cubin, 0x3E)[0]]  # e_shstrndx
    out = {}
    for sh in sections:
        start = names[4] + sh[0]
        out[cubin[start:cubin.index(b"\0", start)].decode()] = sh[5]
    return out


def cuda_tool(name: str) -> str | None:
    """cuobjdump / nvdisasm: from NVIDIA's PyPI wheels (edgeq's test extra) or a CUDA toolkit on PATH."""
    import shutil
    import sysconfig

    wheel_bin = Path(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin", name)
    return str(wheel_bin) if wheel_bin.exists() else shutil.which(name)
