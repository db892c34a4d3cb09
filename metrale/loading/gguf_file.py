"""A GGUF file read tensor by tensor: what `mx.load(path, return_metadata=True)` returns, without the whole file
mapped at once.

`mx.load` maps the file and copies every tensor out of the mapping before it unmaps it, so a load peaks at the
file's size in mapped pages plus all the copies: 3.59 GiB of VmHWM for the 1.9 GiB 3B-shaped Q4_0 file (AMD EPYC
Zen 3; RssFile 1.74 + RssAnon 1.93 GiB sampled from outside the process). `read_gguf` parses the header itself and
has the CPU kernels' extension read each tensor with ordinary reads, block by block, into its final arrays
(`ext.read_gguf_tensor`, kernels/csrc/gguf_read.cpp): at any moment it holds the tensors read so far and a 4 MiB
buffer. Without the extension built it is mx.load.

Formats: F32, F16, I8, I16, I32 tensors as they are; Q4_0, Q4_1 and Q8_0 as MLX's affine triples, exactly as
mx.load builds them (`name.weight` packed uint32, `name.scales`, `name.biases` float16, group size 32: MLX's
mlx/io/gguf_quants.cpp). A file with any other tensor type (the types MLX 0.32's mx.load widens to float16: the
K-quants, Q5_0, BF16, ...) is read by mx.load, as before. Metadata values as mx.load gives them: numbers as mx.arrays (64-bit floats as
float32), strings as str, arrays of strings as lists. (mx.load itself dies with SIGSEGV on 64-bit float metadata,
scalar or array, in MLX 0.32: such files are read here, or refused with an error where they would need mx.load.)

    GGUF (little-endian): "GGUF", version u32, tensor count u64, key count u64; keys (string, type u32, value);
    tensor infos (name, n_dims u32, dims u64 x n_dims (fastest first), type u32, offset u64); data at the next
    multiple of general.alignment (32), each tensor at data start + offset. A string is a u64 length + bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kernels import ext
from kernels.runtime import mx

__all__ = ["read_gguf", "read_gguf_metadata"]

# metadata value types -> (struct format, numpy dtype of the mx.array that mx.load makes)
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
    5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
    12: ("<d", np.float32),  # mx.load keeps 64-bit floats as float32
}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _ShortHeader(Exception):
    """The header runs past the end of the file."""


class _NotReadHere(Exception):
    """Something this parser leaves to mx.load (an older or big-endian file, a metadata type it does not know,
    text that is not UTF-8): mx.load reads it, or refuses it with its own error, as before."""


class _Header:
    """Parses the metadata and the tensor infos from the file's first bytes."""

    def __init__(self, data: memoryview) -> None:
        self.view = data
        self.at = 0
        self.float64 = False  # a 64-bit float value was read (mx.load crashes on those: see read_gguf)

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.view):
            raise _ShortHeader
        values = struct.unpack_from(fmt, self.view, self.at)
        self.at += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        end = self.at + length
        if end > len(self.view):
            raise _ShortHeader
        try:
            text = str(self.view[self.at:end], "utf-8")
        except UnicodeDecodeError as error:
            raise _NotReadHere("text that is not UTF-8") from error
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<IQ")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _ARRAY_DTYPES:
                raise _NotReadHere(f"metadata array type {item}")
            dtype = np.dtype(_ARRAY_DTYPES[item])
            end = self.at + dtype.itemsize * count
            if end > len(self.view):
                raise _ShortHeader
            values = np.frombuffer(self.view, dtype=dtype, count=count, offset=self.at)  # (a view: mx.array copies)
            self.at = end
            if item == 12:  # float32, as mx.load would make it (a double past its range becomes inf)
                self.float64 = True
                with np.errstate(over="ignore"):
                    return mx.array(values.astype(np.float32))
            return mx.array(values)
        if kind not in _SCALARS:
            raise _NotReadHere(f"metadata type {kind}")
        fmt, dtype = _SCALARS[kind]
        self.float64 |= kind == 12
        (value,) = self.unpack(fmt)
        return mx.array(np.array(value, dtype=dtype))


