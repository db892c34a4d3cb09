"""metrale.loading.gguf_file: a GGUF file read tensor by tensor gives exactly what mx.load gives (every tensor
type it reads, every metadata type, alignment, 3-D tensors), leaves the rest to mx.load, refuses a truncated
file clearly, and what it was built for: reading a file needs about the file's size in memory, not twice it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from kernels import ext
from kernels.runtime import mx

from metrale.loading.gguf_file import read_gguf, read_gguf_metadata

needs_reader = pytest.mark.skipif(ext.load() is None or not hasattr(ext.load(), "gguf_block_values"),
                                  reason="kernels not built: python -m kernels.build")
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
ROOT = str(Path(__file__).resolve().parents[3])


def random_blocks(rng, qtype: Q, rows: int, values_per_row: int) -> np.ndarray:
    """Random blocks of `qtype` (rows, bytes per row) uint8 whose float16 fields are finite."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * values_per_row // block_values, block_bytes), dtype=np.uint8)
    halves = {Q.Q4_0: 1, Q.Q8_0: 1, Q.Q4_1: 2, Q.Q4_K: 2}[qtype]  # leading float16 fields (Q4_K: d, dmin)
    blocks[:, :2 * halves] = (rng.standard_normal((blocks.shape[0], halves)) * 0.05).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_every_type(path: Path, *, alignment: int | None = None, extra_q4_k: bool = False,
                     float64: bool = False) -> None:
    """Every tensor type read here and every metadata type; float64: 64-bit float metadata too, on which mx.load
    (MLX 0.32) dies with SIGSEGV, so only files without it are compared with mx.load."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for vtype, value in [(V.UINT8, 200), (V.INT8, -5), (V.UINT16, 60000), (V.INT16, -300), (V.UINT32, 4_000_000_000),
                         (V.INT32, -7), (V.FLOAT32, 0.1), (V.BOOL, True), (V.UINT64, 2**40), (V.INT64, -2**40),
                         (V.STRING, "héllo ▁wörld")]:
        w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    for sub, values in [(V.UINT8, [1, 255]), (V.INT8, [-1, 2]), (V.UINT16, [1, 65535]), (V.INT16, [-2, 3]),
                        (V.UINT32, [1, 2**32 - 1]), (V.INT32, [-4, 5]), (V.FLOAT32, [0.5, -1.25]),
                        (V.BOOL, [True, False]), (V.UINT64, [1, 2**63]), (V.INT64, [-1, 2**62]),
                        (V.STRING, ["a", "<0x0A>", "日本"])]:
        w.add_key_value(f"test.array.{sub.name.lower()}", values, V.ARRAY, sub_type=sub)
    if float64:
        w.add_key_value("test.float64", 0.1, V.FLOAT64)
        w.add_key_value("test.array.float64", [0.1, 1e300], V.ARRAY, sub_type=V.FLOAT64)
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal((7,)).astype(np.float16))
    w.add_tensor("plain.i8", rng.integers(-128, 128, (2, 3), dtype=np.int8))
    w.add_tensor("plain.i16", rng.integers(-2**15, 2**15, (4,), dtype=np.int16))
    w.add_tensor("plain.i32", rng.integers(-2**31, 2**31, (2, 2, 2), dtype=np.int32))
    for qtype, shape in [(Q.Q4_0, (24, 96)), (Q.Q4_1, (8, 64)), (Q.Q8_0, (16, 32))]:
        name = f"blk.0.{qtype.name.lower()}.weight"
        w.add_tensor(name, random_blocks(rng, qtype, *shape), raw_dtype=qtype)
    experts = random_blocks(rng, Q.Q4_0, 3 * 16, 64).reshape(3, 16, -1)  # (experts, rows, bytes): a 3-D tensor
    w.add_tensor("blk.0.ffn_gate_exps.weight", experts, raw_dtype=Q.Q4_0)
    if extra_q4_k:  # a type read by mx.load only (MLX 0.32 widens it to float16)
        w.add_tensor("blk.0.q4_k.weight", random_blocks(rng, Q.Q4_K, 6, 512), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_as_mx_load(path: Path) -> None:
    ours_t, ours_m = read_gguf(path)
    theirs_t, theirs_m = mx.load(str(path), return_metadata=True)
    assert set(ours_t) == set(theirs_t)
    for name, want in theirs_t.items():
        got = ours_t[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert np.array_equal(np.array(got).view(np.uint8), np.array(want).view(np.uint8)), name
    assert_same_metadata(ours_m, theirs_m)


def assert_same_metadata(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for key, want in theirs.items():
        got = ours[key]
        if isinstance(want, mx.array):
            assert isinstance(got, mx.array) and (got.shape, got.dtype) == (want.shape, want.dtype), key
            assert np.array_equal(np.array(got), np.array(want)), key
        else:
            assert type(got) is type(want) and got == want, key


@needs_reader
@pytest.mark.parametrize("alignment", [None, 64])
def test_every_tensor_and_metadata_type_reads_as_mx_load_reads_it(tmp_path, alignment):
    path = tmp_path / "every.gguf"
    write_every_type(path, alignment=alignment)
    assert_same_as_mx_load(path)
    assert_same_metadata(read_gguf_metadata(path), mx.load(str(path), return_metadata=True)[1])


@needs_reader
def test_the_default_model_reads_as_mx_load_reads_it():
    """SmolLM2-135M: Q4_1 layers, a Q8_0 embedding, float32 norms, a 49,152-token vocabulary and its merges."""
    from metrale.loading.default_model import default_model_path

    assert_same_as_mx_load(default_model_path())


@needs_reader
def test_a_type_read_only_by_mx_load_sends_the_whole_file_there(tmp_path):
    path = tmp_path / "q4k.gguf"
    write_every_type(path, extra_q4_k=True)
    tensors, _ = read_gguf(path)
    assert tensors["blk.0.q4_k.weight"].dtype == mx.float16  # mx.load's widening
    assert_same_as_mx_load(path)


@needs_reader
def test_64_bit_float_metadata_reads_as_float32_and_never_reaches_mx_load(tmp_path):
    """mx.load (MLX 0.32) crashes the process on these; read here they are float32 (a double past float32's
    range: inf), and where the tensors would need mx.load the file is refused with an error instead."""
    path = tmp_path / "f64.gguf"
    write_every_type(path, float64=True)
    tensors, metadata = read_gguf(path)
    assert metadata["test.float64"].dtype == mx.float32 and metadata["test.float64"].item() == np.float32(0.1)
    assert np.array_equal(np.array(metadata["test.array.float64"]), np.array([0.1, np.inf], dtype=np.float32))
    assert "blk.0.q4_1.scales" in tensors
    write_every_type(path, float64=True, extra_q4_k=True)
    with pytest.raises(ValueError, match="64-bit float metadata"):
        read_gguf(path)


@needs_reader
def test_a_truncated_file_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_type(path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="ends inside a tensor"):
        read_gguf(path)
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="ends inside its header"):
        read_gguf(tmp_path / "head.gguf")


@needs_reader
@pytest.mark.parametrize("ggml_type", [0, 2])  # F32, Q4_0
def test_a_tensor_claiming_more_than_the_file_holds_is_refused_before_allocating(tmp_path, ggml_type):
    """A header's dims are the file's word: 2^60 values (4 EiB as float32) are refused against the file's size,
    not allocated; dims whose product overflows are refused as well."""
    path = tmp_path / "every.gguf"
    write_every_type(path)
    with pytest.raises(ValueError, match="ends inside a tensor"):
        ext.load().read_gguf_tensor(str(path), 0, ggml_type, [2**30, 2**30])
    with pytest.raises(ValueError, match="overflows"):
        ext.load().read_gguf_tensor(str(path), 0, ggml_type, [2**31 - 32] * 3)


PEAK_OF_READING = """
import sys
from kernels.runtime import mx
from metrale.loading.gguf_file import read_gguf

