"""Server-sent events as the benchmark clients read them: the ``data:`` payloads of a stream.

SGLang's ``/generate`` and the OpenAI routes stream lines ``data: {json}`` separated by blank
lines and end with ``data: [DONE]``. ``data_payloads`` yields each payload (the bytes after
``data:``, stripped) in order and ``None`` for ``[DONE]``, after which it stops; every other
line (blank separators, comments) is skipped. Each client keeps what it records of the events
(``soak_client``: result and finish reason; ``e2e.load``: first-event and end times;
``e2e.chat_burst``: content chunks inside a time window).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

DONE = None


def data_payloads(lines: Iterable[bytes]) -> Iterator[bytes | None]:
    """The payloads of ``lines`` (a response read line by line); ``DONE`` (None) ends the stream."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            yield DONE
            return
        yield payload
