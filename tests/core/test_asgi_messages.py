"""Laws of the ASGI messages the server's layer reads and writes
(``genworker.core.asgi_messages``): fields and headers typed as the spec types them, JSON
answers that round-trip, and the in-process request to one of vLLM's routes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import json_values

from genworker.core.asgi_messages import (
    GENERATE_PATHS,
    content_length,
    field_of,
    generation_route,
    headers_of,
    inner_request,
    json_answer,
    json_response,
    refusal,
    refusal_response,
    routed,
)
from genworker.core.serving import BadRequest, error_body

statuses = st.integers(100, 599)


def test_only_a_post_to_a_generation_path_is_a_generation_and_says_whether_it_is_chat() -> None:
    assert generation_route({"method": "POST", "path": "/v1/chat/completions"}) is True
    assert generation_route({"method": "POST", "path": "/v1/completions"}) is False
    assert set(GENERATE_PATHS) == {"/v1/completions", "/v1/chat/completions"}
    for scope in (
        {"method": "GET", "path": "/v1/completions"},
        {"method": "POST", "path": "/v1/models"},
        {"method": "POST", "path": b"/v1/completions"},
        {"method": "POST"},
    ):
        assert generation_route(scope) is None


def test_a_routed_request_names_its_route_and_its_query_the_last_value_winning() -> None:
    routes = {("POST", "/pause"): "pause", ("GET", "/is_paused"): "is_paused"}
    query = b"mode=keep&x=&mode=w%C3%A9&raw=\xe9"
    scope = {"method": "POST", "path": "/pause", "query_string": query}
    # as Starlette reads it: the bytes as latin-1, each escape as UTF-8
    assert routed(scope, routes) == ("pause", {"mode": "wé", "x": "", "raw": "é"})
    assert routed({**scope, "method": "GET"}, routes) is None
    assert routed({"method": "GET", "path": "/is_paused", "query_string": b""}, routes) == (
        "is_paused",
        {},
    )
    assert routed({"method": "GET"}, routes) is None  # no path: no route


def test_a_field_is_read_as_its_type_with_a_default_where_absent() -> None:
    message = {"type": "http.request", "body": b"x"}
    assert field_of(message, "body", bytes, b"") == b"x"
    assert field_of({"type": "http.request"}, "body", bytes, b"") == b""
    with pytest.raises(KeyError):
        field_of({"type": "http.request"}, "body", bytes)
    with pytest.raises(TypeError, match=r"'http\.request': body is a str, not bytes"):
        field_of({"type": "http.request", "body": "x"}, "body", bytes, b"")


def test_headers_are_pairs_of_byte_strings_or_a_type_error() -> None:
    pairs = [(b"a", b"1"), (b"B", b"2")]
    assert headers_of({"headers": pairs}) == pairs
    assert headers_of({"headers": tuple(pairs)}) == pairs  # any iterable, as the spec says
    assert headers_of({}) == []
    with pytest.raises(TypeError, match="headers is a int"):
        headers_of({"type": "http", "headers": 3})
    with pytest.raises(TypeError, match="a header is not two byte strings"):
        headers_of({"type": "http", "headers": [("a", b"1")]})


@given(st.integers(0, 2**40), st.sampled_from([b"content-length", b"Content-Length"]))
def test_a_declared_content_length_is_read_whatever_its_case(length: int, name: bytes) -> None:
    scope = {"headers": [(b"host", b"h"), (name, str(length).encode())]}
    assert content_length(scope) == length


def test_no_content_length_or_a_bad_one_is_none() -> None:
    assert content_length({"headers": [(b"host", b"h")]}) is None
    assert content_length({"headers": [(b"content-length", b"x")]}) is None


@given(statuses, json_values, st.booleans())
def test_a_json_response_round_trips_with_its_length(
    status: int, answer: object, close: bool
) -> None:
    start, body = json_response(status, answer, close=close)
    headers = dict(headers_of(start))
    assert (start["type"], start["status"]) == ("http.response.start", status)
    assert (body["type"], body["more_body"]) == ("http.response.body", False)
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(field_of(body, "body", bytes))
    assert (headers.get(b"connection") == b"close") is close
    assert json_answer([start, body]) == (status, answer)


@pytest.mark.parametrize("status", [400, 408, 409, 413, 500, 503])
def test_a_refusal_is_an_openai_error_and_closes_the_connection_after_408_or_413(
    status: int,
) -> None:
    problem = BadRequest("no", status=status, param="p")
    assert refusal(problem) == (status, error_body(status, "no", "p"))
    start, body = refusal_response(problem)
    assert json_answer([start, body]) == refusal(problem)
    closes = (b"connection", b"close") in headers_of(start)
    assert closes is (status in (408, 413))


@given(st.sampled_from(["/tokenize", "/detokenize"]), json_values)
def test_an_inner_request_keeps_the_scope_and_replaces_path_query_and_headers(
    path: str, value: object
) -> None:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"a=1",
        "headers": [(b"authorization", b"secret"), (b"content-length", b"99")],
        "state": {"kept": True},
    }
    payload = {"prompt": value}
    sub, data = inner_request(scope, path, payload)
    assert json.loads(data) == payload
    assert (sub["path"], sub["raw_path"], sub["query_string"]) == (path, path.encode(), b"")
    assert headers_of(sub) == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    ]
    assert (sub["type"], sub["method"], sub["state"]) == ("http", "POST", {"kept": True})
    assert scope["path"] == "/v1/completions"  # the request's own scope is left alone


def test_an_answer_is_its_chunks_joined_and_text_where_it_is_not_json() -> None:
    start = {"type": "http.response.start", "status": 404, "headers": []}
    chunks: list[dict[str, object]] = [
        {"type": "http.response.body", "body": b'{"a": ', "more_body": True},
        {"type": "http.response.trailers"},
        {"type": "http.response.body", "body": b"1}"},
    ]
    assert json_answer([start, *chunks]) == (404, {"a": 1})
    assert json_answer([start, {"type": "http.response.body", "body": b"no\xff"}]) == (
        404,
        "no\ufffd",
    )
    assert json_answer([{"type": "http.response.body"}]) == (500, "")
