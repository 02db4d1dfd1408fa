"""`tidings publish`: JSON lines from stdin as committed messages (tidings.message.LinePublisher)."""

from __future__ import annotations

from typing import Annotated

import typer

from tidings.cli._common import (
    DEFAULT_BROKER,
    BrokerOpt,
    DeadlineOpt,
    Stdin,
    at_least,
    broker_client,
    check_journal_name,
    err,
    plural,
    run_async,
    usage,
)
from tidings.protocol.status import TidingsError


def register(root: typer.Typer) -> None:
    root.command()(publish)


def publish(
    target: Annotated[str, typer.Argument(help="A journal name, or a label selector such as topic=clicks.")],
    broker: BrokerOpt = DEFAULT_BROKER,
    key: Annotated[
        str, typer.Option(help="With a selector: pick each message's journal by this field (rendezvous hashing).")
    ] = "",
    skip_invalid: Annotated[
        bool, typer.Option(help="Report a line that is no JSON object (or lacks --key) and go on, instead of stopping.")
    ] = False,
    flush_interval: Annotated[
        float,
        typer.Option(
            help="Seconds a line may wait for others to share its append (at most 1000 a batch).",
            callback=at_least("--flush-interval", 0),
        ),
    ] = 0.05,
    retry_deadline: DeadlineOpt = 30.0,
) -> None:
    """Publish JSON lines from stdin as committed messages (each gets a sequencing UUID), as they
    come: `tail -f log | tidings publish j` commits each line within about --flush-interval. A line
    that already has a "uuid" field is refused: the publisher sets every message's UUID. Transient
    failures are retried for up to --deadline seconds (each batch lands once: after an answer lost
    in transport the journal is searched for it before a retry)."""
    from tidings.client import AppendService
    from tidings.message import JournalList, LinePublisher, Mapping, Publisher, random_mapping, rendezvous_mapping

    is_selector = "=" in target or target.startswith("!")
    if not is_selector:
        check_journal_name(target)
    if key and not is_selector:
        usage(f"--key picks a journal among those a selector matches; {target!r} names one journal: drop --key")
    publishing: LinePublisher | None = None

    async def go() -> None:
        nonlocal publishing
        lines = Stdin()
        async with broker_client(broker, retry_deadline) as c:
            if not is_selector and await c.describe(target) is None:
                raise TidingsError(f"journal {target!r} does not exist: nothing was published; check the name with "
                                   "`tidings journals list`, or create it with `tidings journals apply`")  # fmt: skip
            journals = await JournalList(c, target).start() if is_selector else None
            mapping: Mapping | str = target
            if journals is not None:
                if not journals.names:
                    raise TidingsError(f"no journal matches the selector {target!r}; see `tidings journals list`")
                mapping = rendezvous_mapping(journals, lambda m: str(m.get(key))) if key else random_mapping(journals)
            publishing = LinePublisher(
                Publisher(AppendService(c), journals=journals),
                mapping,
                key=key,
                skip_invalid=skip_invalid,
                flush_interval=flush_interval,
                on_skipped=lambda said: err.print(f"skipped {said}", highlight=False),
            )
            try:
                await publishing.run(lines.get)
            finally:
                lines.stop()
                if journals is not None:
                    await journals.aclose()

    try:
        run_async(go())
    except KeyboardInterrupt:
        said = publishing.so_far() if publishing else "published 0 messages (no stdin line)"
        err.print(f"interrupted: {said}", highlight=False)
        raise typer.Exit(130) from None
    assert publishing is not None
    written = ", ".join(sorted(publishing.written)) or "no journal"
    err.print(f"published {plural(publishing.sent, 'message')} to {written}", highlight=False)
