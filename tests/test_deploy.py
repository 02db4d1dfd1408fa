"""deploy/ and docs/deploy.md as an operator uses them (docs/design/production.md §3.14).

- Every systemd unit passes `systemd-analyze verify` (with its ExecStart pointed at this virtualenv's
  `tidings`), and the check is shown to catch a broken unit; each unit has the settings the guide
  relies on (credentials, state directory, stop timeout above the hand-off's, hardening), and its
  ExecStart names only flags its command has and writes only under /var/lib/tidings.
- deploy/systemd/tidings.env.example: each section is a file the units read; each variable in it is
  one the command reading that file takes; every variable those commands take is in it; secrets
  never have a value, and nothing in it overrides what a unit sets itself.
- deploy/Containerfile installs by the wheel test's own command (tests/test_wheel.py), as a user other
  than root, with `tidings` as its entry point.
- docs/deploy.md: every flag it gives a `tidings` command, and every TIDINGS_* variable it names, is
  one the command line has.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_wheel import INSTALL

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "deploy" / "systemd"
ENV_EXAMPLE = SYSTEMD / "tidings.env.example"
GUIDE = REPO / "docs" / "deploy.md"
INSTALLED = "/opt/tidings/bin/tidings"  # (where the units expect tidings: docs/deploy.md, "Installing")

# Each unit: the instance `systemd-analyze verify` checks, the command its ExecStart runs, and the
# section of tidings.env.example its own EnvironmentFile (/etc/tidings/%N.env) is.
UNITS = {
    "tidings-broker.service": ("tidings-broker.service", ("broker",), "tidings-broker.env"),
    "tidings-consumer@.service": ("tidings-consumer@wordcount.service", ("consumer",), "tidings-consumer@APP.env"),
    "tidings-target@.service": ("tidings-target@shard-0.service", ("target", "serve"), "tidings-target@ID.env"),
    "tidings-logplayer@.service": (
        "tidings-logplayer@orders.service", ("logplayer", "run"), "tidings-logplayer@NAME.env"
    ),
}  # fmt: skip
SHARED = "tidings.env"  # (/etc/tidings/tidings.env: every unit reads it first)

SECRETS = {"TIDINGS_AUTH_KEYS", "TIDINGS_AUTH_TOKEN", "TIDINGS_ETCD_PASSWORD"}


# --- the command line, as `tidings` builds it ---


@functools.cache
def command(path: tuple[str, ...]) -> Any:
    """The click command of `tidings PATH...` (e.g. ("target", "serve")), as the CLI builds it."""
    from typer.main import get_command

    from tidings.cli.app import application

    cmd: Any = get_command(application(path[0]))
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def flags(path: tuple[str, ...]) -> set[str]:
    return {o for p in command(path).params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}


def accepts(path: tuple[str, ...], var: str) -> bool:
    """Whether `tidings PATH` reads `var`: an option's variable, or one its help names (a password read
    from the environment alone has no option)."""
    for p in command(path).params:
        if var in (p.envvar if isinstance(p.envvar, list | tuple) else [p.envvar]):
            return True
        if var in (getattr(p, "help", None) or ""):
            return True
    return var in (command(path).help or "")


@functools.cache
def all_commands() -> list[tuple[str, ...]]:
    from typer.main import get_command

    from tidings.cli.app import application

    found = []

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs is None:
            found.append(path)
        for name, sub in (subs or {}).items():
            walk(sub, (*path, name))

    walk(get_command(application()), ())
    return found


# --- the units ---


def settings(unit: str) -> list[tuple[str, str, str]]:
    """A unit's (section, key, value) lines, in order (keys repeat: EnvironmentFile, LoadCredential)."""
    section, out = "", []
    for line in (SYSTEMD / unit).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def service(unit: str, key: str) -> list[str]:
    return [v for s, k, v in settings(unit) if s == "Service" and k == key]


def exec_start(unit: str) -> list[str]:
    (line,) = service(unit, "ExecStart")
    return shlex.split(line)


