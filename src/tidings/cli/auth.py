"""`tidings auth ...`: sign capability tokens, make keys, inspect a token (docs/design/production.md §3.6).

Keys come from `--auth-keys` / TIDINGS_AUTH_KEYS or `--auth-keys-file` / TIDINGS_AUTH_KEYS_FILE,
never both; a key is never printed back (errors name its index). `token` prints the token alone on
stdout, so `export TIDINGS_AUTH_TOKEN=$(tidings auth token ...)` works.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tidings.cli._common import AuthKeysFileOpt, AuthKeysOpt, auth_keys, err, group, usage

if TYPE_CHECKING:  # (a command imports what it runs, once it runs)
    from tidings.protocol.claims import Claims

app = group("Capability tokens: sign one for a client, make a key, inspect a token.")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="auth")


def _ttl_seconds(text: str) -> int:
    """`--ttl` in whole seconds: the spec files' durations (90s, 10m, 1h) and days (30d)."""
    from tidings.protocol.specs import parse_duration_ms

    days = re.fullmatch(r"\s*(\d+)\s*d\s*", text)
    ms = int(days.group(1)) * 86_400_000 if days else parse_duration_ms(text, "--ttl")
    if ms < 1000:
        usage(f"--ttl {text!r} is less than a second: give e.g. 10m, 1h or 30d")
    return -(-ms // 1000)


@app.command("token")
def auth_token(
    capability: Annotated[
        str,
        typer.Option(
            "--capability",
            "-c",
            help="What the token allows: LIST, APPLY, READ, APPEND, REPLICATE, ALL, or numbers (application "
            "bits from 65536), separated by commas, e.g. READ,APPEND.",
        ),
    ],
    selector: Annotated[
        str,
        typer.Option(
            help="Which journals (shards, targets) it covers, e.g. app=orders or name:prefix=shop/ "
            "(default: all of them)."
        ),
    ] = "",
    ttl: Annotated[str, typer.Option(help="How long it is valid, e.g. 10m, 1h, 30d.")] = "1h",
    subject: Annotated[str, typer.Option(help="Who holds it (shown in servers' logs), e.g. alice@ops.")] = "",
    keys_value: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Sign a token with the first key and print it alone on stdout (for --auth-token / TIDINGS_AUTH_TOKEN)."""
    import time

    from tidings.auth import sign
    from tidings.protocol import labels, validate
    from tidings.protocol.claims import Claims, parse_capabilities

    cap = parse_capabilities(capability, "--capability")
    sel = labels.parse_selector(selector)
    validate.selector(sel, "--selector")
    seconds = _ttl_seconds(ttl)
    keys = auth_keys(keys_value, keys_file)
    if keys is None:
        usage("no keys to sign with: give --auth-keys-file or --auth-keys (TIDINGS_AUTH_KEYS_FILE, TIDINGS_AUTH_KEYS)")
    now = int(time.time())
    token = sign(Claims(cap=cap, sel=sel, iat=now, exp=now + seconds, sub=subject), keys.signing_key)
    sys.stdout.write(token + "\n")


@app.command("keygen")
def auth_keygen() -> None:
    """Print a fresh random key (32 bytes, base64) for --auth-keys."""
    from tidings.auth import generate_key

    sys.stdout.write(generate_key() + "\n")


@app.command("inspect")
def auth_inspect(
    token: Annotated[
        str,
        typer.Argument(
            envvar="TIDINGS_AUTH_TOKEN",
            show_default=False,
            help="The token ('-': read it from stdin); default: TIDINGS_AUTH_TOKEN.",
        ),
    ],
    keys_value: AuthKeysOpt = "",
    keys_file: AuthKeysFileOpt = None,
) -> None:
    """Print a token's header and claims as JSON, decoded; with keys, whether it verifies (exit code 1 if not)."""
    import json
    import time

    from tidings.auth import AuthError, decode_unverified, verify
    from tidings.protocol.claims import claims_from_json
    from tidings.protocol.status import ValidationError

    if token == "-":
        token = sys.stdin.read()
    token = token.strip()
    try:
        header, payload = decode_unverified(token)
    except AuthError as exc:
        usage(f"TOKEN: {exc.reason}")
    now = time.time()
    report: dict[str, Any] = {"header": header, "claims": payload}
    try:
        claims = claims_from_json(payload)
    except ValidationError as exc:
        report["malformed"] = str(exc)
    else:
        report.update(_readable(claims, now))
    keys = auth_keys(keys_value, keys_file)
    reason = ""
    if keys is None:
        report["verified"] = None  # (no keys: the signature is not checked)
    else:
        try:
            verify(token, keys, now)
        except AuthError as exc:
            reason = exc.reason
        report["verified"] = not reason
        if reason:
            report["reason"] = reason
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    if reason:
        from rich.markup import escape

        err.print(f"[red]error:[/red] the token does not verify: {escape(reason)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _readable(claims: Claims, now: float) -> dict[str, Any]:
    """What an operator wants of the claims: capability names, the selector as --selector takes it, UTC times."""
    from datetime import UTC, datetime

    from tidings.protocol import labels
    from tidings.protocol.claims import format_capabilities

    def utc(t: int) -> str:
        try:
            return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
        except (OverflowError, ValueError, OSError):  # (beyond year 9999)
            return str(t)

    return {
        "capabilities": format_capabilities(claims.cap),
        "selector": labels.format_selector(claims.sel),
        "issued": utc(claims.iat) if claims.iat else None,
        "expires": utc(claims.exp) if claims.exp else None,
        "expired": bool(claims.exp) and now > claims.exp,
    }
