"""Bounded reader for GGUF headers (metadata + tensor table), never the weights.

Reads strictly sequentially from a path or any object with `read(n)`, so the same code can
parse a local file or the first bytes of a remote one. In `exact` mode (remote sources, where
every byte is a network fetch) read-ahead never goes past a lower bound of the header's end
that the parser keeps up to date, so not a single byte of the weights is requested.
Every count, length and the total size is capped, so a malformed or hostile header fails
with GGUFFormatError instead of exhausting memory or time. The checks mirror
ggml/src/gguf.cpp where llama.cpp is stricter.

Over 400 lines because every read is bounded and checked (a hostile header must not
exhaust memory): the value types, the tensor table and the ggml type sizes belong together.
"""
from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple

from tandem.errors import GGUFFormatError, ModelError


GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # llama.cpp rejects tensor names of this length or longer

# GGUF value types (gguf.h)
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32 = range(7)
T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(7, 13)

# scalar type -> struct format character (all little-endian)
_SCALAR_FMT = {
    T_UINT8: "B", T_INT8: "b", T_UINT16: "H", T_INT16: "h", T_UINT32: "I", T_INT32: "i",
    T_FLOAT32: "f", T_BOOL: "?", T_UINT64: "Q", T_INT64: "q", T_FLOAT64: "d",
}
_SCALAR_SIZE = {t: struct.calcsize("<" + c) for t, c in _SCALAR_FMT.items()}

# ggml type id -> (name, elements per block, bytes per block); ggml.h / ggml.c type_traits.
# Ids missing here (4, 5, 31-33, 36-38) were removed from llama.cpp and are rejected.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}

# Smallest encodings, used for the lower bound of the header's end in exact mode:
# key length (8) + key (>= 1 byte) + value type (4) + value (>= 1 byte)
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# name length (8) + n_dims (4) + type (4) + offset (8); names and dims may be empty
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MIN_ITEM_BYTES = {T_STRING: 8, T_ARRAY: 12}  # scalars: their size
_MAX_EXACT_READ = 16 << 20  # one request at most; a 152k-token vocabulary needs ~1.2 MB

_TRUNCATED_HINT = "The file is incomplete or damaged; delete it and download it again."
_MALFORMED_HINT = "The file is not a valid GGUF model; re-download it or convert it again."


@dataclass(frozen=True)
class HeaderLimits:
    """Caps that bound time and memory; generous for real models (262k-token vocabularies)."""

    max_kv: int = 65_536
    max_tensors: int = 65_536
    max_key_bytes: int = 65_536
    max_string_bytes: int = 1 << 20  # chat templates reach ~100 KB
    max_array_len: int = 1_000_000
    max_array_elements: int = 4_000_000  # across all arrays: tokens, scores, types, merges
    max_array_depth: int = 3  # the GGUF spec allows nested arrays; llama.cpp itself allows 1
    max_header_bytes: int = 64 << 20
    read_chunk: int = 256 << 10  # read-ahead; kept small so remote readers fetch little


DEFAULT_LIMITS = HeaderLimits()


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (ne0)
    ggml_type: int
    offset: int  # relative to the start of the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]

    @property
    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.n_elements // block * size


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    header_bytes: int  # bytes of magic + counts + KV pairs + tensor table
    bytes_read: int = 0  # bytes taken from the source, read-ahead included
    source_name: str = "model"
    tensors_read: bool = True  # False: only the metadata was parsed (tensors is empty)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """Architecture-scoped key, e.g. arch_get("context_length") -> llama.context_length."""
        arch = self.architecture
        return self.metadata.get(f"{arch}.{suffix}", default) if arch else default

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def context_length(self) -> int | None:
        value = self.arch_get("context_length")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def alignment(self) -> int:
        value = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        return value if isinstance(value, int) else DEFAULT_ALIGNMENT

    @property
    def data_offset(self) -> int:
        """File offset where the tensor data starts (the header padded to the alignment)."""
        if not self.tensors:
            return self.header_bytes
        return _pad(self.header_bytes, self.alignment)

    @property
    def data_size(self) -> int:
        """Size of the data section: every tensor padded to the alignment, as llama.cpp does."""
        return sum(_pad(t.nbytes, self.alignment) for t in self.tensors)

    @property
    def expected_file_size(self) -> int:
        """Minimum size of a complete file; the last tensor may lack its trailing padding."""
        if not self.tensors:
            return self.header_bytes
        last = self.tensors[-1]
        return self.data_offset + last.offset + last.nbytes


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def tensor_data_bytes(header: GGUFHeader) -> dict[str, int]:
    """Bytes of weights per tensor name (unpadded), from ggml block sizes."""
    return {t.name: t.nbytes for t in header.tensors}