def test_every_unit_file_is_one_this_test_knows() -> None:
    assert sorted(p.name for p in SYSTEMD.glob("*.service")) == sorted(UNITS)


def _verify(tmp_path: Path, unit: str, edit: Any = None) -> list[str]:
    """`systemd-analyze verify` of the unit (its instance, for a template), copied with every unit into
    `tmp_path`, ExecStart running this virtualenv's `tidings`, and `edit` applied to its text: what it
    says about our units (its exit code too). What it says about units of the machine it loads because ours
    name them (network-online.target, multi-user.target) is the machine's business, not ours. Nothing is
    tolerated: verify checks the syntax, the specifiers and that ExecStart is executable; the user
    `tidings`, /etc/tidings and the credentials need not exist for it."""
    tidings = Path(sys.executable).parent / "tidings"
    assert tidings.exists(), f"{tidings}: the test virtualenv's tidings command (pip install -e .)"
    for name in UNITS:
        text = (SYSTEMD / name).read_text().replace(INSTALLED, str(tidings))
        if name == unit and edit is not None:
            text = edit(text)
        (tmp_path / name).write_text(text)
    instance = UNITS[unit][0]
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / instance)], capture_output=True, text=True, timeout=60
    )
    ours = (str(tmp_path), *UNITS, instance)
    said = [line for line in (r.stdout + r.stderr).splitlines() if any(n in line for n in ours)]
    return said + ([f"exit code {r.returncode}"] if r.returncode else [])


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_the_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    assert _verify(tmp_path, unit) == []


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda t: t.replace("Restart=on-failure", "Restart=on-failure\nRestartNow=1"), id="unknown-key"),
        pytest.param(lambda t: t.replace("ExecStart=", "ExecStart=/nonexistent"), id="missing-command"),
        pytest.param(lambda t: t.replace("KillSignal=SIGTERM", "KillSignal=SIGTREM"), id="bad-value"),
    ],
)
def test_verify_catches_a_broken_unit(edit: Any, tmp_path: Path) -> None:
    """The check above is not vacuous on this machine: a broken copy of a unit is reported."""
    assert _verify(tmp_path, "tidings-broker.service", edit) != []


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_the_unit_has_the_settings_the_guide_relies_on(unit: str) -> None:
    path = UNITS[unit][1]
    for key, value in [
        ("User", "tidings"),
        ("EnvironmentFile", "/etc/tidings/tidings.env"),
        ("EnvironmentFile", "/etc/tidings/%N.env"),
        ("StateDirectory", "tidings"),
        ("KillSignal", "SIGTERM"),
        ("Restart", "on-failure"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ReadWritePaths", "/var/lib/tidings"),
        ("PrivateTmp", "yes"),
        ("ProtectHome", "yes"),
    ]:
        assert value in service(unit, key), f"{unit}: no {key}={value}"
    assert service(unit, "EnvironmentFile") == ["/etc/tidings/tidings.env", "/etc/tidings/%N.env"], "shared, then own"
    argv = exec_start(unit)
    assert argv[: 1 + len(path)] == [INSTALLED, *path], argv
    # Credentials: each %d/NAME the unit uses is a LoadCredential NAME from /etc/tidings; keys or a token.
    loaded = dict(c.split(":", 1) for c in service(unit, "LoadCredential"))
    used = re.findall(r"%d/([\w-]+)", " ".join(service(unit, "Environment") + service(unit, "ExecStart")))
    assert used and set(used) == set(loaded), (used, loaded)
    assert all(src.startswith("/etc/tidings/") for src in loaded.values()), loaded
    env = dict(e.split("=", 1) for e in service(unit, "Environment"))
    if path == ("logplayer", "run"):
        assert env.get("TIDINGS_AUTH_TOKEN_FILE") == "%d/auth-token"
    else:
        assert loaded["auth-keys"] == "/etc/tidings/auth-keys" and env.get("TIDINGS_AUTH_KEYS_FILE") == "%d/auth-keys"
    # A stop waits out the process's own hand-off (--exit-timeout, where it has one), with a minute to spare.
    (stop,) = service(unit, "TimeoutStopSec")
    exit_timeout = next((p.default for p in command(path).params if p.name == "exit_timeout"), None)
    if exit_timeout is not None:
        assert int(stop) >= exit_timeout + 60, f"{unit}: TimeoutStopSec={stop}, --exit-timeout {exit_timeout}"


def _exec_flags() -> list[Any]:
    return [
        pytest.param(unit, word.split("=")[0], id=f"{unit}:{word.split('=')[0]}")
        for unit in sorted(UNITS)
        for word in exec_start(unit)
        if word.startswith("--")
    ]


@pytest.mark.parametrize("unit,flag", _exec_flags())
def test_the_units_execstart_flag_is_one_its_command_has(unit: str, flag: str) -> None:
    path = UNITS[unit][1]
    if flag not in flags(path):
        pytest.fail(f"{unit}: `tidings {' '.join(path)}` has no {flag}")
    argv = exec_start(unit)
    value = argv[argv.index(flag) + 1]
    if flag in ("--data-dir", "--db", "--state"):  # (ProtectSystem=strict: only ReadWritePaths is writable)
        assert value.startswith("/var/lib/tidings/"), f"{unit}: {flag} {value} is outside ReadWritePaths"


# --- the environment example ---


def env_sections() -> dict[str, list[tuple[str, str, bool]]]:
    """tidings.env.example's sections, by the file each header names: (variable, value, commented out)."""
    sections: dict[str, list[tuple[str, str, bool]]] = {}
    current = None
    for line in ENV_EXAMPLE.read_text().splitlines():
        header = re.match(r"^# ==== /etc/tidings/([^\s:]+)", line)
        if header:
            current = sections.setdefault(header.group(1), [])
            continue
        m = re.match(r"^(#?)(TIDINGS_[A-Z0-9_]+)=(.*)$", line)
        if m:
            assert current is not None, f"{line!r} is before the first section"
            current.append((m.group(2), m.group(3), m.group(1) == "#"))
    return sections


def section_commands(section: str) -> list[tuple[str, ...]]:
    if section == SHARED:
        return [path for _, path, _ in UNITS.values()]
    return [path for _, path, own in UNITS.values() if own == section]


def test_each_section_is_a_file_the_units_read() -> None:
    assert sorted(env_sections()) == sorted([SHARED, *(own for _, _, own in UNITS.values())])


def _section_vars() -> list[Any]:
    return [
        pytest.param(section, var, id=f"{section}:{var}")
        for section, lines in env_sections().items()
        for var, _, _ in lines
    ]


@pytest.mark.parametrize("section,var", _section_vars())
def test_each_example_variable_is_one_a_command_reading_it_takes(section: str, var: str) -> None:
    readers = section_commands(section)
    if not any(accepts(path, var) for path in readers):
        pytest.fail(f"{section}: {var} is read by none of {[' '.join(p) for p in readers]}")


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_every_variable_of_the_units_command_is_in_the_example(unit: str) -> None:
    """(The example is where an operator looks for a setting: a new flag's variable belongs in it.)"""
    _, path, own = UNITS[unit]
    sections = env_sections()
    named = {var for var, _, _ in sections[SHARED] + sections[own]}
    takes = {v for p in command(path).params for v in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])}
    missing = sorted(takes - named)
    assert not missing, f"add {missing} to deploy/systemd/tidings.env.example, section {own} or {SHARED}"


