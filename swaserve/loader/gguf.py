"""GGUF files: header/metadata parsing, vectorised torch dequantisation, and the public loader API
(config, HF-named tensors). Architecture-specific conventions live in `gguf_names.py`.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swaserve.loader import gguf_names

Q = GGMLQuantizationType
# GGUF value type -> struct format (numpy reads the same codes); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor table of one GGUF file; no tensor data is read.

    Invariant: string arrays the caller did not ask for (the 262k-token vocabulary) are stored as
    their element count, so parsing stays well under a second; numeric arrays are numpy arrays.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def read_gguf_header(path: str | os.PathLike[str], string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse a GGUF file's header. `string_arrays` names the string-array keys to decode in full.

    This parser exists because GGUFReader (the `gguf` package, our reference in tests) builds a
    numpy view per array element: >10 s on a 262k vocabulary, against ~0.1 s with `struct` here.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":  # also catches an empty file, which cannot be mapped
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        try:
            return _parse(path, buf, string_arrays)
        except (struct.error, IndexError, OverflowError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None


def _parse(path: Path, buf: mmap.mmap, string_arrays: tuple[str, ...]) -> GGUFHeader:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian is not)")
    pos, meta = 24, {}
    for _ in range(n_kv):
        key, pos = _read_str(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        meta[key], pos = _read_value(buf, pos + 4, vtype, key in string_arrays)
    entries = []
    for _ in range(n_tensors):
        name, pos = _read_str(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), qtype, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = []
    for name, shape, qtype, offset in entries:
        try:
            qt = Q(qtype)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has unknown ggml type {qtype}") from None
        block, type_size = GGML_QUANT_SIZES[qt]
        n = int(np.prod(shape, dtype=np.int64))
        tensors.append(TensorInfo(name, shape, qt, data_start + offset, n // block * type_size))
    if "general.architecture" not in meta:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    return GGUFHeader(path, meta, tuple(tensors))


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    if (end := pos + 8 + struct.unpack_from("<Q", buf, pos)[0]) > len(buf):
        raise IndexError("string runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8", errors="replace"), end


def _read_value(buf: mmap.mmap, pos: int, vtype: int, keep_strings: bool) -> tuple[Any, int]:
    if vtype in _SCALARS:
        (value,) = struct.unpack_from(_SCALARS[vtype], buf, pos)
        return value, pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return _read_str(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"GGUF metadata value of unknown type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:
        arr = np.frombuffer(buf, dtype=np.dtype(_SCALARS[etype]), count=count, offset=pos).copy()
        return arr, pos + arr.nbytes
    if etype != _STRING:
        raise ValueError(f"GGUF metadata array of unsupported element type {etype}")
    values: list[str] = []
    for _ in range(count):
        if keep_strings:
            value, pos = _read_str(buf, pos)
            values.append(value)
        else:
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
    return (values if keep_strings else count), pos


# --- dequantisation -------------------------------------------------------------------------------
# Each function maps raw blocks [n_blocks, type_size] uint8 to [n_blocks, block_size] float32 with the
# same float32 operations, in the same order, as `gguf.quants` (so results are bit-identical to it).


def _half(b: torch.Tensor, start: int) -> torch.Tensor:  # [n, 1] float32
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    # Low nibbles of each `group` bytes come first, then the high nibbles (ggml's layout).
    n = qs.shape[0]
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return ((qs.reshape(n, -1, 1, group) >> shifts) & 0x0F).reshape(n, -1)


def _bits(qh: torch.Tensor, group: int, width: int) -> torch.Tensor:
    n, per_byte = qh.shape[0], 8 // width
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).view(1, 1, per_byte, 1)
    return ((qh.reshape(n, -1, 1, group) >> shifts) & ((1 << width) - 1)).reshape(n, -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # 12 packed bytes -> 8 x 6 bits
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1).float()
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1).float()
    return sc, mn


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[:, 2:], 16).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * _nibbles(b[:, 4:], 16).float() + _half(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 1, 1) << 4)
    return _half(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8], 1, 1) << 4)
    return _half(b, 0) * q.float() + _half(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # Q4_K / Q5_K: d*sc*q - dmin*m
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d, dm = (_half(b, 0) * sc).view(n, 8, 1), (_half(b, 2) * mn).view(n, 8, 1)
    return (d * q.float().view(n, 8, 32) - dm).view(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32, 1) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _nibbles(b[:, :128], 64) | (_bits(b[:, 128:192], 32, 2) << 4)
    d = (_half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    return (d * (q.float() - 32).view(n, 16, 16)).view(n, 256)


_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}  # fmt: skip
_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_QUANT_TYPES = tuple(t.name for t in (*_FLOATS, *_DEQUANT))


def _unsupported(qtype: GGMLQuantizationType) -> str:
    return f"unsupported GGUF quant type {qtype.name}; supported: {', '.join(SUPPORTED_QUANT_TYPES)}"


_CHUNK_BLOCKS = 1 << 15  # blocks per step: temporaries stay at tens of MiB, not the tensor's size


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF bytes (uint8, 1-D) of one tensor -> float32 tensor of `shape` (a new allocation)."""
    if qtype in _FLOATS:
        return raw.view(_FLOATS[qtype]).to(torch.float32, copy=True).view(shape)
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise ValueError(_unsupported(qtype))
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = raw.view(-1, type_size)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[start : start + _CHUNK_BLOCKS] = fn(blocks[start : start + _CHUNK_BLOCKS])
    return out.view(shape)