def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now (Linux >= 4.0)
    f.write("5")
before = hwm_mib()
tensors, _ = read_gguf(sys.argv[2]) if sys.argv[1] == "ours" else mx.load(sys.argv[2], return_metadata=True)
mx.eval(list(tensors.values()))
print(hwm_mib() - before, sum(a.nbytes for a in tensors.values()) / 2**20)
"""


def peak_of_reading(reader: str, path: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PEAK_OF_READING, reader, str(path)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    grown, arrays = (float(v) for v in out.stdout.split())
    return grown, arrays


@needs_reader
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_reading_a_file_needs_its_size_not_twice_it(tmp_path):
    """A 72 MiB Q4_0 file, in a fresh process: the peak RSS grows by the arrays read (+ a few MiB of buffers and
    libraries); mx.load's, measured beside it, by the arrays and the whole mapped file."""
    rng = np.random.default_rng(1)
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for i in range(4):
        w.add_tensor(f"blk.{i}.w.weight", random_blocks(rng, Q.Q4_0, 4096, 8192), raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file_mib = path.stat().st_size / 2**20
    grown, arrays = peak_of_reading("ours", path)
    assert grown <= arrays + 24, (grown, arrays, file_mib)
    grown_mx, _ = peak_of_reading("mx", path)
    assert grown_mx >= arrays + 0.8 * file_mib, (grown_mx, arrays, file_mib)