def test_secrets_have_no_value_and_nothing_overrides_what_the_units_set() -> None:
    """EnvironmentFile= wins over a unit's Environment=: a variable the example set would replace the
    credential paths the units give."""
    set_by_units = {e.split("=", 1)[0] for unit in UNITS for e in service(unit, "Environment")}
    for section, lines in env_sections().items():
        for var, value, commented in lines:
            if var in SECRETS:
                assert commented and value == "", f"{section}: {var} must stay an empty comment (a secret)"
            if var in set_by_units:
                assert commented, f"{section}: {var} is set by the units (Environment=): leave it commented out"
    text = ENV_EXAMPLE.read_text()
    assert not re.search(r"-----BEGIN|eyJhbGciOi", text), "a key, a certificate or a token in the example"


# --- the container image ---


def test_the_containerfile_installs_as_the_wheel_test_does() -> None:
    text = (REPO / "deploy" / "Containerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"^COPY dist/tidings-\*\.whl ", text, re.M), "the wheel `pip wheel . --no-deps -w dist` writes"
    assert INSTALL in text, f"deploy/Containerfile no longer installs with {INSTALL!r} (tests/test_wheel.py)"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(r'^ENTRYPOINT \["tidings"\]$', text, re.M)


# --- the guide ---


SHELL_WORDS = {"until", "while", "if", "then", "do", "else", "time", "exec", "sudo", "!"}


def guide_commands() -> list[list[str]]:
    """The `tidings ...` commands of docs/deploy.md's shell blocks, each as its words after `tidings` (in a
    `console` block, only the lines after a `$ ` prompt)."""
    found = []
    for lang, block in re.findall(r"^```(sh|bash|console)\n(.*?)^```", GUIDE.read_text(), re.S | re.M):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"(^|\s)#.*$", "", line)
            for part in re.split(r"\|\||&&|[|;(]|\$\(|`", line):
                try:
                    words = shlex.split(part)
                except ValueError:  # (a quote opened in another part: no command of ours there)
                    continue
                while words and (words[0] in SHELL_WORDS or re.match(r"^[A-Z_][A-Z0-9_]*=", words[0])):
                    words.pop(0)  # (keywords and VAR=value before the command)
                if words and (words[0] == "tidings" or words[0].endswith("/bin/tidings")):
                    found.append(words[1:])
    return found