class _Parsed(NamedTuple):
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int, int]]  # (name, MLX shape, ggml type, offset)
    data_start: int
    float64: bool  # some metadata value is a 64-bit float


def _parse(data: memoryview) -> _Parsed:
    header = _Header(data)
    magic, version, n_tensors, n_keys = header.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):  # (version 1 had 32-bit counts; big-endian files read as huge)
        raise _NotReadHere(f"magic {magic!r}, version {version}")
    metadata: dict[str, Any] = {}
    for _ in range(n_keys):
        key = header.string()
        (kind,) = header.unpack("<I")
        metadata[key] = header.value(kind)
    tensors = []
    for _ in range(n_tensors):
        name = header.string()
        (n_dims,) = header.unpack("<I")
        dims = header.unpack(f"<{n_dims}Q")
        kind, offset = header.unpack("<IQ")
        tensors.append((name, tuple(int(d) for d in reversed(dims)), kind, offset))
    alignment = int(metadata["general.alignment"].item()) if "general.alignment" in metadata else 32
    return _Parsed(metadata, tensors, -(-header.at // alignment) * alignment, header.float64)


def _read_header(path: Path) -> _Parsed:
    """The header, parsed from a read-only mapping of the file: a header of several MiB (a 128k vocabulary) read
    into a bytes object would be a large malloc block, and freeing one raises glibc's mmap threshold to its size,
    after which the weight arrays freed by the repacking stay in the heap (+0.3 GiB of RSS at the 1B shape). The
    parse touches only the header's pages; the mapping is closed before any tensor is read."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return _parse(view)
        except _ShortHeader:
            raise ValueError(f"GGUF: {path} ends inside its header") from None
        finally:
            view.release()


def _readable(tensors: list[tuple[str, tuple[int, ...], int, int]], block_values: dict[int, int]) -> bool:
    """True when every tensor is of a type the extension reads (`block_values`: ggml type -> values per block)
    and has whole blocks per row."""
    return all(shape and kind in block_values and shape[-1] % block_values[kind] == 0
               for _name, shape, kind, _offset in tensors)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata as mx.load returns it, from its header alone (mx.load reads every tensor too)."""
    path = Path(path)
    try:
        return _read_header(path).metadata
    except _NotReadHere:
        return mx.load(str(path), return_metadata=True)[1]


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors, metadata) of a GGUF file, as `mx.load(path, return_metadata=True)` returns them (see the module
    docstring); mx.load itself without the kernels built, or for a file with something not read here."""
    path = Path(path)
    module = ext.load()
    if module is None or not hasattr(module, "gguf_block_values"):
        return mx.load(str(path), return_metadata=True)
    try:
        parsed = _read_header(path)
    except _NotReadHere:
        return mx.load(str(path), return_metadata=True)
    if not _readable(parsed.tensors, module.gguf_block_values()):
        if parsed.float64:  # MLX 0.32's GGUF reader dies with SIGSEGV on these: an error, not a crash
            raise ValueError(f"GGUF: {path} has 64-bit float metadata and tensor types that only MLX's reader "
                             "reads, which crashes on such metadata")
        return mx.load(str(path), return_metadata=True)
    arrays: dict[str, mx.array] = {}
    for name, shape, kind, offset in sorted(parsed.tensors, key=lambda t: t[3]):
        parts = module.read_gguf_tensor(str(path), parsed.data_start + offset, kind, list(shape))
        prefix = name[:-len(".weight")]  # (as mx.load cuts it, whatever the name ends with)
        names = [name] if len(parts) == 1 else [name, prefix + ".scales", prefix + ".biases"]
        for key, array in zip(names, parts):
            if key in arrays:
                raise ValueError(f"GGUF: {path} holds {key!r} twice")
            arrays[key] = array
    return arrays, parsed.metadata
