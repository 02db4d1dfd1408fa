"""Status values and the tidings error tree.

::

    TidingsError
    ├── StatusError            a non-OK Status from a broker; one subclass per Status
    │     (.status, .journal, .retriable, .refresh_route; found with for_status())
    ├── TransportError         a gRPC failure (unavailable, deadline, ...); map_grpc_error()
    │     ├── UnauthenticatedError   no valid token (gRPC UNAUTHENTICATED)
    │     └── PermissionDeniedError  a token that does not allow the call (gRPC PERMISSION_DENIED;
    │                                also a NotAllowedError, the Status NOT_ALLOWED's, with its reason)
    ├── ValidationError        a malformed message or spec, with a dotted context
    └── UsageError             misuse of an API (also a RuntimeError)

Brokers return expected outcomes as a Status in a response carrying a Header; only surprises
become gRPC errors. Messages name the journal, the status and the next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidings.protocol import protocol_pb2 as pb

if TYPE_CHECKING:  # (grpc loads only with a connection: `tidings --help` and specs need none)
    import grpc

Status = pb.Status

# What a client should do next, per status.
_NEXT_STEP: dict[int, str] = {
    pb.JOURNAL_NOT_FOUND: "check the name with `tidings journals list`, or create it with `journals apply`",
    pb.NO_JOURNAL_PRIMARY_BROKER: "the journal has no primary yet; retry shortly",
    pb.NOT_JOURNAL_PRIMARY_BROKER: "retry against the journal's current primary",
    pb.NOT_JOURNAL_BROKER: "retry against a broker of the journal's route",
    pb.INSUFFICIENT_JOURNAL_BROKERS: "start more brokers (or lower the journal's replication); retry",
    pb.OFFSET_NOT_YET_AVAILABLE: "read with --block to wait for content",
    pb.WRONG_ROUTE: "the route changed; retry",
    pb.PROPOSAL_MISMATCH: "the replicas disagreed; the primary re-synchronizes, retry",
    pb.ETCD_TRANSACTION_FAILED: "the spec changed concurrently; re-read it and apply again",
    pb.NOT_ALLOWED: "the journal's flags forbid this operation",
    pb.WRONG_APPEND_OFFSET: "the journal's write head moved; re-read it and retry with the new offset",
    pb.INDEX_HAS_GREATER_OFFSET: (
        "journal consistency was lost; once every old broker is gone run `tidings journals reset-head`"
    ),
    pb.REGISTER_MISMATCH: "the journal's registers do not match the expectation (another writer won)",
    pb.FRAGMENT_STORE_UNHEALTHY: (
        "the journal's fragment store cannot be reached or used; check its URL, credentials and installed "
        "backend (e.g. pip install 'tidings[s3]'); retry"
    ),
    pb.SUSPENDED: "the journal is suspended; an append resumes it",
    pb.TARGET_NOT_FOUND: "check the target's id and endpoint in targets.yaml",
    pb.TARGET_FENCED: "a newer LogPlayer delivers to this target; stop this one",
    pb.WRONG_TARGET_INDEX: "the LogPlayer reconnects and recovers the target from what it applied",
    pb.NO_RECOVERY_LOG: "only a shard with a recovery_log_prefix records its store (see docs/shards.md)",
}

RETRIABLE = frozenset(
    {
        pb.NO_JOURNAL_PRIMARY_BROKER,
        pb.NOT_JOURNAL_PRIMARY_BROKER,
        pb.NOT_JOURNAL_BROKER,
        pb.INSUFFICIENT_JOURNAL_BROKERS,
        pb.WRONG_ROUTE,
        pb.PROPOSAL_MISMATCH,
    }
)
# Transient, but the Route is not at fault: retry without refreshing it.
RETRIABLE_IN_PLACE = frozenset({pb.FRAGMENT_STORE_UNHEALTHY})


def status_name(status: int) -> str:
    return pb.Status.Name(status)


class TidingsError(Exception):
    """Base of every error tidings raises on purpose."""


class StatusError(TidingsError):
    """A broker answered with a non-OK Status."""

    status: int = -1
    retriable: bool = False
    refresh_route: bool = False

    def __init__(self, journal: str = "", detail: str = "", header: pb.Header | None = None) -> None:
        self.journal = journal
        self.detail = detail
        self.header = header
        name = status_name(self.status)
        parts = [f"journal {journal!r}: {name}" if journal else name]
        if detail:
            parts.append(detail)
        parts.append(_NEXT_STEP.get(self.status, ""))
        super().__init__(": ".join(p for p in parts if p))


_BY_STATUS: dict[int, type[StatusError]] = {}


def _define(status: int) -> type[StatusError]:
    name = "".join(w.capitalize() for w in status_name(status).split("_")) + "Error"
    cls = type(
        name,
        (StatusError,),
        {
            "status": status,
            "retriable": status in RETRIABLE or status in RETRIABLE_IN_PLACE,
            "refresh_route": status in RETRIABLE,
            "__doc__": f"Status {status_name(status)}.",
            "__module__": __name__,
        },
    )
    _BY_STATUS[status] = cls
    return cls


class NotAllowedError(StatusError):
    """Status NOT_ALLOWED: the journal's flags forbid the operation; or (a `PermissionDeniedError`) the
    caller's token does not allow it, `reason` saying why."""

    status = pb.NOT_ALLOWED
    reason = ""


