"""Review 25: `journals apply` and `edit` against a real cluster, where they apply something other
than what the file or the report says, or reach a traceback for a user's mistake."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_cli import run


async def _listed(ep: str, name: str) -> dict:
    r = await run("journals", "list", "--json", broker=ep)
    return next(row for row in map(json.loads, r.stdout.splitlines()) if row["name"] == name)


async def test_review_25_list_yaml_of_a_two_week_retention_applies_and_edits(cluster, tmp_path: Path) -> None:
    """`retention: 336h` (two weeks) is listed as `1.2096e+06s` (`:g` formatting), which apply cannot
    parse: what `list --yaml` prints no longer applies unchanged, and `edit` of the journal fails
    whatever the user changes (every duration of 1e6 s, about 11.6 days, or more is printed so)."""
    ep = cluster.brokers[0].endpoint
    spec = tmp_path / "two-weeks.yaml"
    spec.write_text("name: r25/kept\nreplication: 1\nlabels: {app: r25}\nfragment: {retention: 336h}\n")
    r = await run("journals", "apply", str(spec), broker=ep)
    assert r.returncode == 0 and r.stdout == b"created r25/kept\n", r

    listed = tmp_path / "listed.yaml"
    listed.write_bytes((await run("journals", "list", "--yaml", "--selector", "app=r25", broker=ep)).stdout)
    r = await run("journals", "apply", str(listed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["unchanged r25/kept"], r

    edit = {"EDITOR": "sed -i 's/replication: 1/replication: 2/'", "TMPDIR": str(tmp_path)}
    r = await run("journals", "edit", "r25/kept", broker=ep, env=edit)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated r25/kept: replication 1 -> 2"], r
    row = await _listed(ep, "r25/kept")
    assert row["replication"] == 2 and row["fragment"]["retention"] in ("336h", "1209600s"), row


async def test_review_25_a_quoted_false_delete_does_not_delete(cluster, tmp_path: Path) -> None:
    """`delete: "false"` (quoted, as a template or `yq` writes it) is a non-empty string, truthy:
    apply reported `deleted` and deleted the journal. It must be refused (delete takes true or
    false) or taken as false; never delete."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/keep", 1, labels={"app": "r25"})
    f = tmp_path / "quoted.yaml"
    f.write_text('name: r25/keep\nreplication: 1\nlabels: {app: r25}\ndelete: "false"\n')
    f.write_text(f.read_text() + f"fragment: {{length: 1MiB, stores: ['{cluster.store_url}'], refresh_interval: 1s}}\n")
    r = await run("journals", "apply", str(f), broker=ep)
    listed = (await run("journals", "list", "--json", broker=ep)).stdout
    assert b'"r25/keep"' in listed, (r, "the journal was deleted")
    assert b"deleted" not in r.stdout, r


async def test_review_25_a_revision_that_is_no_number_is_one_line(cluster, tmp_path: Path) -> None:
    """`revision: abc` / `revision:` (null) went to int() in _plan: ValueError / TypeError traceback."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/rev", 1)
    for value in ("abc", "", "[5]"):
        f = tmp_path / "rev.yaml"
        f.write_text(f"name: r25/rev\nreplication: 1\nrevision: {value}\n")
        r = await run("journals", "apply", str(f), broker=ep)
        err = r.stderr.decode()
        lines = err.splitlines()
        assert "Traceback" not in err and r.returncode == 2, (value, err)
        assert len(lines) == 1 and "revision" in lines[0], (value, err)


async def test_review_25_edit_with_an_editor_that_cannot_run_is_one_line(cluster, tmp_path: Path) -> None:
    """$EDITOR naming no program, $EDITOR with an unbalanced quote, and neither $VISUAL nor $EDITOR
    set where there is no `vi`: FileNotFoundError / ValueError tracebacks (and a temp file left
    behind, unnamed)."""
    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/ed", 1)
    no_vi = tmp_path / "bin"
    no_vi.mkdir()
    base = {"VISUAL": "", "EDITOR": "", "TMPDIR": str(tmp_path)}  # (empty: unset, as the command reads them)
    for env in (
        base | {"EDITOR": "/nonexistent/editor"},
        base | {"EDITOR": "'unbalanced"},
        base | {"PATH": str(no_vi)},
    ):
        r = await run("journals", "edit", "r25/ed", broker=ep, env=env)
        err = r.stderr.decode()
        lines = err.splitlines()
        assert "Traceback" not in err and r.returncode in (1, 2), (env.get("EDITOR"), err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "EDITOR" in lines[0], (env.get("EDITOR"), err)


async def test_review_25_edit_of_a_journal_deleted_meanwhile(cluster, tmp_path: Path) -> None:
    """Held up: the journal is deleted while the editor is open; the edit (at the revision it read)
    is refused naming the journal as absent, nothing is created, and the edit is kept in a file."""
    import shlex
    import sys

    ep = cluster.brokers[0].endpoint
    await cluster.create_journal("r25/went", 1)
    delete = f"{shlex.quote(sys.executable)} -m tidings.cli journals delete r25/went --yes --broker {ep} >/dev/null"
    script = delete + " && sed -i 's/replication: 1/replication: 2/' \"$0\""
    editor = "sh -c " + shlex.quote(script)
    r = await run("journals", "edit", "r25/went", broker=ep, env={"EDITOR": editor, "TMPDIR": str(tmp_path)})
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode(), r
    assert any("journal 'r25/went' does not exist" in line for line in lines), r  # (after "your edit is in")
    assert any(line.startswith("your edit is in ") for line in lines) and len(lines) == 2, r
    assert b"r25/went" not in (await run("journals", "list", "--json", broker=ep)).stdout
