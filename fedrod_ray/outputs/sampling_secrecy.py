"""Which clients a private round sampled, kept out of what a run records and logs (docs/privacy.md, issue 60).

Client-level DP's epsilon is amplified by the sampling: the accountant assumes that no reader knows which
clients a round drew. A round's record names its failed and unavailable clients, and its virtual clock moves
by the slowest sampled client's duration, which anyone can compute from config.yaml (the speeds are seeded):
each names a sampled client. Under ``privacy.enabled`` those fields are left out of the record and the log
lines say "a sampled client" for a client's id, unless ``privacy.disclose_sampling`` turns them back on, and
then the run's log says that the sampling's amplification no longer holds against their readers.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..config.sections import PrivacyConfig

# A round's fields that name a sampled client, or follow from which clients were sampled beyond their count:
# the virtual clock's round and running total (the slowest sampled client's duration, summed).
SAMPLING_FIELDS = ("failed_ids", "unavailable_ids", "round_virtual_seconds", "virtual_time")
# "client 3", "clients 3, 5" (the round loop's log lines and its RoundFailedError).
_CLIENT_IDS = re.compile(r"\bclient(s?) \d+(?:, \d+)*")


def hides_sampling(privacy: PrivacyConfig) -> bool:
    """True when a run's records and logs must not say which clients a round sampled."""
    return privacy.enabled and not privacy.disclose_sampling


def redact_record(record: dict, privacy: PrivacyConfig) -> dict:
    """``record`` without ``SAMPLING_FIELDS`` when the sampling is hidden; else ``record`` itself."""
    if not hides_sampling(privacy):
        return record
    return {k: v for k, v in record.items() if k not in SAMPLING_FIELDS}


def hide_client_ids(text: str) -> str:
    """``text`` with every "client <id>" / "clients <id>, <id>" said as "a sampled client" / "sampled clients"."""
    return _CLIENT_IDS.sub(lambda m: "sampled clients" if m.group(1) else "a sampled client", text)


def private_text(text: str, privacy: PrivacyConfig) -> str:
    """A log line or error message as a run with ``privacy`` may say it."""
    return hide_client_ids(text) if hides_sampling(privacy) else text


def private_log(log: Callable[[str], None], privacy: PrivacyConfig) -> Callable[[str], None]:
    """``log``, saying no client's id when the sampling is hidden."""
    if not hides_sampling(privacy):
        return log
    return lambda text: log(hide_client_ids(text))


def disclosure_line(privacy: PrivacyConfig) -> str | None:
    """The privacy statement's line for a private run that discloses its sampling (None otherwise)."""
    if not (privacy.enabled and privacy.disclose_sampling):
        return None
    return ("privacy: privacy.disclose_sampling=true: the records and logs name the sampled clients (failed_ids, "
            "unavailable_ids, the virtual clock); the epsilon stated assumes a secret sample and does not hold "
            "against anyone who reads them: to them, the sampling's amplification no longer applies (each round "
            "a client took part in is the Gaussian mechanism unamplified)")
