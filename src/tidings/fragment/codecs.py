"""Compression codecs of persisted fragments: none (.raw), gzip (.gz) and zstd (.zst).

Everything here streams in `CHUNK_SIZE` pieces so a multi-GiB fragment never sits in memory.
These functions block (they compress or read files): callers on the event loop run them through
`asyncio.to_thread`. gzip output is deterministic (no file name, mtime 0), so the same content
compresses to the same bytes wherever it is persisted.
"""

from __future__ import annotations

import gzip
import io
import shutil
from typing import BinaryIO

import zstandard

from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

CHUNK_SIZE = 256 * 1024
"""Bytes moved per read/write while (de)compressing."""

GZIP_LEVEL = 6
"""zlib's default: gzip's own default (9) costs ~3x the CPU for a few percent."""

ZSTD_LEVEL = 3
"""zstd's default level: fast, and already better than gzip -6."""

_CODECS: dict[str, pb.CompressionCodec] = {".raw": pb.NONE, ".gz": pb.GZIP, ".zst": pb.ZSTANDARD}
_EXTENSIONS: dict[int, str] = {codec: ext for ext, codec in _CODECS.items()}

SUPPORTED: frozenset[int] = frozenset(_EXTENSIONS)
"""The codecs a fragment may use (pb.INVALID, the proto default, is not one)."""


def codec_name(codec: int) -> str:
    """The enum name of a codec, or its number when it is not in the enum at all."""
    try:
        return pb.CompressionCodec.Name(codec)
    except ValueError:
        return str(codec)


def _unsupported(codec: int) -> ValidationError:
    return ValidationError(
        "compression_codec",
        f"unsupported compression codec {codec_name(codec)} ({codec}); use NONE, GZIP or ZSTANDARD",
    )


def check_codec(codec: int) -> None:
    """Raise ValidationError naming `codec` unless it is one we can read and write."""
    if codec not in _EXTENSIONS:
        raise _unsupported(codec)


def extension(codec: int) -> str:
    """The file extension of `codec`, with its dot (".raw", ".gz", ".zst")."""
    try:
        return _EXTENSIONS[codec]
    except KeyError:
        raise _unsupported(codec) from None


def codec_for_extension(ext: str) -> pb.CompressionCodec:
    """The codec of a file extension; the leading dot is optional (".gz" or "gz")."""
    key = ext if ext.startswith(".") else "." + ext
    try:
        return _CODECS[key]
    except KeyError:
        raise ValidationError(
            "extension", f"unknown fragment file extension {ext!r}; expected one of .raw, .gz, .zst"
        ) from None


def compress_stream(src: BinaryIO, dst: BinaryIO, codec: int) -> None:
    """Read `src` to its end in chunks and write it to `dst` compressed with `codec`.

    `dst` is left open: the caller owns it (and decides when the write becomes visible).
    """
    if codec == pb.NONE:
        shutil.copyfileobj(src, dst, CHUNK_SIZE)
    elif codec == pb.GZIP:
        # filename="" and mtime=0 keep the header free of the (temporary) destination name and time.
        with gzip.GzipFile(filename="", mode="wb", fileobj=dst, compresslevel=GZIP_LEVEL, mtime=0) as gz:
            while chunk := src.read(CHUNK_SIZE):
                gz.write(chunk)
    elif codec == pb.ZSTANDARD:
        zstandard.ZstdCompressor(level=ZSTD_LEVEL).copy_stream(src, dst, read_size=CHUNK_SIZE, write_size=CHUNK_SIZE)
    else:
        raise _unsupported(codec)


class _OwningReader(io.BufferedIOBase):
    """A decompressing reader that also closes its source, because GzipFile never does."""

    def __init__(self, inner: io.BufferedIOBase, source: BinaryIO) -> None:
        super().__init__()
        self._inner = inner
        self._source = source

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return self._inner.read(-1 if size is None else size)

    def read1(self, size: int = -1) -> bytes:
        return self._inner.read(size if size >= 0 else CHUNK_SIZE)

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]  # the byte buffers io passes
        data = self._inner.read(len(b))
        n = len(data)
        memoryview(b).cast("B")[:n] = data
        return n

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._inner.close()
        finally:
            try:
                self._source.close()
            finally:
                super().close()


def decompress_reader(src: BinaryIO, codec: int, *, closefd: bool = True) -> BinaryIO:
    """A readable stream of the decompressed content of `src`, decompressed as it is read.

    With `closefd` (the default) closing the returned reader also closes `src`.
    """
    if codec == pb.NONE:
        return src
    if codec == pb.GZIP:
        gz = gzip.GzipFile(fileobj=src, mode="rb")
        return _OwningReader(gz, src) if closefd else gz  # type: ignore[return-value]  # a BufferedIOBase, no BinaryIO
    if codec == pb.ZSTANDARD:
        # read_across_frames: a fragment compressed by another writer may hold several frames.
        return zstandard.ZstdDecompressor().stream_reader(
            src, read_size=CHUNK_SIZE, read_across_frames=True, closefd=closefd
        )
    raise _unsupported(codec)
