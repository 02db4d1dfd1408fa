"""A private PostgreSQL server as a child process on loopback, for the consumer's PostgresStore tests
and bench (as `EtcdProcess` is for etcd).

`PostgresProcess` runs Debian's PostgreSQL binaries (`make` installs the `postgresql` package when
missing): `initdb` into a temporary data dir (trust authentication, user ``tidings``, no locale),
then `postgres` on 127.0.0.1 and a free port, its Unix socket in the data dir. PostgreSQL refuses
to run as root, so as root both run as the ``postgres`` user that package creates (util-linux's
`setpriv`, which also arms the parent-death signal after the change of user: a parent killed
outright leaves no server behind). `stop()` stops it by PID with PostgreSQL's fast shutdown
(SIGINT: open transactions roll back), then SIGKILL.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tidings.cluster.etcd import ClusterError, die_with_parent, free_port, last_line, stop_process
from tidings.protocol.status import UsageError

USER = "tidings"  # the server's superuser; trust authentication on loopback


def find_postgres_bin() -> Path:
    """The directory of PostgreSQL's server binaries: Debian's newest /usr/lib/postgresql/N/bin, or the
    directory of a `postgres` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    on_path = shutil.which("postgres")
    if found:
        return Path(found[-1]).parent
    if on_path:
        return Path(os.path.realpath(on_path)).parent
    raise UsageError("no PostgreSQL server found: install Debian's postgresql (`make install` does)")


class PostgresProcess:
    """One PostgreSQL server on 127.0.0.1 with its own temporary data dir; `start()` returns once it
    accepts connections. `fsync=False` trades durability for speed (tests); the bench keeps it."""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync
        self.port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="tidings-postgres-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._bin = find_postgres_bin()

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq connection URL for database `dbname` of this server."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def _argv(self, program: str, *args: str) -> tuple[list[str], Callable[[], None] | None]:
        """`program`'s command line, as the ``postgres`` user when we are root."""
        argv = [str(self._bin / program), *args]
        if os.geteuid() != 0:
            return die_with_parent(argv)
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise UsageError("PostgreSQL cannot run as root and there is no postgres user: install Debian's "
                             "postgresql (`make install` does)") from None  # fmt: skip
        setpriv = shutil.which("setpriv") or "setpriv"
        return [setpriv, "--pdeathsig", "TERM", "--reuid=postgres", "--regid=postgres", "--init-groups", "--",
                *argv], None  # fmt: skip

    def start(self, timeout: float = 60.0) -> PostgresProcess:
        if os.geteuid() == 0:
            shutil.chown(self.data_dir, "postgres", "postgres")
        pgdata, log = self.data_dir / "data", self.data_dir / "postgres.log"
        argv, preexec = self._argv(
            "initdb", "-D", str(pgdata), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"
        )
        done = subprocess.run(argv, capture_output=True, preexec_fn=preexec, check=False)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
            raise ClusterError(f"initdb exited with {done.returncode}: {said[-1] if said else 'no output'}")
        settings = ["listen_addresses=127.0.0.1", f"fsync={'on' if self.fsync else 'off'}", "max_connections=200"]
        if not self.fsync:
            settings += ["synchronous_commit=off", "full_page_writes=off"]
        argv, preexec = self._argv(
            "postgres", "-D", str(pgdata), "-p", str(self.port), "-k", str(self.data_dir),
            *(arg for s in settings for arg in ("-c", s)),
        )  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=preexec,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._accepts():
            if self.proc.poll() is not None:
                raise ClusterError(f"postgres exited with {self.proc.returncode} at start "
                                   f"({last_line(log) or 'no output'}); see {log}")  # fmt: skip
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(f"postgres did not accept connections on port {self.port} within {timeout:g}s")
            time.sleep(0.05)
        return self

    def _accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.dsn(), connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def create_database(self, name: str | None = None) -> str:
        """A new empty database (a fresh name if none given); returns its DSN."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def stop(self) -> None:
        """Stop the server by PID (fast shutdown, then SIGKILL) and remove its data dir."""
        proc, self.proc = self.proc, None
        stop_process(proc, signal.SIGINT, timeout=20)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> PostgresProcess:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
