"""Request fields that no request struct declares: warned about once per name, counted every time.

OpenAI clients send fields of newer API versions and of other servers; refusing every one would break them, and
ignoring them in silence hides a client that asked for something metrale never did (`max_new_tokens: 40` gave
16 tokens). So, as vLLM does, each unknown top-level field name is logged with a warning the first time it is
seen, and every request field that is unknown is counted in `metrale_request_unknown_fields_total` (no
per-field label: a client chooses the names, so a label would let it grow the series without bound). The names
remembered for the once-only warning are capped at MAX_REMEMBERED; past the cap one more warning says so and new
names are only counted. Names that are known mistakes for a field metrale has (HF's `max_new_tokens`) are refused
with a 400 by metrale.server.refusals.refuse_aliases, after they are counted here.
"""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import CollectorRegistry, Counter, generate_latest

from metrale.server import refusals
from metrale.server.errors import from_decode_error

logger = logging.getLogger(__name__)
MAX_REMEMBERED = 256  # distinct names warned about; bounds the memory a stream of made-up names can take
MAX_NAME_CHARS = 64  # of a name as it appears in the log


def unknown_names(body: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of a JSON object body (already decoded as `kind`) that `kind` does not declare."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])  # values are not parsed again
    except msgspec.DecodeError as error:  # e.g. a key that is not UTF-8, which the struct skipped unread
        raise from_decode_error(error) from error
    declared = set(kind.__struct_fields__)
    return [key for key in keys if key not in declared]


class UnknownFields:
    """One server's record of unknown request fields: a once-per-name warning and a counter (its own registry,
    exposed on /metrics after the engine's series)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._counter = Counter("metrale_request_unknown_fields", "Request fields no request type declares "
                                "(ignored; each name is logged once with a warning).", ["model_name"],
                                registry=self.registry).labels(model_name)
        self._warned: set[str] = set()
        self._cap_reported = False

    def check(self, body: bytes, kind: type[msgspec.Struct], endpoint: str) -> None:
        """Count and warn about the unknown fields of a body decoded as `kind`; a 400 (refusals.ALIASES) when one
        is another server's name for a field metrale has."""
        names = unknown_names(body, kind)
        self.note(names, endpoint)
        refusals.refuse_aliases(names)

    def note(self, names: list[str], endpoint: str) -> None:
        """Count `names` (unknown fields of one request to `endpoint`) and warn about the new ones."""
        if not names:
            return
        self._counter.inc(len(names))
        for name in names:
            if name in refusals.ALIASES:
                continue  # refused with a 400 that names it: the client is told, the log need not be
            shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."  # what is remembered
            if shown in self._warned:
                continue
            if len(self._warned) >= MAX_REMEMBERED:
                if not self._cap_reported:
                    self._cap_reported = True
                    logger.warning("more than %d distinct unknown request fields: new ones are counted in "
                                   "metrale_request_unknown_fields_total but no longer logged", MAX_REMEMBERED)
                return
            self._warned.add(shown)
            logger.warning("%s: request field %r is not known to metrale and is ignored (logged once per field "
                           "name)", endpoint, shown)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