def _resolve(words: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The command path among `words` (the subcommands they name) and the rest."""
    from typer.main import get_command

    from tidings.cli.app import application

    cmd: Any = get_command(application())
    path: list[str] = []
    rest = list(words)
    while rest and getattr(cmd, "commands", None) and rest[0] in cmd.commands:
        cmd = cmd.commands[rest[0]]
        path.append(rest.pop(0))
    return tuple(path), rest


def _guide_flags() -> list[Any]:
    seen: dict[tuple[tuple[str, ...], str], None] = {}
    for words in guide_commands():
        path, rest = _resolve(words)
        for word in rest:
            if word.startswith("--"):
                seen[(path, word.split("=")[0])] = None
    return [pytest.param(path, flag, id=f"{' '.join(path) or 'tidings'}:{flag}") for path, flag in seen]


def test_the_guide_has_commands_to_check() -> None:
    paths = {_resolve(words)[0] for words in guide_commands()}
    assert {("broker",), ("auth", "token"), ("auth", "keygen"), ("cluster", "up"), ("journals", "apply")} <= paths


@pytest.mark.parametrize("path,flag", _guide_flags())
def test_each_flag_the_guide_gives_a_command_is_one_it_has(path: tuple[str, ...], flag: str) -> None:
    if not path:  # (`tidings --version`: an option of the command itself)
        from typer.main import get_command

        from tidings.cli.app import application

        assert flag in {o for p in get_command(application()).params for o in p.opts} | {"--help"}, flag
        return
    if flag not in flags(path):
        pytest.fail(f"docs/deploy.md: `tidings {' '.join(path)}` has no {flag}")


@pytest.mark.parametrize("var", sorted(set(re.findall(r"\bTIDINGS_[A-Z0-9_]*[A-Z0-9](?![\w*])", GUIDE.read_text()))))
def test_each_variable_the_guide_names_is_one_a_command_takes(var: str) -> None:
    if not any(accepts(path, var) for path in all_commands()):
        pytest.fail(f"docs/deploy.md names {var}, which no tidings command takes")
