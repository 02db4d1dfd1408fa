"""Capability tokens: who may do what to which journals (Gazette's `auth` package).

**The model** (Gazette's, so tokens pass between the two systems). A token is an HS256 JWT whose
claims grant a bit set of capabilities (`tidings.protocol.claims.Capability`: LIST, APPLY, READ,
APPEND, REPLICATE; applications from bit 16) over the items a label selector matches (journals by
their labels plus the meta-label `name`, so `name=shop/orders` or `name:prefix=shop/`), until it
expires (`exp` is required; clocks may differ by 5 s). The processes of a cluster share HMAC keys
(`KeySet`): the first signs, any verifies. Servers verify each RPC (`Verifier.verify(context,
cap)`; `verifier_of(keys, service)`) and treat what the selector does not match as absent
(journals; shards, by their labels and meta-label `id`; LogPlayer targets, by `target=ID`); clients
attach a token per call through an `Authorizer`: keys (`KeyedAuthorizer`, which signs per-call claims
scoped to what the call touches; `authorizer_of(keys)`), a token (`BearerAuthorizer`) or nothing
(`NoAuthorizer`). A refusal is
UNAUTHENTICATED (no token, a bad, expired or foreign one) or PERMISSION_DENIED (a valid token
lacking the capability), with a one-line reason; tokens and keys are never logged nor echoed.

**Turning auth on in a running cluster.** Restart every process with `--auth-keys AA==,K`: `AA==`
admits requests without a token (a token that is present is still verified), and K signs what the
processes send each other, so brokers authenticate each other from the first step. Give clients
tokens (`tidings auth token`), then restart with `--auth-keys K` alone.

**Rotating keys without downtime.** (1) Restart processes one by one with `OLD,NEW`: the old key
still signs, both verify. (2) Once every process has both, restart them one by one with `NEW,OLD`:
the new key signs; issue clients new tokens. (3) When the old tokens have expired, restart with
`NEW` alone.

Modules: `keys` (KeySet), `jwt` (sign, verify), `verifier` (Verifier, NoVerifier: the checks, the
refusals' log and metric), `authorizer` (Authorizer and its three kinds). Layer: above
`tidings.protocol`, using only it, the standard library and (once a server aborts an RPC, or counts a
refusal) grpc and prometheus_client. docs/design/production.md §3.6.
"""

from tidings.auth.authorizer import (
    Authorizer,
    BearerAuthorizer,
    CallMetadata,
    KeyedAuthorizer,
    NoAuthorizer,
    authorizer_of,
)
from tidings.auth.jwt import LEEWAY, MAX_TOKEN_BYTES, AuthCode, AuthError, decode_unverified, sign, verify
from tidings.auth.keys import ALLOW_MISSING, KeySet, generate_key
from tidings.auth.verifier import (
    Metadata,
    NoVerifier,
    ServicerContext,
    Verifier,
    expires_at,
    seconds_left,
    verifier_of,
)

__all__ = [
    "ALLOW_MISSING",
    "AuthCode",
    "AuthError",
    "Authorizer",
    "BearerAuthorizer",
    "CallMetadata",
    "KeySet",
    "KeyedAuthorizer",
    "LEEWAY",
    "MAX_TOKEN_BYTES",
    "Metadata",
    "NoAuthorizer",
    "NoVerifier",
    "ServicerContext",
    "Verifier",
    "authorizer_of",
    "decode_unverified",
    "expires_at",
    "generate_key",
    "seconds_left",
    "sign",
    "verifier_of",
    "verify",
]
