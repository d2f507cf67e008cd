"""The ServerApp of bench/flower_deploy.py (copied into the Flower app it builds; not part of the library):
fedrod-ray's own (``fedrod_ray_flower.server_app``), whose grid writes what each exchange with the SuperNodes
carried to the run config's ``wire-log``, one JSON line per exchange.

A message's bytes are those Flower ships: each of its objects (the message, its records, their arrays)
deflated, which the ServerApp pushes to the SuperLink and the SuperLink relays to the SuperNode, and back for a
reply. An exchange belongs to the round in progress: one more than the records in ``run-dir``'s metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedrod_ray_flower import server_app
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def message_bytes(message: Message) -> int:
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


class CountingGrid:
    """``grid``, counting each ``send_and_receive``'s messages and replies into ``log``."""

    def __init__(self, grid: Grid, log: Path, run_dir: Path):
        self.grid, self.log, self.metrics = grid, log, run_dir / "metrics.jsonl"

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *args, **kwargs):
        messages = list(messages)
        sent = sum(message_bytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages, *args, **kwargs))
        done = len(self.metrics.read_text().splitlines()) if self.metrics.is_file() else 0
        line = {"round": done + 1, "types": sorted({m.metadata.message_type for m in messages}),
                "messages": len(messages), "sent": sent, "received": sum(message_bytes(r) for r in replies)}
        with self.log.open("a") as out:
            out.write(json.dumps(line) + "\n")
        return replies


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    server_app.main(CountingGrid(grid, Path(str(rc["wire-log"])), Path(str(rc["run-dir"]))), context)
