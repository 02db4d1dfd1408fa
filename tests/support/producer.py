"""A transactional producer for the exactly-once end-to-end test (`python -m tests.support.producer`).

It behaves as a consumer shard does (gazette-exactly-once.txt, *Consumer Shard Transaction
Lifecycle*): each transaction publishes messages uncommitted and waits for their appends, then
builds ACK intents, commits a checkpoint (a JSON file replaced atomically: the "store"), and only
then writes the intents. On start it recovers the checkpoint and writes its intents again, which
completes a transaction whose ACKs were lost and rolls back one that was abandoned; it publishes
under a new ProducerID each life, so an abandoned transaction can never be acknowledged later.

`--die-at TXN:POINT` makes it SIGKILL itself once, at POINT of transaction TXN: `mid` (half the
messages written), `checkpointed` (checkpoint committed, ACKs not written) or `acked`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
from pathlib import Path

from tidings.client import AppendService, AsyncClient
from tidings.message import AckIntent, JournalList, Publisher, rendezvous_mapping
from tidings.tasks import dump_tasks_on_sigusr1


def transaction_size(producer: int, txn: int) -> int:
    return random.Random(f"{producer}:{txn}").randint(1, 40)


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"next_txn": 0, "intents": [], "committed": {}, "lives": 0}


def commit(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        json.dump(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def maybe_die(path: Path, plan: set[str], txn: int, point: str) -> None:
    marker = path.with_name(f"{path.name}.died-{txn}-{point}")
    if f"{txn}:{point}" in plan and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


async def run(args: argparse.Namespace) -> None:
    dump_tasks_on_sigusr1()
    logging.getLogger("tidings.client").setLevel(logging.DEBUG)
    state_path = Path(args.state)
    state = load(state_path)
    state["lives"] += 1
    commit(state_path, state)
    plan = set(args.die_at)
    async with AsyncClient(args.broker) as client:

        def channels() -> None:
            for ep, ch in client._channels.items():
                logging.warning("channel %s: %s", ep, ch.get_state())

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, channels)
        journals = await JournalList(client, args.selector).start()
        service = AppendService(client, attempt_timeout=5.0)
        pub = Publisher(service, journals=journals)  # a new ProducerID every life, as a shard gets on recovery
        mapping = rendezvous_mapping(journals, lambda m: f"{m['txn']}:{m['i']}")
        intents = [AckIntent(i["journal"], bytes.fromhex(i["content"])) for i in state["intents"]]
        await (await pub.write_ack_intents(intents))  # recovery: complete or roll back the last transaction
        for txn in range(state["next_txn"], args.txns):
            msgs = [{"p": args.index, "txn": txn, "i": i, "attempt": state["lives"]}
                    for i in range(transaction_size(args.index, txn))]  # fmt: skip
            half = len(msgs) // 2
            await (await pub.publish_uncommitted(mapping, *msgs[:half]))
            maybe_die(state_path, plan, txn, "mid")
            await (await pub.publish_uncommitted(mapping, *msgs[half:]))
            intents = pub.build_ack_intents()
            state.update(
                next_txn=txn + 1,
                intents=[{"journal": i.journal, "content": i.content.hex()} for i in intents],
                committed={**state["committed"], str(txn): state["lives"]},
            )
            commit(state_path, state)
            maybe_die(state_path, plan, txn, "checkpointed")
            await (await pub.write_ack_intents(intents))
            maybe_die(state_path, plan, txn, "acked")
            print(f"TXN {txn}", flush=True)
        await service.aclose()
        await journals.aclose()
    print("DONE", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--selector", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--txns", type=int, required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--die-at", action="append", default=[])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
