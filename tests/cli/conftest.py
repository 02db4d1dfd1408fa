"""Fixtures the cli tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
async def spec_file(cluster, tmp_path: Path) -> Path:
    f = tmp_path / "journals.yaml"
    f.write_text(
        "journals:\n"
        "  - name: cli/hello\n"
        "    replication: 3\n"
        "    labels: {app: cli}\n"
        "    fragment:\n"
        "      length: 1MiB\n"
        "      compression_codec: gzip\n"
        "      refresh_interval: 1s\n"
        f"      stores: ['{cluster.store_url}']\n"
    )
    return f
