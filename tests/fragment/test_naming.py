"""Fragment naming, parsing, protobuf round trips and codecs (pure, no store)."""

from __future__ import annotations

import hashlib
import io
import os

import pytest

import tidings.fragment as fragment_pkg
from tidings.fragment import EMPTY_SUM, Fragment, codecs, parse_content_name
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

SUM = hashlib.sha1(b"hello").digest()
SUM_HEX = SUM.hex()


@pytest.mark.parametrize(
    ("name", "begin", "end", "codec"),
    [
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX}.raw", 0, 5, pb.NONE, id="raw"),
        pytest.param(f"0000000000000010-00000000000000ff-{SUM_HEX}.gz", 16, 255, pb.GZIP, id="gzip"),
        pytest.param(
            f"00000000deadbeef-00000001deadbeef-{SUM_HEX}.zst", 0xDEADBEEF, 0x1DEADBEEF, pb.ZSTANDARD, id="zstd"
        ),
        pytest.param(f"0000000000000007-0000000000000007-{EMPTY_SUM.hex()}.raw", 7, 7, pb.NONE, id="empty-span"),
        pytest.param(
            f"3fffffffffffffff-4000000000000000-{SUM_HEX}.raw", (1 << 62) - 1, 1 << 62, pb.NONE, id="max-offset"
        ),
    ],
)
def test_parse_good_names(name: str, begin: int, end: int, codec: int) -> None:
    frag = parse_content_name("a/b", name, "file:///s/", 1234)
    assert (frag.journal, frag.begin, frag.end, frag.codec) == ("a/b", begin, end, codec)
    assert frag.backing_store == "file:///s/" and frag.mod_time == 1234
    assert frag.content_name() == name, "parsing then naming must be the identity"
    assert frag.content_path() == f"a/b/{name}"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        pytest.param(f"000000000000000g-0000000000000005-{SUM_HEX}.raw", "16 lowercase hex", id="bad-hex-begin"),
        pytest.param(f"0000000000000000-000000000000005-{SUM_HEX}.raw", "16 lowercase hex", id="short-end"),
        pytest.param(f"0000000000000000-000000000000000A-{SUM_HEX}.raw", "16 lowercase hex", id="uppercase-hex"),
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX[:-1]}.raw", "40 lowercase hex", id="short-sum"),
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX[:-1]}x.raw", "40 lowercase hex", id="bad-hex-sum"),
        pytest.param(f"0000000000000009-0000000000000005-{SUM_HEX}.raw", "after end", id="begin-after-end"),
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX}.lz4", "unknown extension", id="unknown-extension"),
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX}.raw.gz", "unknown extension", id="double-extension"),
        pytest.param(f"0000000000000000-0000000000000005-{SUM_HEX}", "no extension", id="no-extension"),
        pytest.param(f"0000000000000000-0000000000000005-00-{SUM_HEX}.raw", "before the extension", id="four-parts"),
        pytest.param("README.md", "unknown extension", id="garbage"),
    ],
)
def test_parse_bad_names_name_the_file(name: str, why: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_content_name("a/b", name)
    assert f"a/b/{name}" in str(info.value)
    assert why in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        pytest.param({"begin": 5, "end": 4}, "invalid span", id="begin-after-end"),
        pytest.param({"begin": -1, "end": 4}, "invalid span", id="negative"),
        pytest.param({"sum": b"short"}, "20-byte SHA1", id="short-sum"),
        pytest.param({"codec": pb.INVALID}, "INVALID", id="invalid-codec"),
        pytest.param({"codec": 42}, "unsupported compression codec 42", id="unknown-codec"),
    ],
)
def test_fragment_rejects_malformed_values(kwargs: dict[str, object], why: str) -> None:
    args: dict[str, object] = {"journal": "j", "begin": 0, "end": 5, "sum": SUM}
    args.update(kwargs)
    with pytest.raises(ValidationError, match=why):
        Fragment(**args)  # type: ignore[arg-type]


def test_proto_round_trip_and_with_store() -> None:
    frag = Fragment("a/b", 10, 20, SUM, pb.ZSTANDARD, "memory://x/", 99)
    assert Fragment.from_proto(frag.to_proto()) == frag
    assert frag.content_length == 10
    bare = Fragment("a/b", 10, 20, SUM, pb.ZSTANDARD)
    assert bare.with_store("memory://x/", 99) == frag
    assert frag.with_store("") == bare
    with pytest.raises(ValidationError):
        Fragment.from_proto(pb.Fragment(journal="j", begin=0, end=1))  # no sum, codec INVALID


def test_empty_sum_is_sha1_of_nothing() -> None:
    assert hashlib.sha1(b"").digest() == EMPTY_SUM


@pytest.mark.parametrize(
    ("codec", "ext"),
    [
        pytest.param(pb.NONE, ".raw", id="none"),
        pytest.param(pb.GZIP, ".gz", id="gzip"),
        pytest.param(pb.ZSTANDARD, ".zst", id="zstd"),
    ],
)
def test_codec_extensions(codec: int, ext: str) -> None:
    assert codecs.extension(codec) == ext
    assert codecs.codec_for_extension(ext) == codec
    assert codecs.codec_for_extension(ext.lstrip(".")) == codec


def test_unsupported_codec_is_named() -> None:
    for call in (
        lambda: codecs.extension(pb.INVALID),
        lambda: codecs.compress_stream(io.BytesIO(), io.BytesIO(), 7),
        lambda: codecs.decompress_reader(io.BytesIO(), pb.INVALID),
    ):
        with pytest.raises(ValidationError, match=r"unsupported compression codec (INVALID|7)"):
            call()
    with pytest.raises(ValidationError, match=r"'\.lz4'"):
        codecs.codec_for_extension(".lz4")


class _CountingReader(io.RawIOBase):
    """Records the largest read request, to show codecs stream rather than slurp."""

    def __init__(self, data: bytes) -> None:
        self._buf = io.BytesIO(data)
        self.largest = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.largest = max(self.largest, size if size >= 0 else 1 << 62)
        return self._buf.read(size)


@pytest.mark.parametrize("codec", [pb.NONE, pb.GZIP, pb.ZSTANDARD], ids=["none", "gzip", "zstd"])
def test_codec_round_trip_streams_in_chunks(codec: int) -> None:
    payload = os.urandom(1 << 20) + b"z" * (1 << 20)
    src = _CountingReader(payload)
    dst = io.BytesIO()
    codecs.compress_stream(src, dst, codec)  # type: ignore[arg-type]
    assert 0 < src.largest <= codecs.CHUNK_SIZE
    dst.seek(0)
    reader = codecs.decompress_reader(dst, codec)
    got = bytearray()
    while chunk := reader.read(100_000):
        assert len(chunk) <= 100_000
        got += chunk
    reader.close()
    assert bytes(got) == payload
    assert dst.closed, "closing the reader closes its source"


def test_gzip_output_is_deterministic() -> None:
    outs = []
    for _ in range(2):
        dst = io.BytesIO()
        codecs.compress_stream(io.BytesIO(b"same content"), dst, pb.GZIP)
        outs.append(dst.getvalue())
    assert outs[0] == outs[1]


def test_package_exports() -> None:
    expected = {
        "EMPTY_SUM",
        "Fragment",
        "FragmentIndex",
        "FragmentStore",
        "Persister",
        "PersisterStatistics",
        "codecs",
        "parse_content_name",
        "store_for",
    }
    assert expected <= set(fragment_pkg.__all__)  # spool.py's author adds Spool
    for name in fragment_pkg.__all__:
        assert hasattr(fragment_pkg, name), name
