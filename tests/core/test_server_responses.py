"""Laws of the response machine (``genworker.core.server_responses.Reply``): whatever way
vLLM cuts its body, the client gets the same bytes with the weight versions added, every
streamed event tagged once and whole, and routed experts dropped from a held body."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from genworker.core.asgi_messages import Message, field_of, headers_of
from genworker.core.server_responses import VERSIONS_HEADER, Reply
from genworker.core.serving import ROUTES_CHOICE_FIELD, drop_routes, tag_events

JSON = [(b"content-type", b"application/json"), (b"content-length", b"5")]
SSE = [(b"Content-Type", b"text/event-stream; charset=utf-8")]


def start(headers: list[tuple[bytes, bytes]]) -> Message:
    return {"type": "http.response.start", "status": 200, "headers": list(headers)}


def chunked(body: bytes, cuts: list[int]) -> list[Message]:
    """``body`` as body messages cut at ``cuts`` (the last ends the body)."""
    points = sorted({0, *(c % (len(body) + 1) for c in cuts), len(body)})
    parts = [body[a:b] for a, b in itertools.pairwise(points)] or [b""]
    return [
        {"type": "http.response.body", "body": part, "more_body": k < len(parts) - 1}
        for k, part in enumerate(parts)
    ]


def run(reply: Reply, messages: list[Message], versions: list[int]) -> list[Message]:
    """The messages sent on, message ``k`` passing at ``versions[k]`` (else the last)."""
    sent: list[Message] = []
    for k, message in enumerate(messages):
        reply, out = reply.take(message, versions[min(k, len(versions) - 1)])
        sent.extend(out)
    assert (reply.pending, reply.held) == (b"", None)  # nothing left behind
    return sent


def body_of(sent: list[Message]) -> bytes:
    return b"".join(field_of(m, "body", bytes, b"") for m in sent[1:])


def versions_header(message: Message) -> bytes:
    return dict(headers_of(message))[VERSIONS_HEADER.encode()]


@given(st.binary(max_size=30), st.lists(st.integers(0, 40), max_size=4), st.integers(0, 3))
def test_a_json_response_goes_as_it_came_with_the_versions_header(
    body: bytes, cuts: list[int], later: int
) -> None:
    messages = [start(JSON), *chunked(body, cuts)]
    sent = run(Reply(2), messages, [2 + later])
    assert versions_header(sent[0]) == ",".join(map(str, range(2, 3 + later))).encode()
    assert headers_of(sent[0])[:2] == JSON
    assert sent[1:] == messages[1:]


@given(st.lists(st.sampled_from(['{"text": "data: {x\\n"}', "[DONE]", "{bad", '{"k": 1}']), max_size=5),
       st.lists(st.integers(0, 80), max_size=6))  # fmt: skip
def test_every_streamed_event_is_tagged_once_and_whole_however_it_is_cut(
    datas: list[str], cuts: list[int]
) -> None:
    events = b"".join(b"data: " + d.encode() + b"\n\n" for d in datas)
    sent = run(Reply(1, strip_routes=True), [start(SSE), *chunked(events, cuts)], [3])
    assert versions_header(sent[0]) == b"1,2,3"
    assert body_of(sent) == tag_events(events, (1, 2, 3))
    assert all(field_of(m, "body", bytes).endswith(b"\n\n") for m in sent[1:-1])
    assert sent[-1]["more_body"] is False


def test_each_streamed_event_carries_the_versions_up_to_its_passing() -> None:
    events = [b'data: {"k": 1}\n\ndata: {"k"', b": 2", b"}\n\n", b""]
    messages = [start(SSE)] + [
        {"type": "http.response.body", "body": e, "more_body": k < 3} for k, e in enumerate(events)
    ]
    sent = run(Reply(0), messages, [0, 0, 1, 1, 1])
    tagged = [json.loads(line[len(b"data: ") :]) for line in body_of(sent).split(b"\n\n") if line]
    assert tagged == [{"weight_versions": [0], "k": 1}, {"weight_versions": [0, 1], "k": 2}]
    # nothing went out for the chunk without a whole event; the stream's end always does
    assert [m["more_body"] for m in sent[1:]] == [True, True, False]


@given(
    st.lists(st.booleans(), min_size=1, max_size=3),
    st.lists(st.integers(0, 200), max_size=4),
    st.booleans(),
)
def test_a_held_body_loses_its_routes_and_gets_its_own_length(
    routed: list[bool], cuts: list[int], strip: bool
) -> None:
    choices = [{"text": "é", **({ROUTES_CHOICE_FIELD: "AAA"} if r else {})} for r in routed]
    body = json.dumps({"choices": choices}).encode()
    messages = [start(JSON), *chunked(body, cuts)]
    sent = run(Reply(4, strip_routes=strip), messages, [4])
    if not strip:
        assert sent[1:] == messages[1:]
        return
    assert len(sent) == 2  # the start, held until the body was whole, then the body
    whole = drop_routes(body)
    assert field_of(sent[1], "body", bytes) == whole
    headers = headers_of(sent[0])
    assert headers == [
        (b"content-type", b"application/json"),
        (VERSIONS_HEADER.encode(), b"4"),
        (b"content-length", str(len(whole)).encode()),
    ]


def test_other_messages_pass_unchanged() -> None:
    trailers: Message = {"type": "http.response.trailers", "headers": []}
    reply = Reply(0)
    assert reply.take(trailers, 0) == (reply, (trailers,))
