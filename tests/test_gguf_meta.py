"""Bounded GGUF header reader: real tiny models, malformed and hostile headers, fuzzing."""
from __future__ import annotations

import io
import random
import struct
import tracemalloc

import pytest
from tandem.errors import GGUFFormatError, ModelError
from tandem.models.vocab import VocabInfo
from tandem.models.gguf_meta import (
    GGML_TYPES,
    HeaderLimits,
    read_gguf_header,
    tensor_data_bytes,
)

# GGUF value types used by the hand-built headers below
U8, I32, U32, F32, BOOL, STR, ARR, U64 = 0, 5, 4, 6, 7, 8, 9, 10


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value) -> bytes:
    if vtype == STR:
        return _s(value)
    if vtype == ARR:
        item_type, items = value
        body = b"".join(_value(item_type, v) for v in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    fmt = {U8: "B", I32: "i", U32: "I", F32: "f", BOOL: "?", U64: "Q"}.get(vtype, "I")
    return struct.pack("<" + fmt, value)


def build_header(kvs=(), tensors=(), version: int = 3, magic: bytes = b"GGUF") -> bytes:
    """kvs: (key, type, value); tensors: (name, shape, ggml_type, offset)."""
    out = [magic, struct.pack("<IQQ", version, len(tensors), len(kvs))]
    for key, vtype, value in kvs:
        out += [_s(key), struct.pack("<I", vtype), _value(vtype, value)]
    for name, shape, ggml_type, offset in tensors:
        out += [_s(name), struct.pack("<I", len(shape))]
        out += [struct.pack("<Q", d) for d in shape]
        out += [struct.pack("<iQ", ggml_type, offset)]
    return b"".join(out)


def parse(data: bytes, **kw):
    return read_gguf_header(io.BytesIO(data), **kw)


# --- real files -------------------------------------------------------------------------


# the tiny models of other architectures (scripts/tiny_recurrent_models.py, tiny_mtp_models.py,
# tiny_qwen35_models.py)
OTHER_ARCHS = {"hybrid": "lfm2", "hybrid_draft": "lfm2", "recurrent": "mamba",
               "sliding": "gemma3", "mtp": "glm4moe", "qwen35": "qwen35", "qwen35_draft": "qwen35"}


def test_reads_tiny_models(tiny_models):
    for name, path in tiny_models.items():
        h = read_gguf_header(path)
        assert h.version == 3
        if name in OTHER_ARCHS:  # other tensors; the vocabulary and template are the same
            assert h.architecture == OTHER_ARCHS[name]
            assert h.expected_file_size == path.stat().st_size
            assert "<|assistant|>" in h.chat_template
            continue
        assert h.architecture == "llama"
        assert h.context_length == 4096
        assert h.arch_get("block_count") == 2
        tokens = h.metadata["tokenizer.ggml.tokens"]
        assert isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)
        assert tokens[:3] == ["<unk>", "<s>", "</s>"]
        assert h.metadata["tokenizer.ggml.add_bos_token"] is True
        assert "<|assistant|>" in h.chat_template
        names = [t.name for t in h.tensors]
        assert "token_embd.weight" in names and "output.weight" in names
        assert len(h.tensors) == 2 + 2 * 9 + 1
        assert h.expected_file_size == path.stat().st_size
        assert sum(tensor_data_bytes(h).values()) == sum(4 * t.n_elements for t in h.tensors)
        assert VocabInfo.from_header(h).n_tokens == len(tokens), name


def test_matches_gguf_package(tiny_models):
    gguf = pytest.importorskip("gguf")
    path = tiny_models["target"]
    h = read_gguf_header(path)
    ref = gguf.GGUFReader(path)
    assert ref.data_offset == h.data_offset
    for t, mine in zip(ref.tensors, h.tensors, strict=True):
        assert (t.name, tuple(int(d) for d in t.shape)) == (mine.name, mine.shape)
        assert int(t.tensor_type) == mine.ggml_type
        assert int(t.data_offset) == h.data_offset + mine.offset
        assert t.n_bytes == mine.nbytes
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert field.contents() == pytest.approx(h.metadata[key]), key


def test_reads_only_what_it_needs_from_a_stream(tiny_models):
    data = tiny_models["target"].read_bytes()

    class Stream:  # read() only: no seek, no tell, like an HTTP range reader
        handed_out = 0

        def read(self, n):
            chunk = data[self.handed_out:self.handed_out + min(n, 1000)]  # short reads too
            self.handed_out += len(chunk)
            return chunk

    stream = Stream()
    limits = HeaderLimits(read_chunk=4096)
    h = read_gguf_header(stream, limits=limits)
    assert h.bytes_read == stream.handed_out
    assert h.header_bytes <= h.bytes_read <= h.header_bytes + 4096
    assert h.tensors == read_gguf_header(tiny_models["target"]).tensors