# --- public API -----------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    return read_gguf_header(path)


def _header(path: str | os.PathLike[str]) -> GGUFHeader:
    # Memoised on (path, size, mtime): config, tensors and tokenizer of one start share one parse.
    if not (p := Path(path)).is_file():
        raise ValueError(f"GGUF file not found: {p}")
    return _cached_header(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns)


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """The file's `general.architecture` (e.g. "gemma3")."""
    return _header(path).architecture


def load_gguf_config(path: str | os.PathLike[str]) -> Any:
    """A transformers `PretrainedConfig` (e.g. `Gemma3TextConfig`) built from the GGUF metadata."""
    header = _header(path)
    return gguf_names.build_config(header.architecture, header.metadata, [t.name for t in header.tensors])


def iter_gguf_tensors(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` in file order, one dequantised tensor at a time (CPU, `dtype`).

    llama.cpp's conventions are undone (Gemma norms lose their +1, llama Q/K rows are un-permuted);
    tensors HF lacks (`rope_freqs`) are skipped. The file is checked (architecture, tensor types,
    sizes) before anything is yielded, so a bad file fails at the call, not halfway through a load.
    """
    header = _header(path)
    names = gguf_names.tensor_name_map(header.architecture)
    config = load_gguf_config(path)
    size = header.path.stat().st_size
    for info in header.tensors:
        if info.qtype not in _FLOATS and info.qtype not in _DEQUANT:
            raise ValueError(f"{header.path}: tensor {info.name}: {_unsupported(info.qtype)}")
        if info.offset + info.nbytes > size:
            raise ValueError(f"{header.path} is truncated: tensor {info.name} runs past the end of the file")
    return _tensors(header, names, config, dtype)


def _tensors(
    header: GGUFHeader, names: dict[str, str], config: Any, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    # Copy-on-write mapping: torch wants a writable buffer, and nothing is ever written back.
    data = torch.from_numpy(np.memmap(header.path, mode="c", dtype=np.uint8))
    for info in header.tensors:
        hf_name = gguf_names.hf_tensor_name(info.name, names)
        if hf_name is None:
            continue
        w = dequantize(data[info.offset : info.offset + info.nbytes], info.qtype, info.shape)
        w = gguf_names.fix_tensor(header.architecture, info.name, w, config)
        yield hf_name, w if dtype == torch.float32 else w.to(dtype)