JournalNotFoundError = _define(pb.JOURNAL_NOT_FOUND)
NoJournalPrimaryBrokerError = _define(pb.NO_JOURNAL_PRIMARY_BROKER)
NotJournalPrimaryBrokerError = _define(pb.NOT_JOURNAL_PRIMARY_BROKER)
NotJournalBrokerError = _define(pb.NOT_JOURNAL_BROKER)
InsufficientJournalBrokersError = _define(pb.INSUFFICIENT_JOURNAL_BROKERS)
OffsetNotYetAvailableError = _define(pb.OFFSET_NOT_YET_AVAILABLE)
WrongRouteError = _define(pb.WRONG_ROUTE)
ProposalMismatchError = _define(pb.PROPOSAL_MISMATCH)
EtcdTransactionFailedError = _define(pb.ETCD_TRANSACTION_FAILED)
_BY_STATUS[pb.NOT_ALLOWED] = NotAllowedError  # (a class of its own: a token refusal's has a reason)
WrongAppendOffsetError = _define(pb.WRONG_APPEND_OFFSET)
IndexHasGreaterOffsetError = _define(pb.INDEX_HAS_GREATER_OFFSET)
RegisterMismatchError = _define(pb.REGISTER_MISMATCH)
FragmentStoreUnhealthyError = _define(pb.FRAGMENT_STORE_UNHEALTHY)
SuspendedError = _define(pb.SUSPENDED)
ShardNotFoundError = _define(pb.SHARD_NOT_FOUND)
NoShardPrimaryError = _define(pb.NO_SHARD_PRIMARY)
NotShardPrimaryError = _define(pb.NOT_SHARD_PRIMARY)
ShardStoppedError = _define(pb.SHARD_STOPPED)
TargetNotFoundError = _define(pb.TARGET_NOT_FOUND)
TargetFencedError = _define(pb.TARGET_FENCED)
WrongTargetIndexError = _define(pb.WRONG_TARGET_INDEX)
NoRecoveryLogError = _define(pb.NO_RECOVERY_LOG)


def for_status(status: int) -> type[StatusError]:
    """The StatusError subclass of a non-OK status."""
    return _BY_STATUS[status]


def raise_for_status(status: int, journal: str = "", detail: str = "", header: pb.Header | None = None) -> None:
    if status != pb.OK:
        raise for_status(status)(journal, detail, header)


class TransportError(TidingsError):
    """The broker could not be reached or the RPC failed in transport."""

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, retriable: bool = False, unreachable: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retriable = retriable
        self.unreachable = unreachable  # no server answered at all (refused, unresolved, not gRPC)
        self.data_port = ""  # the broker's data port, when it was the connection to it that failed (client/_wire.py)


class UnauthenticatedError(TransportError):
    """gRPC UNAUTHENTICATED: the server holds keys and the call carried no token it accepts (none, expired,
    signed with another key, malformed). Definite: the same token is refused again."""


class PermissionDeniedError(NotAllowedError, TransportError):
    """gRPC PERMISSION_DENIED: a valid token that does not allow the call (it lacks the capability, or an
    Apply reaches outside its selector). Definite. A NotAllowedError (what a refusal is, to a caller that
    catches Statuses) and a TransportError (the call failed with a gRPC code, to one that catches those)."""

    def __init__(self, message: str, reason: str, code: grpc.StatusCode | None = None) -> None:
        TransportError.__init__(self, message, code)  # (one line: the code, the server, the reason; no next step)
        self.journal, self.detail, self.header, self.reason = "", reason, None, reason


_RETRIABLE_CODES = frozenset({"UNAVAILABLE", "CANCELLED", "ABORTED"})  # grpc.StatusCode names