def test_tensor_bytes_for_quantized_types():
    gguf = pytest.importorskip("gguf")
    tensors, offset = [], 0
    for type_id, (_name, block, size) in GGML_TYPES.items():
        tensors.append((f"t{type_id}", (block * 4, 3), type_id, offset))
        offset += (4 * 3 * size + 31) // 32 * 32
    h = parse(build_header(tensors=tensors))
    sizes = tensor_data_bytes(h)
    for type_id, (name, block, size) in GGML_TYPES.items():
        assert sizes[f"t{type_id}"] == 12 * size
        known = {int(t): v for t, v in gguf.GGML_QUANT_SIZES.items()}
        if type_id in known:
            assert known[type_id] == (block, size), name


# --- malformed input --------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ModelError) as exc:
        read_gguf_header(tmp_path / "nope.gguf")
    assert type(exc.value) is ModelError
    assert "not found" in exc.value.message and exc.value.hint


def test_directory(tmp_path):
    with pytest.raises(ModelError):
        read_gguf_header(tmp_path)


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError, match="not a GGUF file") as exc:
        read_gguf_header(path)
    assert exc.value.hint
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        parse(b"{}")
    with pytest.raises(GGUFFormatError, match="empty"):
        parse(b"")


@pytest.mark.parametrize("cut", [2, 6, 20, 100, 2000, -10])
def test_truncated_header(tiny_models, tmp_path, cut):
    data = tiny_models["target"].read_bytes()
    header_bytes = read_gguf_header(tiny_models["target"]).header_bytes
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: cut if cut > 0 else header_bytes + cut])
    with pytest.raises(GGUFFormatError, match="truncated") as exc:
        read_gguf_header(path)
    assert "download" in exc.value.hint


def test_truncated_weights(tiny_models, tmp_path):
    data = tiny_models["target"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-1])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf_header(path)
    assert read_gguf_header(path, check_size=False).tensors  # the header itself is fine


def test_versions():
    assert parse(build_header(version=2)).version == 2
    with pytest.raises(GGUFFormatError, match="version 1 is no longer supported"):
        parse(build_header(version=1))
    with pytest.raises(GGUFFormatError, match="unsupported GGUF version 4"):
        parse(build_header(version=4))
    with pytest.raises(GGUFFormatError, match="unsupported GGUF version 0"):
        parse(build_header(version=0))
    with pytest.raises(GGUFFormatError, match="big-endian"):
        parse(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))


ONE_KV = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63), "key count"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**64 - 1, 0), "tensor count"),
        (ONE_KV + _s("k") + struct.pack("<IQ", STR, 2**62), "limit"),
        (ONE_KV + _s("k") + struct.pack("<IIQ", ARR, U8, 10**12), "items"),
        (ONE_KV + struct.pack("<Q", 2**40), "limit"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + _s("t") + struct.pack("<I", 5), "dimensions"),
    ],
)
def test_huge_counts_rejected_fast(data, match):
    """Refused before anything is allocated for the count (the memory bound; how long it takes
    is a benchmark's question, not a test's)."""
    tracemalloc.start()
    try:
        with pytest.raises(GGUFFormatError, match=match):
            parse(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "kvs, tensors, match",
    [
        ([("a", U32, 1), ("a", U32, 2)], [], "duplicate metadata key"),
        ([("", U32, 1)], [], "empty"),
        ([("a", 13, 1)], [], "unknown value type"),
        ([("general.alignment", U32, 24)], [], "power of two"),
        ([], [("x", (32,), 99, 0)], "unknown ggml type"),
        ([], [("x", (33,), 2, 0)], "block size"),
        ([], [("x", (4,), 0, 0), ("x", (4,), 0, 32)], "duplicate tensor"),
        ([], [("x", (4,), 0, 0), ("y", (4,), 0, 16)], "offset"),
        ([], [("x" * 64, (4,), 0, 0)], "tensor name"),
        ([], [("x", (2**62, 4), 0, 0)], "too many elements"),
        ([], [("x", (2**63,), 0, 0)], "negative"),
    ],
)
def test_malformed_headers(kvs, tensors, match):
    with pytest.raises(GGUFFormatError, match=match):
        parse(build_header(kvs, tensors))


def test_nested_arrays_and_depth_limit():
    inner = (ARR, [(U32, [1, 2]), (U32, [3])])
    h = parse(build_header([("nested", ARR, inner)]))
    assert h.metadata["nested"] == [[1, 2], [3]]
    deep = (ARR, [(ARR, [(ARR, [(U8, [1])])])])
    with pytest.raises(GGUFFormatError, match="nests arrays"):
        parse(build_header([("deep", ARR, deep)]))


