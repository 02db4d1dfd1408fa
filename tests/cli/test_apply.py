"""`tidings journals apply` and `delete` as an operator uses them (issue 8, items 1 and 2), against a
real cluster: what `list --yaml` prints applies unchanged; apply says per journal what it changed
(and warns when an omitted field returns to its default); --dry-run changes nothing; deleting asks
first, and deleting (or expecting a revision of) an absent journal says it is absent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.cli.test_cli import run, spec_file  # noqa: F401  (spec_file: a fixture)


async def _replication(ep: str, name: str) -> int:
    r = await run("journals", "list", "--json", broker=ep)
    return next(json.loads(line)["replication"] for line in r.stdout.splitlines() if json.loads(line)["name"] == name)


async def test_list_yaml_applies_unchanged_and_updates_are_reported(cluster, spec_file: Path, tmp_path) -> None:  # noqa: F811
    ep = cluster.brokers[0].endpoint
    r = await run("journals", "apply", str(spec_file), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["created cli/hello"], r
    listed = tmp_path / "listed.yaml"
    listed.write_bytes((await run("journals", "list", "--yaml", broker=ep)).stdout)
    r = await run("journals", "apply", str(listed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["unchanged cli/hello"], r

    changed = tmp_path / "r2.yaml"
    changed.write_text(listed.read_text().replace("replication: 3", "replication: 2"))
    r = await run("journals", "apply", str(changed), broker=ep)
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated cli/hello: replication 3 -> 2"], r
    assert b"warning" not in r.stderr
    r = await run("journals", "apply", str(listed), broker=ep)  # (its revision is stale now)
    assert r.returncode == 1 and b"changed concurrently" in r.stderr and b"Traceback" not in r.stderr
    assert await _replication(ep, "cli/hello") == 2


async def test_a_partial_spec_warns_and_dry_run_changes_nothing(cluster, spec_file: Path, tmp_path) -> None:  # noqa: F811
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    partial = tmp_path / "partial.yaml"
    partial.write_text("name: cli/hello\nreplication: 2\n")
    r = await run("journals", "apply", str(partial), "--dry-run", broker=ep)
    out, err = r.stdout.decode().splitlines(), r.stderr.decode()
    assert (
        r.returncode == 0
        and out[0].startswith("updated cli/hello: replication 3 -> 2; labels")
        and out[-1] == ("dry run: nothing applied")
    ), r
    assert "omits labels, fragment.length, fragment.compression_codec" in err and err.count("\n") == 1, err
    assert await _replication(ep, "cli/hello") == 3


async def test_delete_asks_first_and_absent_journals_are_named(cluster, spec_file: Path, tmp_path) -> None:  # noqa: F811
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    r = await run("journals", "delete", "cli/hello", broker=ep)  # (stdin is no terminal: no one can confirm)
    assert r.returncode == 2 and b"needs --yes" in r.stderr
    r = await run("journals", "delete", "cli/hello", "--yes", broker=ep)
    assert r.returncode == 0 and r.stdout == b"deleted cli/hello\n"
    assert (await run("journals", "list", "--json", broker=ep)).stdout == b""
    for args, says in (
        (("journals", "delete", "cli/hello", "--yes"), "journal 'cli/hello' does not exist"),
        (("journals", "apply", "{tmp}/gone.yaml"), "journal 'cli/gone' does not exist: there is nothing to delete"),
        (("journals", "apply", "{tmp}/rev.yaml"), "does not exist, but the file expects it at revision 7"),
    ):
        (tmp_path / "gone.yaml").write_text("name: cli/gone\ndelete: true\n")
        (tmp_path / "rev.yaml").write_text("name: cli/gone\nrevision: 7\n")
        r = await run(*(a.format(tmp=tmp_path) for a in args), broker=ep)
        lines = r.stderr.decode().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and says in lines[0], r


async def test_edit_applies_what_the_editor_changed_at_the_revision_it_read(cluster, spec_file: Path, tmp_path) -> None:  # noqa: F811
    """gazctl's edit: the specs in $EDITOR, applied at their revisions; no change, no apply; an
    edit that does not apply is kept in a file, named, to apply again."""
    ep = cluster.brokers[0].endpoint
    await run("journals", "apply", str(spec_file), broker=ep)
    r = await run(
        "journals", "edit", "cli/hello", broker=ep, env={"EDITOR": "sed -i 's/replication: 3/replication: 2/'"}
    )
    assert r.returncode == 0 and r.stdout.decode().splitlines() == ["updated cli/hello: replication 3 -> 2"], r
    assert await _replication(ep, "cli/hello") == 2
    r = await run("journals", "edit", "--selector", "app=cli", broker=ep, env={"EDITOR": "true"})
    assert r.returncode == 0 and r.stdout == b"no changes\n", r
    broken = {"EDITOR": "sed -i 's/replication: 2/replication: [/'", "TMPDIR": str(tmp_path)}
    r = await run("journals", "edit", "cli/hello", broker=ep, env=broken)
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 2 and "is not valid YAML" in lines[0] and lines[1].startswith("your edit is in "), r
    kept = Path(lines[1].split()[4].rstrip(":"))
    assert kept.parent == tmp_path and "replication: [" in await asyncio.to_thread(kept.read_text)
    r = await run("journals", "edit", "cli/hello", "--selector", "app=cli", broker=ep, env={"EDITOR": "true"})
    assert r.returncode == 2 and b"one of them" in r.stderr
    r = await run("journals", "edit", "cli/hello", broker=ep, env={"EDITOR": "no-such-editor", "VISUAL": ""})
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot run the editor 'no-such-editor'" in lines[0], r