class _Truncated(Exception):
    pass


class _Reader:
    """Sequential buffered reader over a read(n) callable with a hard byte budget."""

    def __init__(self, read: Callable[[int], bytes], limits: HeaderLimits, exact: bool = False):
        self._read = read
        self._limit = limits.max_header_bytes
        self._chunk = limits.read_chunk
        self.exact = exact
        self.min_end = 0  # exact mode: source offset the header is known to reach
        self.buf = b""
        self.pos = 0
        self._base = 0  # source offset of buf[0]
        self.bytes_read = 0  # also the source offset just past buf (nothing is skipped)

    def expect(self, more: int) -> None:
        """At least `more` header bytes follow the current position (exact mode read-ahead)."""
        end = self.consumed + more
        if end > self.min_end:
            self.min_end = end

    @property
    def consumed(self) -> int:
        return self._base + self.pos

    def fill(self, n: int) -> None:
        """Make n bytes available at self.pos, reading more from the source if needed."""
        avail = len(self.buf) - self.pos
        if avail >= n:
            return
        if self.consumed + n > self._limit:
            raise GGUFFormatError(
                f"GGUF header is larger than the {self._limit >> 20} MiB limit",
                _MALFORMED_HINT,
            )
        need = n - avail
        if self.exact:
            ahead = min(self.min_end - (self.bytes_read + need), _MAX_EXACT_READ)
            want = need + max(0, ahead)
        else:
            want = max(need, self._chunk)
        want = min(want, self._limit - self.bytes_read)
        parts = [self.buf[self.pos:]]
        got = 0
        while got < need:
            try:
                data = self._read(want - got)
            except OSError as exc:
                raise ModelError(f"cannot read the model file: {exc}", _TRUNCATED_HINT) from exc
            if not data:
                break
            data = bytes(data[: want - got])
            parts.append(data)
            got += len(data)
        self.bytes_read += got
        self._base += self.pos
        self.buf = b"".join(parts)
        self.pos = 0
        if got < need:
            raise _Truncated

    def take(self, n: int) -> bytes:
        self.fill(n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int) -> Any:
        size = _SCALAR_SIZE[vtype]
        self.fill(size)
        (value,) = struct.unpack_from("<" + _SCALAR_FMT[vtype], self.buf, self.pos)
        self.pos += size
        return value

    def u32(self) -> int:
        return self.scalar(T_UINT32)

    def u64(self) -> int:
        return self.scalar(T_UINT64)

    def string(self, max_len: int, what: str) -> str:
        n = self.u64()
        if n > max_len:
            raise GGUFFormatError(
                f"GGUF {what} is {n} bytes long, over the {max_len}-byte limit", _MALFORMED_HINT
            )
        # errors="replace": token texts are compared as text; invalid bytes never crash us.
        return self.take(n).decode("utf-8", errors="replace")

    def numeric_array(self, vtype: int, n: int) -> list[Any]:
        size = _SCALAR_SIZE[vtype] * n
        self.fill(size)
        view = memoryview(self.buf)[self.pos:self.pos + size]
        self.pos += size
        fmt = _SCALAR_FMT[vtype]
        if sys.byteorder == "little":
            return view.cast(fmt).tolist()
        return list(struct.unpack(f"<{n}{fmt}", view))

    def string_array(self, n: int, max_len: int, tail: int = 0) -> list[str]:
        """`tail`: bytes known to follow the array (exact-mode read-ahead bound)."""
        # Hot loop for 150k+ token vocabularies: avoid per-item method calls when buffered.
        out: list[str] = []
        unpack = struct.unpack_from
        for i in range(n):
            if len(self.buf) - self.pos < 8:
                if self.exact:
                    self.expect(8 * (n - i) + tail)
                self.fill(8)
            (length,) = unpack("<Q", self.buf, self.pos)
            if length > max_len:
                raise GGUFFormatError(
                    f"GGUF string array item is {length} bytes long, over the {max_len}-byte limit",
                    _MALFORMED_HINT,
                )
            start = self.pos + 8
            if len(self.buf) - start < length:
                self.pos += 8
                if self.exact:
                    self.expect(length + 8 * (n - i - 1) + tail)
                self.fill(length)
                start = self.pos
            out.append(self.buf[start:start + length].decode("utf-8", errors="replace"))
            self.pos = start + length
        return out


