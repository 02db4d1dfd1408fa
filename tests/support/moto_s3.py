"""A real local S3 endpoint for tests: moto's server as a child process on 127.0.0.1.

`MotoS3` starts `python -m moto.server` on a free loopback port, waits until it answers HTTP,
creates one bucket, and stops the child by PID (SIGTERM, then SIGKILL) even when a test fails.
While it runs, the process environment holds throwaway AWS credentials and no profile, config
file or endpoint of the machine's own, so nothing can reach a real AWS account; the previous
environment is restored on stop. Store URLs name the endpoint in the URL itself, as Gazette's
do (`s3://bucket/prefix/?endpoint=http://127.0.0.1:PORT`), so brokers and clients in this
process, and child processes started with its environment, all reach the same server.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import uuid
from types import TracebackType

from tidings.cluster.etcd import die_with_parent, free_port

from .waiting import wait_until_sync

BUCKET = "tidings-test"

# What the AWS SDKs (botocore, under s3fs) read; every one is set or cleared while the server runs.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask an instance-metadata service for credentials
    "AWS_SESSION_TOKEN": None,
    "AWS_PROFILE": None,
    "AWS_ENDPOINT_URL": None,
    "AWS_ENDPOINT_URL_S3": None,
}


class MotoS3:
    """moto's S3 server on 127.0.0.1; `start()` returns once it answers and the bucket exists."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._saved_env: dict[str, str | None] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        """A store URL under a fresh (or the given) prefix, carrying this server's endpoint."""
        prefix = prefix or f"t-{uuid.uuid4().hex[:12]}"
        return f"s3://{self.bucket}/{prefix}/?endpoint={self.endpoint}"

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"moto_server exited with {self.proc.returncode}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _request(self, method: str, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def start(self, timeout: float = 60.0) -> MotoS3:
        for key, value in _AWS_ENV.items():
            self._saved_env[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        argv, preexec = die_with_parent([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)])
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,
        )
        try:
            wait_until_sync(self._answers, timeout, interval=0.05)
            # moto's server does not check signatures: a plain PUT creates the bucket.
            status = self._request("PUT", f"/{self.bucket}")
            assert status == 200, f"creating bucket {self.bucket} answered HTTP {status}"
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env.clear()

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
