"""Users' mistakes through the `tidings` command (a bad flag, a spec or shard file of the wrong shape,
a value out of range): each is one line on stderr naming the input and what to do, exit code 2 (a
usage error), no traceback, and nothing started: every one of these is refused before anything
connects or listens (so no cluster is needed here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._support import tidings

SPECS = {
    "three.yaml": 'name: a/b\nreplication: "three"\n',
    "twice.yaml": "journals:\n  - name: a/b\n    replication: 1\n  - name: a/b\n    replication: 2\n",
    "broken.yaml": "name: a/b\nreplication: [1\n",
    "targets.yaml": "targets:\n  - id: t0\n    endpoint: 127.0.0.1:1\n",
}
KEY = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="  # (32 bytes: a good key)

MISTAKES = [
    pytest.param(("cluster", "up", "--zones", "0"), {}, "--zones is 0", id="zones-0"),
    pytest.param(("cluster", "up", "--brokers", "0"), {}, "--brokers is 0", id="brokers-0"),
    pytest.param(
        ("journals", "append", "a/b", "--file", "/nonexistent"),
        {},
        "'/nonexistent' is not a file",
        id="append-missing-file",
    ),
    pytest.param(("journals", "list", "--broker", "localhost"), {}, "'localhost' is not HOST:PORT", id="no-port"),
    pytest.param(("journals", "list", "--broker", "foo:bar"), {}, "'foo:bar' is not HOST:PORT", id="bad-port"),
    pytest.param(
        ("journals", "list", "--broker", "fd00::5:8080"),
        {},
        "'fd00::5:8080': an IPv6 address goes in brackets, e.g. [fd00::5]:8080",
        id="ipv6-unbracketed",
    ),
    pytest.param(("journals", "list"), {"TIDINGS_BROKER": "127.0.0.1:99999"}, "TIDINGS_BROKER", id="env-broker"),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379"), {"TIDINGS_LOG_LEVEL": "bogus"}, "'bogus' is not a level", id="log-level"
    ),
    pytest.param(("broker", "--etcd", "etcd"), {}, "--etcd (TIDINGS_ETCD) 'etcd' is not HOST:PORT", id="etcd"),
    pytest.param(
        ("journals", "apply", "{tmp}/three.yaml"),
        {},
        "three.yaml[0].replication: 'three' is not a whole",
        id="replication-three",
    ),
    pytest.param(
        ("journals", "apply", "{tmp}/twice.yaml"), {}, "names journal 'a/b' more than once", id="duplicate-names"
    ),
    pytest.param(("journals", "apply", "{tmp}/broken.yaml"), {}, 'in "{tmp}/broken.yaml", line 2', id="yaml-error"),
    pytest.param(("journals", "apply", "{tmp}/none.yaml"), {}, "cannot read {tmp}/none.yaml", id="apply-no-file"),
    pytest.param(("journals", "append", "a/b", "--deadline", "-1"), {}, "--deadline is -1.0", id="deadline"),
    pytest.param(("publish", "a/b", "--deadline", "-2"), {}, "--deadline is -2.0", id="publish-deadline"),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--prune-interval", "-5"), {}, "--prune-interval is -5", id="prune"
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--metrics", "bogus"),
        {},
        "'bogus' is not HOST:PORT, 'auto' or ''",
        id="metrics",
    ),
    pytest.param(("cluster", "up", "--metrics-port", "-1"), {}, "--metrics-port is -1", id="metrics-port"),
    pytest.param(("cluster", "up", "--metrics-port", "65535"), {}, "would pass 65535", id="metrics-port-high"),
    pytest.param(("journals", "suspend"), {}, "give a journal NAME or --selector S", id="suspend-nothing"),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--listen", "0.0.0.0:8080"),
        {},
        "tidings broker listens on 0.0.0.0:8080 but would announce an address nobody can dial: pass --advertise",
        id="wildcard-listen",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--listen", "0.0.0.0:8080", "--advertise", "fd00::5"),
        {},
        "--advertise 'fd00::5' is not HOST, HOST:PORT or [IPv6]:PORT",
        id="advertise-v6-unbracketed",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--replication-advertise", "0.0.0.0:9000"),
        {},
        "tidings broker: --replication-advertise 0.0.0.0:9000 is not an address others can dial",
        id="replication-advertise-wildcard",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--metrics-advertise", "host:port"),
        {},
        "tidings broker: --metrics-advertise 'host:port' is not HOST, HOST:PORT or [IPv6]:PORT",
        id="metrics-advertise-malformed",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--metrics", "", "--metrics-advertise", "m.example:9100"),
        {},
        "tidings broker: --metrics-advertise names where /metrics is scraped, but --metrics '' serves none",
        id="metrics-advertise-without-metrics",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--metrics-tls"),
        {},
        "tidings broker: --metrics-tls serves /metrics with this process's certificate: give --tls-cert and --tls-key",
        id="metrics-tls-without-a-certificate",
    ),
    pytest.param(
        ("consumer", "--app", "x:y", "--etcd", "127.0.0.1:2379", "--metrics", "", "--metrics-tls"),
        {},
        "tidings consumer: --metrics-tls serves /metrics over TLS, but --metrics '' serves none",
        id="consumer-metrics-tls-without-metrics",
    ),
    pytest.param(
        ("target", "serve", "--id", "t1", "--db", "{tmp}/t1.db", "--metrics", "127.0.0.1:9555"),
        {"TIDINGS_METRICS_TLS": "1"},
        "tidings target t1: --metrics-tls serves /metrics with this process's certificate",
        id="target-metrics-tls-without-a-certificate",
    ),
    pytest.param(
        ("cluster", "up", "--metrics-tls", "--data-dir", "{tmp}/data"),
        {},
        "tidings cluster up: --metrics-tls serves /metrics with this process's certificate",
        id="cluster-up-metrics-tls-without-a-certificate",
    ),
    pytest.param(
        ("logplayer", "run", "--wal", "wal/x", "--targets", "{tmp}/targets.yaml", "--metrics-tls"),
        {},
        "tidings logplayer run: --metrics-tls serves /metrics over TLS, but --metrics '' serves none",
        id="logplayer-metrics-tls-without-metrics",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--replication-advertise", "[fd00::5"),
        {},
        "--replication-advertise '[fd00::5' is not HOST, HOST:PORT or [IPv6]:PORT",
        id="replication-advertise-unclosed-bracket",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--replication-advertise", "b1.example:99999"),
        {},
        "--replication-advertise 'b1.example:99999' is not HOST, HOST:PORT or [IPv6]:PORT",
        id="replication-advertise-port-too-big",
    ),
    pytest.param(
        ("consumer", "--app", "x:y", "--etcd", "127.0.0.1:2379", "--metrics-advertise", "10.0.0.5:0"),
        {},
        "tidings consumer: --metrics-advertise 10.0.0.5:0 is not an address others can dial",
        id="consumer-metrics-advertise-port-0",
    ),
    pytest.param(
        ("consumer", "--app", "x:y", "--etcd", "127.0.0.1:2379", "--listen", "[::]:9090"),
        {},
        "tidings consumer listens on [::]:9090 but would announce an address nobody can dial",
        id="consumer-wildcard",
    ),
    pytest.param(
        ("cluster", "up", "--listen-host", "0.0.0.0"),
        {},
        "a cluster listening on 0.0.0.0 would announce addresses nobody can dial: pass --advertise-host HOST",
        id="cluster-wildcard",
    ),
    pytest.param(
        ("cluster", "up", "--listen-host", "198.51.100.77"),
        {},
        "198.51.100.77:8080 is taken or not this host's address: give another --port or --listen-host",
        id="cluster-foreign-host",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--etcd-user", "tidings"),
        {},
        "--etcd-user tidings needs its password: set TIDINGS_ETCD_PASSWORD or give --etcd-password-file",
        id="etcd-user-no-password",
    ),
    pytest.param(
        ("consumer", "--app", "examples.wordcount:WordCount", "--etcd", "127.0.0.1:2379"),
        {"TIDINGS_ETCD_PASSWORD": "hunter2"},
        "an etcd password is given but no --etcd-user",
        id="etcd-password-no-user",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--etcd-user", "u", "--etcd-password-file", "/nonexistent/pw"),
        {},
        "cannot read --etcd-password-file /nonexistent/pw",
        id="etcd-password-file",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--etcd-tls-cert", "{tmp}/three.yaml"),
        {},
        "--etcd-tls-cert without --etcd-tls-key: give both",
        id="etcd-tls-cert-alone",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--tls-cert", "{tmp}/three.yaml"),
        {},
        "--tls-cert without --tls-key: give both",
        id="tls-cert-alone",
    ),
    pytest.param(
        ("journals", "list"),
        {"TIDINGS_TLS_CA": "/nonexistent/ca.pem"},
        "cannot read --tls-ca /nonexistent/ca.pem (No such file or directory)",
        id="tls-ca-missing",
    ),
    pytest.param(
        ("cluster", "up", "--tls-cert", "{tmp}/three.yaml", "--tls-key", "{tmp}/three.yaml"),
        {},
        "--tls-cert {tmp}/three.yaml is not a PEM certificate",
        id="tls-not-pem",
    ),
    pytest.param(
        ("broker", "--etcd", "127.0.0.1:2379", "--auth-keys", "c2hvcnRrZXk="),
        {},
        "--auth-keys (TIDINGS_AUTH_KEYS): key at index 0 is 8 bytes",
        id="auth-keys-short",
    ),
    pytest.param(
        ("cluster", "up"),
        {"TIDINGS_AUTH_KEYS_FILE": "/nonexistent/keys"},
        "--auth-keys-file /nonexistent/keys: cannot be read",
        id="auth-keys-file-missing",
    ),
    pytest.param(
        ("journals", "list", "--auth-token", "a b"),
        {},
        "--auth-token (TIDINGS_AUTH_TOKEN) is empty or has spaces",
        id="token-spaces",
    ),
    pytest.param(
        ("journals", "list", "--auth-token", "x.y.z", "--auth-token-file", "{tmp}/three.yaml"),
        {},
        "--auth-token and --auth-token-file are both given: give one",
        id="token-twice",
    ),
    pytest.param(
        ("journals", "list"),
        {"TIDINGS_AUTH_TOKEN_FILE": "/nonexistent/token"},
        "--auth-token-file /nonexistent/token cannot be read",
        id="token-file-missing",
    ),
    pytest.param(  # (the keys are checked before the application is loaded: `nosuch` is never imported)
        ("consumer", "--app", "nosuch:App", "--etcd", "127.0.0.1:2379", "--auth-keys", "c2hvcnRrZXk="),
        {},
        "--auth-keys (TIDINGS_AUTH_KEYS): key at index 0 is 8 bytes",
        id="consumer-auth-keys-short",
    ),
    pytest.param(
        ("consumer", "--app", "nosuch:App", "--etcd", "127.0.0.1:2379", "--auth-keys-file", "{tmp}/three.yaml"),
        {"TIDINGS_AUTH_KEYS": KEY},
        "--auth-keys and --auth-keys-file are both given: give one",
        id="consumer-auth-keys-twice",
    ),
    pytest.param(
        ("target", "serve", "--id", "t0", "--db", "{tmp}/t0.sqlite"),
        {"TIDINGS_AUTH_KEYS_FILE": "/nonexistent/keys"},
        "--auth-keys-file /nonexistent/keys: cannot be read",
        id="target-auth-keys-file-missing",
    ),
    pytest.param(
        ("target", "serve", "--id", "t0", "--db", "{tmp}/t0.sqlite", "--auth-keys", "AA=="),
        {},
        "only AA== (which admits requests without a token): give at least one key",
        id="target-auth-keys-only-aa",
    ),
    pytest.param(
        ("logplayer", "run", "--wal", "w/x", "--targets", "{tmp}/targets.yaml", "--auth-keys", KEY),
        {"TIDINGS_AUTH_TOKEN": "x.y.z"},
        "--auth-keys and --auth-token (TIDINGS_AUTH_TOKEN) are both given: give one",
        id="logplayer-keys-and-token",
    ),
    pytest.param(
        ("logplayer", "run", "--wal", "w/x", "--targets", "{tmp}/targets.yaml", "--auth-keys", "not base64!"),
        {},
        "--auth-keys (TIDINGS_AUTH_KEYS): key at index 0 is not base64",
        id="logplayer-keys-not-base64",
    ),
    pytest.param(
        ("targets", "status", "--targets", "{tmp}/targets.yaml", "--auth-token", "a b"),
        {},
        "--auth-token (TIDINGS_AUTH_TOKEN) is empty or has spaces",
        id="targets-status-token-spaces",
    ),
]


@pytest.mark.parametrize(("args", "env", "says"), MISTAKES)
def test_a_mistake_is_one_line_and_exit_code_2(tmp_path: Path, args: tuple[str, ...], env: dict, says: str) -> None:
    for name, text in SPECS.items():
        (tmp_path / name).write_text(text)
    args = tuple(a.format(tmp=tmp_path) for a in args)
    r = subprocess.run(
        [sys.executable, "-m", "tidings.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TIDINGS_BROKER": "127.0.0.1:1", **env},  # (nothing listens there: never reached)
        cwd=tmp_path,
        timeout=60,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert says.format(tmp=tmp_path) in lines[0], r.stderr
    assert not (tmp_path / "data").exists()  # (cluster up refused before it made anything)


def test_cluster_up_on_a_taken_port_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """A busy port was found by the broker child, which died; now cluster up checks its ports first."""
    import socket

    from tidings.cluster import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "tidings.cli", "cluster", "up", "--brokers", "1", "--port", str(port)],
            capture_output=True, text=True, cwd=tmp_path, timeout=60,
        )  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and f"127.0.0.1:{port} is taken" in lines[0], r
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        pytest.param(("journals", "apply", "{tmp}/empty.yaml"), {}, "empty.yaml is empty", id="empty-spec-file"),
        pytest.param(
            ("journals", "read", "a/b", "--committed", "--max-messages", "-1"),
            {},
            "--max-messages -1",
            id="max-messages-negative",
        ),
        pytest.param(
            ("journals", "read", "a/b", "--end-offset", "-1"),
            {},
            "--end-offset -1: give 0 or more",
            id="end-offset-negative",
        ),
        pytest.param(("journals", "edit", "a/b"), {"EDITOR": "", "VISUAL": ""}, "needs $EDITOR", id="edit-no-editor"),
    ],
)
def test_lesser_mistakes_are_one_line(tmp_path: Path, args: tuple[str, ...], env: dict, says: str) -> None:
    (tmp_path / "empty.yaml").write_text("")
    r = subprocess.run(
        [sys.executable, "-m", "tidings.cli", *(a.format(tmp=tmp_path) for a in args)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=tmp_path, timeout=60,
        env={**os.environ, "TIDINGS_BROKER": "127.0.0.1:1", **env},
    )  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r


# Values of the wrong type or past a limit, which would otherwise reach a traceback deep in parsing
# (or, for the flush interval, pass silently).
ODD_SPECS = {
    # a fragment that is not a mapping: TypeError "'list' object is not a mapping"
    "fragment-list.yaml": "name: a/b\nfragment: [1]\n",
    # labels that are not a mapping: AttributeError "'list' object has no attribute 'items'"
    "labels-list.yaml": "name: a/b\nlabels: [app, shop]\n",
    # YAML's .nan and .inf as durations: ValueError / OverflowError from int()
    "nan.yaml": "name: a/b\nfragment: {refresh_interval: .nan}\n",
    "inf.yaml": "name: a/b\nfragment: {retention: .inf}\n",
}

ODD_VALUES = [
    pytest.param(("journals", "apply", "{tmp}/fragment-list.yaml"), "fragment", id="fragment-not-a-mapping"),
    pytest.param(("journals", "apply", "{tmp}/labels-list.yaml"), "labels", id="labels-not-a-mapping"),
    pytest.param(("journals", "apply", "{tmp}/nan.yaml"), "refresh_interval", id="duration-nan"),
    pytest.param(("journals", "apply", "{tmp}/inf.yaml"), "retention", id="duration-inf"),
    # a spec file that is not UTF-8 (Latin-1 from an old editor): UnicodeDecodeError
    pytest.param(("journals", "apply", "{tmp}/latin1.yaml"), "latin1.yaml", id="file-not-utf8"),
    # a port of digits str.isdigit() accepts and int() does not: ValueError in the --broker check
    pytest.param(("journals", "list", "--broker", "127.0.0.1:\u00b2"), "is not HOST:PORT", id="broker-superscript"),
    # cluster up's port probe binds past 65535: OverflowError "bind(): port must be 0-65535"
    pytest.param(("cluster", "up", "--brokers", "2", "--port", "65535"), "--port", id="ports-past-65535"),
    pytest.param(("cluster", "up", "--port", "70000"), "--port", id="port-70000"),
    # a negative flush interval, unchecked, would act as 0 (one append per line) without a word
    pytest.param(("publish", "a/b", "--flush-interval", "-1"), "--flush-interval", id="flush-interval-negative"),
]


@pytest.mark.parametrize(("args", "says"), ODD_VALUES)
def test_a_value_of_the_wrong_type_or_range_is_one_line_and_exit_code_2(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    for name, text in ODD_SPECS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.yaml").write_bytes("name: a/b\nlabels: {owner: Ren\u00e9}\n".encode("latin-1"))
    args = tuple(a.format(tmp=tmp_path) for a in args)
    r = subprocess.run(
        [sys.executable, "-m", "tidings.cli", *args],
        input=b'{"n": 1}\n',
        capture_output=True,
        env={**os.environ, "TIDINGS_BROKER": "127.0.0.1:1"},  # (nothing listens there: never reached)
        cwd=tmp_path,
        timeout=60,
    )
    err = r.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert r.returncode == 2, (r.returncode, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "data").exists()  # (cluster up refused before it made anything)


# ShardSpec fields given a number too large for their protobuf type (a typo'd ring_buffer_size,
# min_offset or duration): the file is checked before any call, so no consumer is needed.
CASES = {
    "ring_buffer_size": "id: a\nsources: [x]\nring_buffer_size: 1099511627776\n",
    "min_offset": "id: a\nsources: [{journal: x, min_offset: 100000000000000000000}]\n",
    "max_txn_duration": "id: a\nsources: [x]\nmax_txn_duration: 9999999999999999h\n",
}


@pytest.mark.parametrize("field", sorted(CASES))
def test_out_of_range_shard_fields_are_one_line(field: str, tmp_path: Path) -> None:
    """`tidings shards apply` names the field in one line (exit 2), not protobuf's "Value out of range"
    traceback from shard_from_dict."""
    f = tmp_path / "shards.yaml"
    f.write_text(CASES[field])
    r = tidings("shards", "apply", str(f), env={"TIDINGS_CONSUMER": "127.0.0.1:1"})
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert "Traceback" not in err and field in err and len(err.strip().splitlines()) == 1, err
