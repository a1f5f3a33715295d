"""The response to one generation request of the OpenAI server: what the layer does to
vLLM's ASGI messages on their way to the client.

Theory of operation
-------------------
:class:`Reply` is a machine in the manner of h11: the shell hands it each message vLLM
sends, with the worker's weight version as that message passes, and sends on the
messages it returns (none, one, or a held start and its body).

- **Weight versions** (:func:`~genworker.core.serving.versions_between`): from the
  version at the request's arrival (:attr:`Reply.first`) to the one as the message
  passes. The response's start gets the header :data:`VERSIONS_HEADER` (comma-separated);
  a streamed response's (``text/event-stream``) body is cut into whole server-sent events
  (:func:`~genworker.core.serving.split_events`: an event split across chunks waits for
  its end) and every event carries a ``weight_versions`` field up to it
  (:func:`~genworker.core.serving.tag_events`).
- **Routed experts** (:func:`~genworker.core.serving.drop_routes`): with
  :attr:`Reply.strip_routes` a non-streamed body loses its choices' routed experts; the
  start is held until the body is whole and goes out with the new ``content-length``
  right before it (a JSON response's start and body come back to back, with no await
  between them in the shell: no cancellation lands between).
"""

from __future__ import annotations

from typing import Final

import attrs

from genworker.core.asgi_messages import Message, field_of, headers_of
from genworker.core.serving import drop_routes, split_events, tag_events, versions_between

__all__ = ["VERSIONS_HEADER", "Reply", "Sent"]

VERSIONS_HEADER: Final = "x-genworker-weight-versions"
_VERSIONS_KEY: Final = VERSIONS_HEADER.encode()
Sent = tuple[Message, ...]
"""The messages to send on for one of vLLM's, in order."""


@attrs.frozen
class Reply:
    """How far one response got (see the module docstring): ``stream`` once its start
    says ``text/event-stream``, the body bytes ``pending`` (a streamed event not yet
    whole, or a body whose routes are to be dropped) and the start ``held`` meanwhile."""

    first: int
    strip_routes: bool = False
    stream: bool = False
    pending: bytes = b""
    held: Message | None = None

    def take(self, message: Message, version: int) -> tuple[Reply, Sent]:
        """This reply after vLLM's ``message``, sent at weight ``version``, and the
        messages to send on."""
        if message["type"] == "http.response.start":
            headers = headers_of(message)
            stream = any(
                v.startswith(b"text/event-stream") and k.lower() == b"content-type"
                for k, v in headers
            )
            versions = versions_between(self.first, version)
            headers.append((_VERSIONS_KEY, ",".join(map(str, versions)).encode()))
            start: Message = {**message, "headers": headers}
            if self.strip_routes and not stream:
                return attrs.evolve(self, held=start), ()
            return (attrs.evolve(self, stream=True) if stream else self), (start,)
        if message["type"] == "http.response.body" and self.held is not None:
            pending = self.pending + field_of(message, "body", bytes, b"")
            if message.get("more_body", False):
                return attrs.evolve(self, pending=pending), ()
            body = drop_routes(pending)
            length = (b"content-length", str(len(body)).encode())
            kept = [(k, v) for k, v in headers_of(self.held) if k.lower() != b"content-length"]
            whole: Sent = (
                {**self.held, "headers": [*kept, length]},
                {**message, "body": body},
            )
            return attrs.evolve(self, pending=b"", held=None), whole
        if message["type"] == "http.response.body" and self.stream:
            buffer = self.pending + field_of(message, "body", bytes, b"")
            events, rest = split_events(buffer, bool(message.get("more_body", False)))
            moved = attrs.evolve(self, pending=rest)
            if events is None:
                return moved, ()
            tagged = tag_events(events, versions_between(self.first, version))
            return moved, ({**message, "body": tagged},)
        return self, (message,)
