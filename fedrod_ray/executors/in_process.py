"""The in-process executor: one ``ClientHost`` trains every client, one after another."""

from __future__ import annotations

from ..clients.client import ClientHost
from .base import Executor


class InProcessExecutor(Executor):
    """One ClientHost for every client, trained sequentially in this process."""

    def __init__(self, host: ClientHost):
        self.host = host

    def train(self, round_idx, jobs, message):
        for slot, (cid, state) in enumerate(jobs):
            yield slot, self.host.train(cid, state, message, round_idx)

    def ask(self, round_idx, phase, common, questions):
        return {cid: self.host.answer(cid, phase, common, q, round_idx) for cid, q in questions.items()}

    def evaluate(self, jobs, estimate=False):
        return self.host.evaluate(jobs, estimate)

    def finetune(self, jobs, message, epochs, round_idx):
        return self.host.finetune(jobs, message, epochs, round_idx)

    def zero_shot(self, jobs, message, round_idx):
        return self.host.zero_shot(jobs, message, round_idx)

    def cancel(self) -> None:
        self.host.cancel()
