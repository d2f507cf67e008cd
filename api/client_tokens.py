"""Training clients' credentials: who may have a training client's own personal head (predict's
``client_id``).

A client's head takes no noise, so it is served only to that client, and only when the operator gives the
server a file of token hashes (``--client-tokens``): a JSON object mapping each client id (a decimal
string) to the sha256 hex digest of that client's token. A request proves it is client m by sending
``Authorization: Bearer <token>`` with m's token; the server keeps only the hashes and compares digests in
constant time. The format and how to make tokens: docs/http-api.md; how they are checked: docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path

SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
CLIENT_ID = re.compile(r"^(0|[1-9][0-9]{0,15})$")
# Compared against when a client id has no token, so that the answer takes as long as for one that has.
_NO_TOKEN = bytes(32)


class _Object(list):
    """A JSON object's (key, value) pairs in order: a repeated client id stays visible."""


class ClientTokensError(ValueError):
    """A token file that cannot be used, or one given for a model without per-client heads."""


@dataclass(frozen=True)
class ClientTokens:
    """Each client id's sha256 digest of its token."""

    digests: dict[int, bytes]

    def allows(self, client_id: int, token: str | None) -> bool:
        """Whether ``token`` is ``client_id``'s own. The bytes are the header's as sent (latin-1, as
        Starlette decodes headers); a token of another client, or none, is refused."""
        want = self.digests.get(client_id, _NO_TOKEN)
        given = hashlib.sha256(token.encode("latin-1")).digest() if token else b""
        return hmac.compare_digest(given, want) and client_id in self.digests


def parse(text: str, where: str) -> ClientTokens:
    """The tokens of a file's ``text``; a ClientTokensError naming ``where`` and what is wrong."""
    try:
        doc = json.loads(text, object_pairs_hook=_Object)
    except ValueError as e:
        raise ClientTokensError(f"{where}: not JSON: {e}") from None
    if not isinstance(doc, _Object) or not doc:
        raise ClientTokensError(f"{where}: must be a JSON object mapping client ids to the sha256 hex "
                                f"digests of their tokens, with at least one client")
    digests: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for key, value in doc:
        if not CLIENT_ID.match(key):
            raise ClientTokensError(f"{where}: {key!r} is not a client id (a non-negative integer, as a "
                                    f"string without leading zeros)")
        if not isinstance(value, str) or not SHA256_HEX.match(value):
            raise ClientTokensError(f"{where}: client {key}'s value must be the sha256 hex digest of its "
                                    f"token (64 hex digits), got {str(value)[:80]!r}")
        client, digest = int(key), bytes.fromhex(value)
        if client in digests:
            raise ClientTokensError(f"{where}: client {key} is listed twice")
        if digest in seen:
            raise ClientTokensError(f"{where}: clients {seen[digest]} and {key} have the same token; each "
                                    f"client needs its own")
        digests[client], seen[digest] = digest, client
    return ClientTokens(digests)


def load(path: str | None, head: str) -> ClientTokens | None:
    """The tokens in the file at ``path`` for a model with ``head``; None when ``path`` is None (client
    heads are not served). Only a linear model stores per-client heads: for another the file would do
    nothing, and is refused."""
    if path is None:
        return None
    if head != "linear":
        raise ClientTokensError(f"{path}: the served model has head '{head}', which stores no per-client "
                                f"heads, so client tokens would do nothing")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ClientTokensError(f"{path}: cannot read it: {e}") from None
    return parse(text, path)
