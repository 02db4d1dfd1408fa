"""The options of the tidings Spark source, parsed once and checked with one-line errors.

Named like the Kafka connector's where they mean the same (`startingOffsets`, `endingOffsets`,
`failOnDataLoss`, `maxBytesPerTrigger`). Spark hands options over case-insensitively; offsets are
the journals' byte offsets (each message's `offset` column), not message counts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidings.message.sequencer import DEFAULT_PRODUCER_HORIZON
from tidings.protocol import validate
from tidings.protocol.labels import parse_selector
from tidings.protocol.specs import parse_duration_ms
from tidings.protocol.status import UsageError, ValidationError

if TYPE_CHECKING:  # (the client imports grpc: loaded where a client is made)
    from tidings.client import Client
    from tidings.tls import TLS

DEFAULT_BROKER = "127.0.0.1:8080"
DEFAULT_BYTES_PER_PARTITION = 128 << 20  # as spark.sql.files.maxPartitionBytes
FORMATS = ("json", "raw")

Offsets = str | dict[str, int]  # "earliest", "latest", or {journal: offset}


@dataclass(frozen=True)
class Security:
    """How a query's driver and tasks reach TLS brokers holding keys: options `tlsCa`, `tlsCert`,
    `tlsKey`, paths of PEM files on every host (ship them with `spark-submit --files`: a relative path is
    then looked up with SparkFiles; read where a client is made, so each executor reads its own copy),
    and `authToken`, a token from `tidings auth token` (READ, and LIST for a selector, to read; APPEND and
    READ to write) sent with every call. Spark redacts option values whose key says "token" from its UI
    and logs (`spark.redaction.regex`); its repr here shows none either."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, get: Callable[[str], str | None], who: str) -> Security:
        token = get("authToken")
        sec = cls(get("tlsCa"), get("tlsCert"), get("tlsKey"), token.strip() if token else None)
        if bool(sec.tls_cert) != bool(sec.tls_key):
            raise OptionError(
                "tlsCert" if sec.tls_cert else "tlsKey", "needs its pair: give both tlsCert and tlsKey", who
            )
        sec.tls()  # (checked on the driver: a missing file is one line there, not a failure in every task)
        if sec.auth_token is not None:
            _check_token(sec.auth_token, who)
        return sec

    def tls(self) -> TLS | None:
        from tidings.tls import load

        if not (self.tls_ca or self.tls_cert):
            return None
        try:
            return load(_shipped(self.tls_cert), _shipped(self.tls_key), _shipped(self.tls_ca), "tidings", server=False)
        except UsageError as exc:
            flag = {"--tls-ca": "tlsCa", "--tls-cert": "tlsCert", "--tls-key": "tlsKey"}
            text = str(exc).removeprefix("tidings: ")
            for name, option in flag.items():
                text = text.replace(name, f"option {option!r}")
            raise UsageError(f"tidings: {text}") from None

    def client(self, broker: str, retries: int | None = 20) -> Client:
        from tidings.auth import BearerAuthorizer
        from tidings.client import Client

        auth = BearerAuthorizer(self.auth_token) if self.auth_token else None
        return Client(broker, retries, tls=self.tls(), auth=auth)


def _check_token(token: str, who: str) -> None:
    """A token's mistakes found on the driver, each one line (never showing the token): spaces, not a
    token at all, already expired. Whether the brokers' keys verify it, they say."""
    from tidings.auth import AuthError, decode_unverified
    from tidings.auth.jwt import check_expiry
    from tidings.protocol.claims import claims_from_json

    if not token or any(c.isspace() for c in token):
        raise OptionError("authToken", "has spaces: give the token `tidings auth token` printed, alone", who)
    try:
        _header, payload = decode_unverified(token)
        check_expiry(claims_from_json(payload), time.time())
    except AuthError as exc:
        reason = exc.reason.removeprefix("token ")
        raise OptionError("authToken", f"is refused before use ({reason}): give a current one from "
                          "`tidings auth token`", who) from None  # fmt: skip
    except ValidationError as exc:
        raise OptionError("authToken", f"holds claims tidings cannot read ({exc})", who) from None


