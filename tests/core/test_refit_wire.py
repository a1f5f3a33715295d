"""The refit wire's laws: every event survives its frame, a chunk's storage sizes travel
in its handles, a listing sent again decodes to the very objects, and anything off the
schema is a refusal, never an object."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import refit_events

from genworker.core import refit_protocol as p
from genworker.core.refit_wire import (
    CpuHandle,
    CudaHandle,
    Handle,
    Listing,
    Reply,
    decode,
    decode_reply,
    encode,
    encode_chunk,
    listing,
)

HANDLES: st.SearchStrategy[Handle] = st.one_of(
    st.builds(
        CpuHandle,
        st.text(max_size=8),
        st.integers(0, 1 << 40),
        st.integers(0, (1 << 64) - 1),
        st.text(),
    ),
    st.builds(
        CudaHandle,
        st.text(max_size=8),
        st.binary(max_size=8),
        st.integers(0, 1 << 40),
        st.integers(0, 1 << 20),
        st.binary(max_size=8),
        st.integers(0, 1 << 16),
        st.binary(max_size=8),
        st.booleans(),
    ),
)


@given(refit_events, st.none() | st.lists(HANDLES, max_size=3))
def test_every_event_survives_its_frame(event: p.Event, handles: list[Handle] | None) -> None:
    decoded = decode(encode(event, handles), {})
    assert isinstance(decoded, Success)
    back, known = decoded.unwrap()
    if not isinstance(event, p.Chunk):
        assert (back, known) == (event, None)
        return
    sizes = None if handles is None else tuple(h.size for h in handles)
    assert back == p.Chunk(event.refit_id, event.index, event.tensors, sizes, event.kinds)
    assert known is not None
    assert known[1:] == (event.tensors, event.kinds, handles)


@given(refit_events.filter(lambda e: isinstance(e, p.Chunk)), st.lists(HANDLES, max_size=2))
def test_a_listing_sent_again_decodes_to_the_very_objects(
    event: p.Event, handles: list[Handle]
) -> None:
    assert isinstance(event, p.Chunk)
    listed = listing(event, handles)
    first = decode(encode_chunk("r1", event.index, listed), {}).unwrap()[1]
    assert first is not None
    memo: dict[int, Listing] = {event.index: first}
    again = decode(encode_chunk("r2", event.index, listed), memo).unwrap()
    assert again[1] is first
    assert isinstance(again[0], p.Chunk)
    assert again[0].refit_id == "r2"
    assert again[0].tensors is first[1]
    other = decode(encode_chunk("r2", event.index, listing(event, None)), memo).unwrap()[1]
    assert other is not first


@given(st.binary(max_size=64))
def test_bytes_off_the_schema_are_refused_naming_their_size(data: bytes) -> None:
    decoded = decode(data, {})
    if isinstance(decoded, Failure):
        assert f"malformed refit message ({len(data)} bytes)" in str(decoded.failure())


def test_an_unknown_kind_and_a_body_off_its_schema_are_refused() -> None:
    unknown = msgspec.msgpack.encode(("resume", {"refit_id": "r"}, None))
    assert isinstance(decode(unknown, {}), Failure)
    wrong = msgspec.msgpack.encode(("end", {"refit_id": 3}, None))
    assert isinstance(decode(wrong, {}), Failure)


@given(st.builds(Reply, st.booleans(), st.text(max_size=8), st.text(max_size=8)))
def test_a_reply_survives_its_encoding_and_garbage_is_refused_naming_the_peer(
    reply: Reply,
) -> None:
    assert decode_reply(encode(reply), "peer") == Success(reply)
    refused = decode_reply(b"\xc1", "the engine at ipc://x")
    assert isinstance(refused, Failure)
    assert "malformed refit reply from the engine at ipc://x" in str(refused.failure())