class _Parser:
    def __init__(self, reader: _Reader, limits: HeaderLimits, name: str, tensors: bool = True):
        self.r = reader
        self.limits = limits
        self.name = name
        self.tensors = tensors
        self.where = "the file magic"
        self.array_elements = 0
        self.tail = 0  # minimum bytes after the current metadata value (exact mode)

    def fail(self, message: str, hint: str = _MALFORMED_HINT) -> GGUFFormatError:
        return GGUFFormatError(f"{self.name}: {message}", hint)

    def parse(self) -> GGUFHeader:
        r = self.r
        r.expect(24)  # magic, version and the two counts
        try:
            magic = r.take(4)
        except _Truncated:
            magic = r.buf[r.pos:]
            if not magic:
                raise self.fail("the file is empty, not a GGUF model", _TRUNCATED_HINT) from None
            if GGUF_MAGIC.startswith(magic):
                raise
        if magic != GGUF_MAGIC:
            raise self.fail(
                f"not a GGUF file (starts with {magic!r})",
                "Pass a .gguf model file; other formats must be converted with llama.cpp first.",
            )
        self.where = "the version"
        version = r.u32()
        self.check_version(version)
        self.where = "the tensor and key counts"
        n_tensors = r.u64()
        n_kv = r.u64()
        if n_tensors > self.limits.max_tensors:
            raise self.fail(f"tensor count {n_tensors} exceeds the limit {self.limits.max_tensors}")
        if n_kv > self.limits.max_kv:
            raise self.fail(f"metadata key count {n_kv} exceeds the limit {self.limits.max_kv}")
        # the tensor table follows the metadata even when it is not parsed
        self.tensor_table_min = n_tensors * _MIN_TENSOR_INFO_BYTES
        metadata = self.read_metadata(n_kv)
        alignment = self.check_alignment(metadata)
        tensors = self.read_tensors(n_tensors, alignment) if self.tensors else []
        return GGUFHeader(
            version=version,
            metadata=metadata,
            tensors=tensors,
            header_bytes=r.consumed,
            bytes_read=r.bytes_read,
            source_name=self.name,
            tensors_read=self.tensors,
        )

    def check_version(self, version: int) -> None:
        if version == 1:
            raise self.fail(
                "GGUF version 1 is no longer supported by llama.cpp",
                "Convert the model again with a current llama.cpp, or download a newer GGUF.",
            )
        if version != 0 and version & 0xFFFF == 0:
            raise self.fail(
                "the GGUF file is big-endian (or the version is corrupt); only little-endian "
                "files are supported",
                "Download the little-endian build of this model.",
            )
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(
                f"unsupported GGUF version {version} (supported: 2 and 3)",
                "Update tandem, or re-download/convert the model with a current llama.cpp.",
            )

    def read_metadata(self, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            self.where = f"metadata key {i}"
            self.tail = (n_kv - i - 1) * _MIN_KV_BYTES + self.tensor_table_min
            self.r.expect(_MIN_KV_BYTES + self.tail)
            key = self.r.string(self.limits.max_key_bytes, "metadata key")
            if not key:
                raise self.fail(f"metadata key {i} is empty")
            if key in metadata:
                raise self.fail(f"duplicate metadata key '{key}'")
            self.where = f"the value of '{key}'"
            metadata[key] = self.read_value(self.r.u32(), key, depth=0)
        return metadata

    def read_value(self, vtype: int, key: str, depth: int) -> Any:
        if vtype in _SCALAR_FMT:
            return self.r.scalar(vtype)
        if vtype == T_STRING:
            return self.r.string(self.limits.max_string_bytes, f"string value of '{key}'")
        if vtype == T_ARRAY:
            return self.read_array(key, depth + 1)
        raise self.fail(f"metadata key '{key}' has unknown value type {vtype}")

    def read_array(self, key: str, depth: int) -> list[Any]:
        if depth > self.limits.max_array_depth:
            raise self.fail(
                f"metadata key '{key}' nests arrays deeper than {self.limits.max_array_depth}"
            )
        item_type = self.r.u32()
        n = self.r.u64()
        if n > self.limits.max_array_len:
            raise self.fail(
                f"metadata array '{key}' has {n} items, over the limit {self.limits.max_array_len}"
            )
        self.array_elements += n
        if self.array_elements > self.limits.max_array_elements:
            raise self.fail(
                f"metadata arrays hold more than {self.limits.max_array_elements} items in total"
            )
        # Nested arrays get no bound of their own: the outer one's stays valid.
        tail = self.tail if depth == 1 else 0
        item_min = _SCALAR_SIZE.get(item_type) or _MIN_ITEM_BYTES.get(item_type, 0)
        if depth == 1:
            self.r.expect(n * item_min + tail)
        if item_type in _SCALAR_FMT:
            return self.r.numeric_array(item_type, n)
        if item_type == T_STRING:
            return self.r.string_array(n, self.limits.max_string_bytes, tail)
        if item_type == T_ARRAY:
            return [self.read_array(key, depth + 1) for _ in range(n)]
        raise self.fail(f"metadata array '{key}' has unknown item type {item_type}")

    def check_alignment(self, metadata: dict[str, Any]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        value = metadata["general.alignment"]
        # llama.cpp requires a uint32 power of two; bool is an int subclass, exclude it.
        valid = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not valid or value & (value - 1):
            raise self.fail(f"general.alignment must be a power of two, got {value!r}")
        return value

    def read_tensors(self, n_tensors: int, alignment: int) -> list[TensorInfo]:
        tensors: list[TensorInfo] = []
        seen: set[str] = set()
        expected_offset = 0
        for i in range(n_tensors):
            self.where = f"tensor info {i}"
            self.r.expect((n_tensors - i) * _MIN_TENSOR_INFO_BYTES)
            name = self.r.string(GGML_MAX_NAME - 1, "tensor name")
            if name in seen:
                raise self.fail(f"duplicate tensor name '{name}'")
            seen.add(name)
            self.where = f"tensor '{name}'"
            n_dims = self.r.u32()
            if n_dims > GGML_MAX_DIMS:
                raise self.fail(f"tensor '{name}' has {n_dims} dimensions (max {GGML_MAX_DIMS})")
            self.r.expect(8 * n_dims + 12 + (n_tensors - i - 1) * _MIN_TENSOR_INFO_BYTES)
            shape = tuple(self.r.u64() for _ in range(n_dims))
            ggml_type = self.r.scalar(T_INT32)
            offset = self.r.u64()
            info = TensorInfo(name, shape, ggml_type, offset)
            self.check_tensor(info)
            if offset != expected_offset:
                raise self.fail(self._offset_problem(tensors, info, expected_offset))
            expected_offset += _pad(info.nbytes, alignment)
            tensors.append(info)
        return tensors

    @staticmethod
    def _offset_problem(before: list[TensorInfo], t: TensorInfo, expected: int) -> str:
        """An offset that disagrees with the table: either this offset or the previous
        tensor's shape/type (which sizes its data) is wrong, so name both."""
        if not before:
            return f"tensor '{t.name}' has data offset {t.offset}, expected 0 (the first tensor)"
        prev = before[-1]
        return (f"tensor '{t.name}' has data offset {t.offset}, but the previous tensor "
                f"'{prev.name}' (shape {list(prev.shape)}, {prev.type_name}) ends at "
                f"{expected}: one of the two entries is corrupt")

    def check_tensor(self, t: TensorInfo) -> None:
        if any(d >= 1 << 63 for d in t.shape):
            raise self.fail(f"tensor '{t.name}' has a negative dimension")
        if t.n_elements >= 1 << 63:
            raise self.fail(f"tensor '{t.name}' has too many elements {t.shape}")
        if t.ggml_type not in GGML_TYPES:
            raise self.fail(
                f"tensor '{t.name}' has unknown ggml type {t.ggml_type}",
                "The model may need a newer llama.cpp than the one tandem ships.",
            )
        block = GGML_TYPES[t.ggml_type][1]
        row = t.shape[0] if t.shape else 1
        if row % block:
            raise self.fail(
                f"tensor '{t.name}' row of {row} elements is not a multiple of the "
                f"{t.type_name} block size {block}"
            )


def _read_callable(source: Any) -> Callable[[int], bytes]:
    read = getattr(source, "read", None)
    if not callable(read):
        raise TypeError("source must be a path or an object with read(n)")
    return read


def _parse(
    read: Callable[[int], bytes],
    limits: HeaderLimits,
    name: str,
    *,
    exact: bool = False,
    tensors: bool = True,
) -> GGUFHeader:
    parser = _Parser(_Reader(read, limits, exact), limits, name, tensors)
    try:
        return parser.parse()
    except _Truncated:
        raise GGUFFormatError(
            f"{name}: GGUF file is truncated (it ended while reading {parser.where}, "
            f"after {parser.r.bytes_read} bytes)",
            _TRUNCATED_HINT,
        ) from None


def read_gguf_header(
    source: str | os.PathLike[str] | BinaryIO | Any,
    *,
    limits: HeaderLimits = DEFAULT_LIMITS,
    check_size: bool = True,
    exact: bool = False,
    tensors: bool = True,
) -> GGUFHeader:
    """Parse the GGUF header from a path or a sequential reader (anything with read(n)).

    For paths, `check_size` also compares the file size with the size the tensor table
    implies, so a download cut off inside the weights is reported as truncated.
    `exact`: never read ahead past the header (for remote readers: no weight bytes).
    `tensors=False` stops after the metadata (enough for vocabulary checks).
    Raises ModelError (missing/unreadable file) or GGUFFormatError (anything malformed).
    """
    if not isinstance(source, (str, os.PathLike)):
        name = str(getattr(source, "name", "model"))
        return _parse(_read_callable(source), limits, name, exact=exact, tensors=tensors)

    path = Path(source)
    try:
        if path.exists() and not path.is_dir() and not path.is_file():
            # opening a named pipe blocks until a writer comes, possibly forever
            raise ModelError(f"{path} is not a regular file (a pipe or a device)",
                             "pass a .gguf file on disk")
        f = open(path, "rb")
    except FileNotFoundError:
        raise ModelError(
            f"model file not found: {path}",
            "Check the path, or download the model first.",
        ) from None
    except IsADirectoryError:
        raise ModelError(
            f"{path} is a directory, not a GGUF file", "Pass the .gguf file itself."
        ) from None
    except OSError as exc:
        raise ModelError(
            f"cannot open {path}: {exc.strerror or exc}", "Check the file's permissions."
        ) from None
    with f:
        header = _parse(f.read, limits, str(path), exact=exact, tensors=tensors)
        size = os.fstat(f.fileno()).st_size
    if check_size and tensors and size < header.expected_file_size:
        raise GGUFFormatError(
            f"{path}: GGUF file is truncated ({size} bytes, the tensor table needs "
            f"{header.expected_file_size})",
            _TRUNCATED_HINT,
        )
    return header
