"""Review 29: `tidings shards apply` with a number too large for its ShardSpec field (a typo'd
ring_buffer_size, min_offset or duration) must print one line naming the field, not a traceback
(protobuf's ValueError "Value out of range" escapes shard_from_dict). No consumer is needed: the file
is checked before any call."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import tidings

CASES = {
    "ring_buffer_size": "id: a\nsources: [x]\nring_buffer_size: 1099511627776\n",
    "min_offset": "id: a\nsources: [{journal: x, min_offset: 100000000000000000000}]\n",
    "max_txn_duration": "id: a\nsources: [x]\nmax_txn_duration: 9999999999999999h\n",
}


@pytest.mark.parametrize("field", sorted(CASES))
def test_out_of_range_shard_fields_are_one_line(field: str, tmp_path: Path) -> None:
    f = tmp_path / "shards.yaml"
    f.write_text(CASES[field])
    r = tidings("shards", "apply", str(f), env={"TIDINGS_CONSUMER": "127.0.0.1:1"})
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert "Traceback" not in err and field in err and len(err.strip().splitlines()) == 1, err