def _shipped(path: str | None) -> str | None:
    """`path`, or where `spark-submit --files` put a relative one on this host."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    try:
        from pyspark import SparkFiles

        shipped = SparkFiles.get(path)
    except Exception:  # (no SparkContext here: the path as given)
        return path
    return shipped if os.path.exists(shipped) else path


class OptionError(UsageError):
    """An option of the tidings source is missing or wrong; the message names it and says what to give."""

    def __init__(self, option: str, problem: str, who: str = "source") -> None:
        super().__init__(f"tidings {who}: option {option!r} {problem}")


@dataclass(frozen=True)
class SourceOptions:
    broker: str
    journals: tuple[str, ...]  # named journals, or () with a selector
    selector: str | None
    starting: Offsets
    ending: Offsets
    read_committed: bool
    format: str
    fail_on_data_loss: bool
    schema: str | None  # DDL of the messages' fields (format json), when not given with .schema()
    max_bytes_per_trigger: int | None  # streaming: bytes per micro-batch (all journals together)
    bytes_per_partition: int = DEFAULT_BYTES_PER_PARTITION  # batch: at most about this many bytes per task
    min_partitions: int = 1  # batch: at least this many tasks per journal, as its fragments allow
    producer_horizon: float = DEFAULT_PRODUCER_HORIZON  # streaming: seconds a quiet producer stays in offsets
    security: Security = Security()

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        lower = {k.lower(): v for k, v in options.items()}

        def get(name: str, default: str | None = None) -> str | None:
            value = lower.get(name.lower())
            return default if value is None or value == "" else value

        journals = tuple(j.strip() for j in (get("journal") or "").split(",") if j.strip())
        selector = get("selector")
        if journals and selector:
            raise OptionError("journal", "and option 'selector' exclude each other: give one of them")
        if not journals and not selector:
            raise OptionError("journal", "is missing: give a journal name (or a comma list), or option 'selector'")
        if selector:
            try:
                validate.selector(parse_selector(selector))
            except ValidationError as exc:
                raise OptionError("selector", f"is not a label selector ({exc}); e.g. 'topic=clicks,!tmp'") from None
        fmt = (get("format", "json") or "json").lower()
        if fmt not in FORMATS:
            raise OptionError("format", f"is {fmt!r}: give 'json' (with a schema) or 'raw'")
        read_committed = _bool(get("readCommitted", "true"), "readCommitted")
        if fmt == "raw" and read_committed:
            raise OptionError(
                "readCommitted",
                "must be false with format 'raw' (raw rows are the messages as written); "
                "use format 'json' to read committed messages",
            )
        starting = _offsets(get("startingOffsets", "earliest"), "startingOffsets")
        ending = _offsets(get("endingOffsets", "latest"), "endingOffsets")
        for option, offsets in (("startingOffsets", starting), ("endingOffsets", ending)):
            stray = sorted(set(offsets) - set(journals)) if isinstance(offsets, dict) and journals else []
            if stray:
                raise OptionError(option, f"names journal {stray[0]!r}, which option 'journal' does not: fix the name")
        return cls(
            broker=get("broker", DEFAULT_BROKER) or DEFAULT_BROKER,
            journals=journals,
            selector=selector,
            starting=starting,
            ending=ending,
            read_committed=read_committed,
            format=fmt,
            fail_on_data_loss=_bool(get("failOnDataLoss", "true"), "failOnDataLoss"),
            schema=get("schema"),
            max_bytes_per_trigger=_positive(get("maxBytesPerTrigger"), "maxBytesPerTrigger"),
            bytes_per_partition=_positive(get("bytesPerPartition"), "bytesPerPartition") or DEFAULT_BYTES_PER_PARTITION,
            min_partitions=_positive(get("minPartitions"), "minPartitions", "number of partitions") or 1,
            producer_horizon=_duration(get("producerHorizon"), "producerHorizon") or DEFAULT_PRODUCER_HORIZON,
            security=Security.parse(get, "source"),
        )


def _positive(text: str | None, option: str, what: str = "number of bytes") -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise OptionError(option, f"is {text!r}: give a positive {what}")
    return value


def _duration(text: str | None, option: str) -> float | None:
    """Seconds of a duration option ('10m', '1h', '30s', or seconds)."""
    if text is None:
        return None
    try:
        ms = parse_duration_ms(text, option)
    except ValidationError:
        ms = 0
    if ms <= 0:
        raise OptionError(option, f"is {text!r}: give a duration such as 10m, 1h or 30s")
    return ms / 1000


def _bool(text: str | None, option: str) -> bool:
    value = (text or "").strip().lower()
    if value not in ("true", "false"):
        raise OptionError(option, f"is {text!r}: give true or false")
    return value == "true"


def _offsets(text: str | None, option: str) -> Offsets:
    value = (text or "").strip()
    if value.lower() in ("earliest", "latest"):
        return value.lower()
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= -2 for k, v in parsed.items()
    ):
        raise OptionError(
            option,
            f"is {text!r}: give earliest, latest, or a JSON object of byte offsets such as "
            '{"shop/orders": 1024} (-2: earliest, -1: latest)',
        )
    return parsed