_CODE_HINTS = {
    "UNAVAILABLE": "is the cluster up? (tidings cluster up, or set --broker / TIDINGS_BROKER)",
    "INVALID_ARGUMENT": "fix the request",
    "DEADLINE_EXCEEDED": "the broker did not answer in time; retry",
    "RESOURCE_EXHAUSTED": "the message is too large; send smaller chunks",
}


_UNREACHABLE = ("failed to connect to all addresses", "DNS resolution failed")  # gRPC's own, not a server's
_SERVICE_ROLES = {"Journal": "broker", "Shard": "consumer", "Target": "target"}  # who serves each gRPC service


_VERIFY = "CERTIFICATE_VERIFY_FAILED: "
_ADVICE = {
    "unable to get local issuer certificate": "its certificate is not signed by the CA in --tls-ca: give that CA",
    "self-signed certificate in certificate chain": "its certificate is not signed by the CA in --tls-ca: give that CA",
    "certificate has expired": "its certificate has expired: renew it",
    "certificate is not yet valid": "its certificate is not valid yet (clocks differ?)",
}


def tls_hint(details: str, endpoint: str) -> str:
    """A one-line cause for a TLS failure in gRPC's error `details`, "" when it names none."""
    if "WRONG_VERSION_NUMBER" in details:
        return f"TLS: {endpoint} does not speak TLS (a plaintext server): drop --tls-* or dial its TLS port"
    if _VERIFY in details:
        return verify_hint(endpoint, details.split(_VERIFY, 1)[1].split(":", 1)[0].strip())
    if "Hostname Verification Check failed" in details:
        return name_hint(endpoint)
    return ""


def verify_hint(endpoint: str, reason: str) -> str:
    """One line: `endpoint`'s certificate failed verification for `reason` (OpenSSL's), and what to do."""
    advice = _ADVICE.get(reason, "check --tls-ca and the server's certificate")
    return f"TLS: {endpoint}'s certificate failed verification ({reason}): {advice}"


def name_hint(endpoint: str) -> str:
    """One line: `endpoint`'s certificate does not name the host dialed, and what to do."""
    host = endpoint.rpartition(":")[0]
    return (
        f"TLS: {endpoint}'s certificate is not valid for {host}: dial a name or address its certificate names, "
        "or reissue it with this one"
    )


def map_grpc_error(err: grpc.RpcError, target: str = "", role: str = "broker") -> TransportError:
    """The one place gRPC errors become TidingsErrors; `role`: the kind of server `target` should be
    (broker, consumer, target), named when nothing answers there."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    where = f" from {target}" if target else ""
    name = code.name if code is not None else "UNKNOWN"
    hint = _CODE_HINTS.get(name, "")
    if role != "broker" and name == "UNAVAILABLE":
        hint = f"no {role} answers at {target} (is a tidings {role} process serving there?)"
    if name == "UNIMPLEMENTED" and "unknown service tidings.protocol." in details:
        service = details.rsplit("tidings.protocol.", 1)[1].strip()
        role = _SERVICE_ROLES.get(service, f"{service} server")
        hint = f"{target or 'it'} is not a tidings {role} (an etcd endpoint?): give a {role}'s HOST:PORT"
    elif name == "UNAVAILABLE" and (tls := tls_hint(details, target or "the server")):
        hint = tls
    elif "Failed parsing HTTP/2" in details:
        hint = f"{target or 'it'} does not speak gRPC (a web or /metrics port?): give a tidings server's HOST:PORT"
    msg = f"{name}{where}: {details}" + (f"; {hint}" if hint else "")
    if name == "UNAUTHENTICATED":  # (a refusal by the server's keys: its reason says what to do)
        return UnauthenticatedError(msg, code)
    if name == "PERMISSION_DENIED":  # (one line: NOT_ALLOWED from HOST:PORT: token lacks the APPEND capability ...)
        return PermissionDeniedError(f"{status_name(pb.NOT_ALLOWED)}{where}: {details}", details, code)
    unreachable = name == "UNAVAILABLE" and details.startswith(_UNREACHABLE)
    mapped = TransportError(msg, code, retriable=name in _RETRIABLE_CODES, unreachable=unreachable)
    mapped.data_port = getattr(err, "data_port", "")
    return mapped


class ValidationError(TidingsError, ValueError):
    """A message or spec is malformed; `context` is a dotted path to the bad field."""

    def __init__(self, context: str, message: str) -> None:
        self.context = context
        super().__init__(f"{context}: {message}" if context else message)


class UsageError(TidingsError, RuntimeError):
    """An API was misused; the message says what to do instead."""
