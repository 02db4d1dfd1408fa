"""Review 27: `journals append` must not hang on an answer lost in transport (its --deadline bounds
retrying). The broker commits the content attempt and then never answers (as a frozen connection
without keep-alive would); the CLI's content attempt has no per-attempt timeout (callable content is
not `whole`, so `AsyncClient.append` sets none), so it waits for ever."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import tidings.broker.service as service
from tidings.broker.append_api import serve_append


async def test_journals_append_gives_up_or_checks_when_an_answer_is_lost(cluster, monkeypatch, tmp_path) -> None:
    await cluster.create_journal("review27/lost", 3)
    await cluster.wait_consistent("review27/lost", 3)
    swallowed = []

    async def lossy(broker, context):
        resp = await serve_append(broker, context)
        if resp is not None and resp.commit.end > resp.commit.begin and not swallowed:
            swallowed.append(resp.commit)
            await asyncio.Event().wait()  # committed, but the answer never comes
        return resp

    monkeypatch.setattr(service, "serve_append", lossy)
    f = tmp_path / "content"
    f.write_bytes(b"x" * 1000)
    env = {**os.environ, "TIDINGS_BROKER": cluster.brokers[0].endpoint}
    cmd = [sys.executable, "-m", "tidings.cli", "journals", "append", "review27/lost"]
    cmd += ["--file", str(f), "--deadline", "5"]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 45)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"`journals append --deadline 5` still waiting after 45s (commit {swallowed})") from None
    assert swallowed, "the lossy hook never fired"
    assert proc.returncode == 0, err
    assert json.loads(out)["begin"] == swallowed[0].begin  # it found its content, appended once
