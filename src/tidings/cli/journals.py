"""`tidings journals ...`: create, list, append to, read, suspend and prune journals through any broker."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from tidings.cli._common import (
    DEFAULT_BROKER,
    BrokerOpt,
    DeadlineOpt,
    JournalArg,
    Stdin,
    broker_client,
    check_journal_name,
    edit_then_apply,
    editor,
    err,
    group,
    load_yaml,
    out,
    run_async,
    usage,
)
from tidings.protocol import labels
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.specs import documents, format_duration, given, spec_changes, spec_from_dict, spec_to_dict
from tidings.protocol.status import TidingsError

if TYPE_CHECKING:  # (annotations only: a command imports the client, and grpc, once it runs)
    from tidings.client import AppendResult, AsyncClient
    from tidings.message import Garbage

app = group("Create, list, append to and read journals.")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="journals")


@app.command("apply")
def journals_apply(
    file: Path,
    broker: BrokerOpt = DEFAULT_BROKER,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would change; change nothing.")] = False,
) -> None:
    """Create, update or delete journals from a YAML file (every field, with its default: docs/specs.md);
    prints per journal what changed: created, updated (the fields, old -> new), deleted, unchanged."""
    _apply_file(file, broker, dry_run)


def _apply_file(file: Path, broker: str, dry_run: bool = False) -> None:
    docs = documents(load_yaml(file, "journal", "docs/specs.md"))
    specs = [(d, spec_from_dict(d, f"{file.name}[{i}]")) for i, d in enumerate(docs)]
    names = [spec.name for _d, spec in specs]
    if dup := next((n for n in names if names.count(n) > 1), None):
        usage(f"{file} names journal {dup!r} more than once: give each journal once")
    _check_stores(file, specs)

    async def go() -> None:
        async with broker_client(broker) as c:
            current = {j.spec.name: j for j in (await c.list()).journals}
            changes, report = _plan(file, specs, current)
            warnings: list[str] = []
            if changes and not dry_run:
                warnings = list((await c.apply(changes)).warnings)  # (all or nothing: one etcd transaction)
            for line in report:
                out.print(line, highlight=False, soft_wrap=True)
            for w in warnings:
                err.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False, soft_wrap=True)
            if dry_run:
                out.print("dry run: nothing applied", style="bold")

    run_async(go())


def _plan(
    file: Path, specs: list[tuple[dict[str, Any], pb.JournalSpec]], current: dict[str, pb.ListResponse.Journal]
) -> tuple[list[pb.ApplyRequest.Change], list[str]]:
    """The changes a file asks of the journals in etcd, and a line per journal saying what each does."""
    changes, report = [], []
    for d, spec in specs:
        name, cur = spec.name, current.get(spec.name)
        if "revision" in d:
            rev = d["revision"]  # (a whole number: spec_from_dict checked it)
            if cur is None and rev:
                raise TidingsError(
                    f"{file}: journal {name!r} does not exist, but the file expects it at revision {rev}: "
                    "drop `revision` to create it"
                )
        else:
            rev = cur.mod_revision if cur is not None else 0
        if d.get("delete"):
            if cur is None:
                raise TidingsError(f"{file}: journal {name!r} does not exist: there is nothing to delete")
            changes.append(pb.ApplyRequest.Change(delete=name, expect_mod_revision=rev))
            report.append(f"deleted {name}")
            continue
        if cur is None:
            changes.append(pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
            report.append(f"created {name}")
            continue
        if not given(d, "suspend") and cur.spec.HasField("suspend"):
            spec.suspend.CopyFrom(cur.spec.suspend)  # (brokers set it: a file that omits it keeps it)
        changed = spec_changes(cur.spec, spec)
        if not changed:
            report.append(f"unchanged {name}")
            continue
        changes.append(pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=rev))
        report.append(f"updated {name}: " + "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()))
        if reset := [k for k in changed if not given(d, k)]:
            err.print(
                f"[yellow]warning:[/yellow] {escape(name)}: {escape(str(file))} omits {', '.join(reset)}, which "
                "return to their defaults (a spec replaces the whole spec; give them to keep them)",
                highlight=False,
                soft_wrap=True,
            )
    return changes, report


def _check_stores(file: Path, specs: list[tuple[dict[str, Any], pb.JournalSpec]]) -> None:
    """Refuse, before sending anything, a store this machine cannot load (its fsspec backend is missing).

    The brokers check again on Apply; checking here too means `journals read`, which reads persisted
    fragments straight from the store, will work from this machine as well.
    """
    from tidings.fragment.store import check_store_url

    for i, (d, spec) in enumerate(specs):
        if not d.get("delete"):
            for j, url in enumerate(spec.fragment.stores):
                check_store_url(url, f"{file.name}[{i}].fragment.stores[{j}]")


@app.command("delete")
def journals_delete(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
) -> None:
    """Delete a journal's spec, at the revision it has now (its brokers then drop it). Its fragments
    stay in its stores: a journal created again under the name finds them, and its first append
    fails with INDEX_HAS_GREATER_OFFSET until `tidings journals reset-head NAME` (as in Gazette)."""

    async def lookup() -> pb.ListResponse.Journal | None:
        async with broker_client(broker) as c:
            return await c.describe(journal)

    found = run_async(lookup())
    if found is None:
        raise TidingsError(f"journal {journal!r} does not exist: nothing to delete (see `tidings journals list`)")
    if not yes:
        if not sys.stdin.isatty():
            usage(f"deleting journal {journal!r} needs --yes when no terminal can confirm it")
        typer.confirm(f"Delete journal {journal!r} (revision {found.mod_revision})?", abort=True)

    async def delete() -> None:
        async with broker_client(broker) as c:
            await c.apply([pb.ApplyRequest.Change(delete=journal, expect_mod_revision=found.mod_revision)])

    run_async(delete())
    out.print(f"deleted {journal}", highlight=False)


@app.command("edit")
def journals_edit(
    name: Annotated[str, typer.Argument(help="The journal to edit (or --selector).", callback=check_journal_name)] = "",
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Edit every journal it matches, e.g. app=shop.")] = "",
) -> None:
    """Open journal specs in $VISUAL or $EDITOR (as `list --yaml` prints them) and apply what you
    change, each at the revision it was read at (gazctl's edit): a spec changed meanwhile fails the
    whole apply, and your edit is kept in a file to apply again."""
    if bool(name) == bool(selector):
        usage("give a journal NAME or --selector S (one of them)")
    chosen = editor("journals edit")
    wanted = f"name={name}" if name else selector

    async def go() -> pb.ListResponse:
        async with broker_client(broker) as c:
            return await c.list(labels.parse_selector(wanted))

    rows = _rows(run_async(go()), routes=False)
    if not rows:
        raise TidingsError(f"no journal matches {name or selector!r} (see `tidings journals list`)")
    import yaml

    text = yaml.safe_dump({"journals": rows}, sort_keys=False)
    edit_then_apply(text, chosen, lambda path: _apply_file(path, broker), "tidings journals apply")


def _rows(resp: pb.ListResponse, routes: bool = True) -> list[dict[str, Any]]:
    """Journals as `list` prints them: each spec, its revision, and (`routes`) its primary and replicas."""
    rows = []
    for j in resp.journals:
        row = {**spec_to_dict(j.spec), "revision": j.mod_revision}
        if routes:
            members = [f"{m.zone}/{m.suffix}" for m in j.route.members]
            row |= {"primary": members[j.route.primary] if j.route.primary >= 0 else "", "replicas": members}
        rows.append(row)
    return rows


@app.command("list")
def journals_list(
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Label selector, e.g. app=shop,!tmp")] = "",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    as_yaml: Annotated[bool, typer.Option("--yaml")] = False,
) -> None:
    """List journals with their routes."""

    async def go() -> pb.ListResponse:
        async with broker_client(broker) as c:
            return await c.list(labels.parse_selector(selector) if selector else None)

    rows = _rows(run_async(go()))
    if as_json:
        for row in rows:
            print(json.dumps(row))
    elif as_yaml:
        import yaml

        print(yaml.safe_dump({"journals": rows}, sort_keys=False))
    else:
        from rich.table import Table

        t = Table("name", "R", "primary", "replicas", "labels", "revision")
        for row in rows:
            values = row["labels"].items()
            lbls = ",".join(f"{k}={one}" for k, v in values for one in (v if isinstance(v, list) else [v]))
            t.add_row(
                row["name"],
                str(row["replication"]),
                row["primary"],
                " ".join(row["replicas"]),
                lbls,
                str(row["revision"]),
            )
        out.print(t)


@app.command("append")
def journals_append(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    file: Annotated[Path | None, typer.Option(help="Read content from FILE instead of stdin.")] = None,
    offset: Annotated[int, typer.Option(help="Expected write head (0: any).")] = 0,
    deadline: DeadlineOpt = 30.0,
) -> None:
    """Append stdin (or --file) atomically; print the committed span as JSON. Transient failures are
    retried for up to --deadline seconds, never twice into the journal: a zero-byte append first
    takes the write head, and after an answer lost in transport (or not come within the deadline)
    another one tells whether the content landed there."""
    if file is not None and not file.is_file():
        usage(f"--file {str(file)!r} is not a file: give the path of a file to append, or pipe to stdin")

    async def go() -> AppendResult:
        from tidings.protocol.status import WrongAppendOffsetError

        src = _Content.of_file(file) if file else await _Content.of_stdin()
        async with broker_client(broker, deadline) as c:
            # An attempt whose answer does not come is a failure too: within the deadline, and a second per MiB.
            most = c.attempt_timeout
            wait = (min(most, max(deadline, 2.0)) if deadline else most) + src.size / (1 << 20)
            try:  # (refusals, which leave nothing written, are retried by the client until the deadline)
                return await c.append_once(journal, src.chunks, src.size, offset=offset, timeout=wait)
            except WrongAppendOffsetError:
                if not offset:
                    raise  # (refused at the head itself: the broker's reason says why)
                raise TidingsError(
                    f"journal {journal!r}: --offset {offset} is not its write head {await c.write_head(journal)}: "
                    "nothing was appended; append at that --offset, or 0 for wherever the head is"
                ) from None

    print(json.dumps(run_async(go()).to_json()))


class _Content:
    """What `journals append` sends: a file it reads again for each attempt, from `start`, `size` bytes
    (stdin from a pipe or a terminal is first kept in a temporary file, read by a thread so that
    Ctrl-C stops it at once; nothing is appended before stdin ends, as an append is all or nothing).
    Not the AppendService, which finds a lost batch the same way: it takes content as bytes in
    memory, and a file to append may be larger than memory."""

    def __init__(self, fd: int, start: int, size: int, keep: Any = None) -> None:
        self.fd, self.start, self.size, self._keep = fd, start, size, keep

    @classmethod
    def of_file(cls, path: Path) -> _Content:
        f = open(path, "rb")
        return cls(f.fileno(), 0, os.fstat(f.fileno()).st_size, f)

    @classmethod
    async def of_stdin(cls) -> _Content:
        import asyncio
        import stat
        import tempfile

        fd = sys.stdin.fileno()
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):  # `< file`: read it in place
            start = os.lseek(fd, 0, os.SEEK_CUR)
            return cls(fd, start, info.st_size - start)
        spool = tempfile.TemporaryFile(prefix="tidings-append-")
        stdin, size = Stdin(lines=False, slots=64), 0
        try:
            while (chunk := await stdin.get()) is not None:
                await asyncio.to_thread(spool.write, chunk)
                size += len(chunk)
        finally:
            stdin.stop()
        spool.flush()
        return cls(spool.fileno(), 0, size, spool)

    def chunks(self) -> Iterator[bytes]:  # a fresh read of the content, for one attempt
        at, end = self.start, self.start + self.size
        while at < end:
            chunk = os.pread(self.fd, min(256 * 1024, end - at), at)
            if not chunk:
                raise TidingsError(f"the content to append shrank while it was read ({at - self.start} of {self.size} "
                                   "bytes): nothing was appended")  # fmt: skip
            at += len(chunk)
            yield chunk


@app.command("read")
def journals_read(
    journal: JournalArg,
    broker: BrokerOpt = DEFAULT_BROKER,
    offset: Annotated[int, typer.Option(help="Start offset; -1 is the write head.")] = 0,
    block: Annotated[bool, typer.Option(help="Wait for and tail new content.")] = False,
    end_offset: Annotated[int, typer.Option(help="Stop at this offset (0: none).")] = 0,
    committed: Annotated[
        bool, typer.Option(help="Decode messages and print each committed one once, as a JSON line.")
    ] = False,
    with_offsets: Annotated[
        bool, typer.Option(help='With --committed: print {"offset": N, "message": ...} per message.')
    ] = False,
    max_messages: Annotated[int, typer.Option(help="With --committed: stop after this many (0: no limit).")] = 0,
) -> None:
    """Write the journal's committed bytes to stdout (or, with --committed, its committed messages)
    from --offset to --end-offset (the write head unless --block)."""
    if offset < -1:
        usage(f"--offset {offset}: give 0 or more, or -1 for the write head")
    if end_offset < 0:
        usage(f"--end-offset {end_offset}: give 0 or more (0 for none)")
    if 0 < end_offset < offset:
        usage(f"--end-offset {end_offset} is before --offset {offset}: give one after it, or 0 for none")
    if max_messages < 0:
        usage(f"--max-messages {max_messages}: give 0 or more (0 for no limit)")
    if (with_offsets or max_messages) and not committed:
        usage("--with-offsets and --max-messages go with --committed")

    def jumped(j: str, begin: int, end: int) -> None:
        err.print(f"{j} holds no bytes [{begin}, {end}) any more (removed by retention?): reading on at {end}",
                  highlight=False)  # fmt: skip

    async def raw(c: AsyncClient) -> None:
        on_jump = functools.partial(jumped, journal)
        async for chunk in c.reader(journal, offset, block=block, end_offset=end_offset, on_jump=on_jump):
            sys.stdout.buffer.write(chunk.content)

    async def messages(c: AsyncClient, head: int) -> None:
        import msgspec

        from tidings.message import read_committed

        def garbage(j: str, g: Garbage) -> None:
            if 0 < end_offset <= g.end:  # (the range is bytes: a message it ends inside is cut, not bad)
                err.print(f"--end-offset {end_offset} cuts the message at offset {g.begin}: not printed; end the "
                          "range at a message's end (the next one's offset)", highlight=False)  # fmt: skip
                return
            err.print(f"skipped undecodable bytes of {j} at [{g.begin}, {g.end}): {g.error}", highlight=False)

        encode, n = msgspec.json.Encoder().encode, 0
        start = offset if offset >= 0 else head
        reader = read_committed(
            c,
            journal,
            block=block,
            on_garbage=garbage,
            on_jump=jumped,
            offsets={journal: start},
            end_offsets={journal: end_offset},
        )
        async for env in reader:
            line = {"offset": env.begin, "message": env.message} if with_offsets else env.message
            sys.stdout.buffer.write(encode(line) + b"\n")
            n += 1
            if n == max_messages:
                break

    async def go() -> None:
        async with broker_client(broker) as c:
            head = await c.write_head(journal) if offset < 0 or not block else 0
            if not block and offset > head:
                usage(f"--offset {offset} is past the write head {head} of {journal!r}: give one at or below it, "
                      "or --block to wait for it")  # fmt: skip
            await (messages(c, head) if committed else raw(c))
        sys.stdout.buffer.flush()

    try:
        run_async(go())
    except BrokenPipeError:
        os._exit(0)


@app.command("suspend")
def journals_suspend(
    name: Annotated[
        str, typer.Argument(help="The journal to suspend (or --selector).", callback=check_journal_name)
    ] = "",
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Suspend every journal it matches, e.g. app=shop.")] = "",
    force: Annotated[
        bool, typer.Option("--force", help="Suspend even journals with content not yet persisted, or recent.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Suspend idle journals (gazctl's journals suspend): one holding nothing keeps no replica at all,
    others one replica serving reads; either costs no pipeline and no pulse. A journal is idle when
    everything it holds is persisted and its last fragment is older than its flush interval (24h
    without one); --force suspends it anyway. Its next append resumes it."""
    if bool(name) == bool(selector):
        usage("give a journal NAME or --selector S (one of them)")

    async def go() -> None:
        async with broker_client(broker) as c:
            listed = await c.list(labels.parse_selector(selector or f"name={name}"))
            if not listed.journals:
                what = f"journal {name!r} does not exist" if name else f"no journal matches --selector {selector!r}"
                raise TidingsError(f"{what} (see `tidings journals list`)")
            for j in listed.journals:
                done = await c.suspend(j.spec.name, force)
                level = ""
                if done:
                    after = await c.describe(j.spec.name)
                    spec = after.spec if after is not None else j.spec
                    level = pb.JournalSpec.Suspend.Level.Name(spec.suspend.level).lower()
                if as_json:
                    print(json.dumps({"journal": j.spec.name, "suspended": done, "level": level}), flush=True)
                elif done:
                    print(f"{j.spec.name}: suspended ({level})", flush=True)
                else:
                    print(f"{j.spec.name}: not suspended: it holds content not yet persisted, or persisted within "
                          "its flush interval (--force to suspend it anyway)", flush=True)  # fmt: skip

    run_async(go())


@app.command("prune")
def journals_prune(
    broker: BrokerOpt = DEFAULT_BROKER,
    selector: Annotated[str, typer.Option(help="Prune the journals it matches, e.g. app=shop (default: all).")] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove the persisted fragments each journal's fragment.retention lets go (gazctl's prune), from
    its stores, reached from here. Only the oldest go, in offset order, so a journal never gets a hole
    in its middle: it starts later, and readers of a removed offset jump to its first byte. Brokers do
    this themselves every --prune-interval."""
    import asyncio

    from tidings.fragment import retention
    from tidings.fragment.fragment import Fragment

    async def go() -> None:
        async with broker_client(broker) as c:
            resp = await c.list(labels.parse_selector(selector) if selector else None)
            if not resp.journals:
                raise TidingsError(f"no journal matches --selector {selector!r} (see `tidings journals list`)")
            now = time.time()
            for j in resp.journals:
                name, retention_ms = j.spec.name, j.spec.fragment.retention_ms
                listed = await c.fragments(name)
                held = [Fragment.from_proto(e.spec) for e in listed.fragments]
                plan = retention.plan(name, held, retention_ms / 1000, now)
                if plan.aged and not dry_run:
                    try:
                        await asyncio.to_thread(retention.remove, plan.aged)
                    except Exception as exc:
                        raise TidingsError(f"removing fragments of {name!r} from its store failed: {exc}") from None
                row = {"journal": name, "retention": format_duration(retention_ms), "removed": len(plan.aged),
                       "removed_bytes": plan.aged_bytes, "kept": len(plan.kept), "kept_bytes": plan.kept_bytes,
                       "begin": plan.begin, "dry_run": dry_run}  # fmt: skip
                print(json.dumps(row) if as_json else _prune_line(row), flush=True)

    run_async(go())


def _prune_line(row: dict[str, Any]) -> str:
    name, kept = row["journal"], f"kept {row['kept']} ({row['kept_bytes']} bytes)"
    if row["retention"] == "0s":
        return f"{name}: retention 0s (keep for ever): {kept}"
    verb = "would remove" if row["dry_run"] else "removed"
    return (f"{name}: {verb} {row['removed']} fragments ({row['removed_bytes']} bytes) older than "
            f"{row['retention']}; {kept}; it starts at offset {row['begin']}")  # fmt: skip


@app.command("head")
def journals_head(
    journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Print the journal's write head: the offset its next append lands at."""

    async def go() -> int:
        async with broker_client(broker) as c:
            return await c.write_head(journal)

    head = run_async(go())
    print(json.dumps({"journal": journal, "head": head}) if as_json else head)


@app.command("fragments")
def journals_fragments(
    journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """List the journal's fragments (local spools and persisted files)."""
    from tidings.fragment.fragment import Fragment

    async def go() -> pb.FragmentsResponse:
        async with broker_client(broker) as c:
            return await c.fragments(journal)

    resp = run_async(go())
    from rich.table import Table

    t = Table("begin", "end", "sha1", "store", "url")
    for e in resp.fragments:
        f = Fragment.from_proto(e.spec)
        row = {"begin": f.begin, "end": f.end, "sum": f.sum.hex(), "store": f.backing_store, "url": e.url}
        if as_json:
            print(json.dumps(row))
        else:
            t.add_row(str(f.begin), str(f.end), f.sum.hex()[:12], f.backing_store or "(local)", e.url)
    if not as_json:
        out.print(t)


@app.command("reset-head")
def journals_reset_head(journal: JournalArg, broker: BrokerOpt = DEFAULT_BROKER) -> None:
    """Confirm that every earlier broker is gone: let appends continue at the fragment index's end.

    Needed after INDEX_HAS_GREATER_OFFSET. It issues a zero-byte append whose expected offset is
    the largest offset of the journal's fragment index."""

    async def go() -> AppendResult | None:
        async with broker_client(broker) as c:
            frags = await c.fragments(journal)
            end = max((e.spec.end for e in frags.fragments), default=0)
            return await c.append(journal, b"", offset=end) if end else None

    result = run_async(go())
    print(json.dumps({"journal": journal, "write_head": result.end if result else 0}))