def test_scalar_types_and_invalid_utf8():
    kvs = [("u8", U8, 255), ("i32", I32, -5), ("f", F32, 0.5), ("b", BOOL, True),
           ("s", STR, b"ok\xff"), ("toks", ARR, (STR, [b"a", b"\xc3"]))]
    md = parse(build_header(kvs)).metadata
    assert (md["u8"], md["i32"], md["f"], md["b"]) == (255, -5, 0.5, True)
    assert md["s"] == "ok\ufffd" and md["toks"] == ["a", "\ufffd"]


def test_header_size_limit():
    data = build_header([("big", STR, "x" * (3 << 20))])
    limits = HeaderLimits(max_header_bytes=2 << 20, max_string_bytes=4 << 20)
    with pytest.raises(GGUFFormatError, match="larger than"):
        parse(data, limits=limits)
    with pytest.raises(GGUFFormatError, match="limit"):
        parse(data)  # over the default 1 MiB string cap


def test_large_vocabulary_parses_in_one_pass():
    n = 152_000
    kvs = [
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.tokens", ARR, (STR, [f"tok{i}" for i in range(n)])),
        ("tokenizer.ggml.token_type", ARR, (I32, [1] * n)),
        ("tokenizer.ggml.scores", ARR, (F32, [0.0] * n)),
    ]
    data = build_header(kvs)
    h = parse(data)
    assert h.header_bytes <= len(data)  # one pass over the bytes, each entry read once
    assert len(h.metadata["tokenizer.ggml.tokens"]) == n
    assert h.metadata["tokenizer.ggml.tokens"][-1] == f"tok{n - 1}"


# --- fuzzing ----------------------------------------------------------------------------

FUZZ_CASES = 10_000
FUZZ_SEED = 20240601
FUZZ_TRACE_EVERY = 4
FUZZ_PEAK_BYTES = 80 << 20
HUGE = [2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1, 10**6, 10**6 + 1, 2**20 + 1]


def _mutate(base: bytes, rng: random.Random, length_fields: list[int]) -> bytes:
    data = bytearray(base)
    kind = rng.randrange(6)
    if kind == 0:  # byte flips
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:  # truncation
        del data[rng.randrange(len(data)):]
    elif kind == 2:  # a huge length or count where one really is
        pos = rng.choice(length_fields)
        data[pos:pos + 8] = struct.pack("<Q", rng.choice(HUGE))
    elif kind == 3:  # a huge value anywhere
        pos = rng.randrange(len(data) - 8)
        data[pos:pos + 8] = struct.pack("<Q", rng.choice(HUGE))
    elif kind == 4:  # a 32-bit type or dimension count gone wrong
        pos = rng.randrange(len(data) - 4)
        data[pos:pos + 4] = struct.pack("<I", rng.choice([9, 12, 13, 255, 2**31, 5, 0]))
    else:  # delete or duplicate a slice
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 64))
        if rng.random() < 0.5:
            del data[a:b]
        else:
            data[a:a] = data[a:b]
    return bytes(data)


def _fuzz_case(base: bytes, length_fields: list[int], i: int) -> bytes:
    return _mutate(base, random.Random(FUZZ_SEED + i), length_fields)


def _parse_outcome(data: bytes) -> str:
    try:
        parse(data)
        return "ok"
    except GGUFFormatError:
        return "format"
    except ModelError:
        return "model"


def test_fuzz_mutated_headers(tiny_models):
    path = tiny_models["target"]
    base = path.read_bytes()[: read_gguf_header(path).header_bytes + 64]
    # little-endian u64 values that look like a string length or element count
    length_fields = [
        i for i in range(8, len(base) - 8)
        if 0 < struct.unpack_from("<Q", base, i)[0] < 1 << 16
    ]
    outcomes = {"ok": 0, "format": 0, "model": 0}
    for i in range(FUZZ_CASES):
        data = _fuzz_case(base, length_fields, i)
        outcomes[_parse_outcome(data)] += 1  # anything but our errors escapes and fails
    assert outcomes["format"] > FUZZ_CASES // 4  # the mutations do reach the checks

    # tracemalloc slows allocation ~15x, so the memory bound is checked on a quarter of them
    tracemalloc.start()
    try:
        for i in range(0, FUZZ_CASES, FUZZ_TRACE_EVERY):
            data = _fuzz_case(base, length_fields, i)
            tracemalloc.reset_peak()
            _parse_outcome(data)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < FUZZ_PEAK_BYTES, (i, peak)
    finally:
        tracemalloc.stop()


def test_offset_mismatch_names_both_tensors():
    """A wrong shape shows up as the next tensor's offset: the message names both entries."""
    with pytest.raises(GGUFFormatError) as exc:
        parse(build_header([], [("x", (8,), 0, 0), ("y", (4,), 0, 16)]))
    assert "tensor 'y' has data offset 16" in exc.value.message
    assert "previous tensor 'x' (shape [8]" in exc.value.message and "ends at 32" in \
        exc.value.message


def test_named_pipe_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="not a regular file"):
        read_gguf_header(fifo)  # opening it would wait for a writer forever
