"""Fragment: a content-addressed span [begin, end) of a journal, and its file name.

A persisted fragment is stored as ``{store}{journal}/{begin:016x}-{end:016x}-{sha1 hex}{ext}``,
so its name alone says which bytes of the journal it holds and lets any reader verify them.
Parsing is pure (no I/O), so stores and indexes share one definition of a valid name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass

from tidings.fragment import codecs
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import ValidationError

EMPTY_SUM: bytes = hashlib.sha1().digest()
"""SHA1 of no bytes: the sum of every empty fragment."""

_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX40 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class Fragment:
    """A span [begin, end) of `journal` whose raw (uncompressed) content has SHA1 `sum`.

    `backing_store` is "" while the fragment lives only in a local spool file, else the URL of
    the store holding it (e.g. "file:///data/store/"); `mod_time` (unix seconds) comes from that
    store's listing and drives retention.
    """

    journal: str
    begin: int
    end: int
    sum: bytes
    codec: pb.CompressionCodec = pb.NONE
    backing_store: str = ""
    mod_time: int = 0

    def __post_init__(self) -> None:
        # Checked once here so a Fragment in hand always has a well-formed name.
        if not 0 <= self.begin <= self.end:
            raise ValidationError(f"fragment {self.journal}", f"invalid span [{self.begin}, {self.end})")
        if len(self.sum) != 20:
            raise ValidationError(f"fragment {self.journal}.sum", f"must be a 20-byte SHA1, not {len(self.sum)} bytes")
        codecs.check_codec(self.codec)

    @property
    def content_length(self) -> int:
        """Bytes of raw content the fragment holds."""
        return self.end - self.begin

    def content_name(self) -> str:
        """The file name that identifies and verifies this content in a store."""
        return f"{self.begin:016x}-{self.end:016x}-{self.sum.hex()}{codecs.extension(self.codec)}"

    def content_path(self) -> str:
        """The path of the fragment's file relative to a store's root."""
        return f"{self.journal}/{self.content_name()}"

    def to_proto(self) -> pb.Fragment:
        return pb.Fragment(
            journal=self.journal,
            begin=self.begin,
            end=self.end,
            sum=self.sum,
            compression_codec=self.codec,
            backing_store=self.backing_store,
            mod_time=self.mod_time,
        )

    @classmethod
    def from_proto(cls, f: pb.Fragment) -> Fragment:
        """The Fragment of a wire message; raises ValidationError if it is malformed."""
        return cls(
            journal=f.journal,
            begin=f.begin,
            end=f.end,
            sum=bytes(f.sum),
            codec=f.compression_codec,
            backing_store=f.backing_store,
            mod_time=f.mod_time,
        )

    def with_store(self, store: str, mod_time: int = 0) -> Fragment:
        """The same content, as held by `store` (and listed there at `mod_time`)."""
        return dataclasses.replace(self, backing_store=store, mod_time=mod_time)


def parse_content_name(journal: str, name: str, store: str = "", mod_time: int = 0) -> Fragment:
    """The Fragment a file named `name` in `journal`'s folder holds.

    Raises ValidationError naming the file when `name` is not ``{begin:016x}-{end:016x}-{sha1}{ext}``
    with lowercase hex, begin <= end, and ext one of .raw, .gz, .zst.
    """
    ctx = f"fragment file {journal}/{name}"
    dot = name.find(".")
    if dot < 0:
        raise ValidationError(ctx, "has no extension; expected .raw, .gz or .zst")
    try:
        codec = codecs.codec_for_extension(name[dot:])
    except ValidationError as err:
        raise ValidationError(ctx, f"unknown extension {name[dot:]!r}; expected .raw, .gz or .zst") from err
    parts = name[:dot].split("-")
    if len(parts) != 3:
        raise ValidationError(ctx, "expected {begin:016x}-{end:016x}-{sha1 hex} before the extension")
    begin_hex, end_hex, sum_hex = parts
    if not _HEX16.fullmatch(begin_hex) or not _HEX16.fullmatch(end_hex):
        raise ValidationError(ctx, "begin and end must be 16 lowercase hex digits")
    if not _HEX40.fullmatch(sum_hex):
        raise ValidationError(ctx, "the SHA1 sum must be 40 lowercase hex digits")
    begin, end = int(begin_hex, 16), int(end_hex, 16)
    if begin > end:
        raise ValidationError(ctx, f"begin {begin} is after end {end}")
    return Fragment(
        journal=journal,
        begin=begin,
        end=end,
        sum=bytes.fromhex(sum_hex),
        codec=codec,
        backing_store=store,
        mod_time=mod_time,
    )
