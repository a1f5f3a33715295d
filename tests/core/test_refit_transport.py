"""The refit transports' own rules (``core.refit_transport``): loopback binds, message
caps, foreign errors typed, status rounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core import refit_protocol as p
from genworker.core import refit_transport as rt
from genworker.core.refit_plan import Manifest, TensorSpec

KINDS = ("manifest", "timeout", "transport", "refit")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_only_loopback_hosts_are_loopback(host: str, loopback: bool) -> None:
    assert rt.is_loopback(host) is loopback


def test_only_a_remote_host_is_refused_and_only_unless_allowed() -> None:
    assert rt.bind_refusal("the socket", None, allow_remote=False) is None
    assert rt.bind_refusal("the socket", "127.0.0.1", allow_remote=False) is None
    assert rt.bind_refusal("the socket", "10.0.0.1", allow_remote=True) is None
    assert rt.bind_refusal("the relay", "10.0.0.1", allow_remote=False, note="; it is open") == (
        "refusing to bind the relay on 10.0.0.1: not a loopback address "
        "(pass allow_remote=True to expose it; it is open)"
    )


@pytest.mark.parametrize(
    ("device_type", "backend"), [("cuda", "nccl"), ("cpu", "gloo"), ("xpu", "gloo")]
)
def test_a_group_runs_nccl_on_cuda_and_gloo_elsewhere(device_type: str, backend: str) -> None:
    assert rt.collective_backend(device_type) == backend


def test_a_claim_is_its_ranks_place_on_its_backend_or_every_topology_problem() -> None:
    claim = rt.group_claim("127.0.0.1", 29500, 2, (3, 1), "engine", "cuda")
    assert claim == Success(p.GroupClaim(2, 3, 1, "nccl", "engine"))
    refused = rt.group_claim("", 0, 0, (1, 1), "engine", "cpu")
    assert isinstance(refused, Failure)
    wrong = p.GroupClaim(0, 1, 1, "gloo", "engine")
    assert str(refused.failure()) == "; ".join(p.topology_problems("", 0, wrong))
    assert str(refused.failure()).count(";") == 4  # five problems, every one told


def test_a_message_cap_is_the_manifests_largest_message_and_never_below_the_floor() -> None:
    assert rt.message_cap(None) == rt.MIN_MESSAGE_CAP
    small = Manifest.from_specs([TensorSpec("w", (2,), "float32")]).unwrap()
    assert rt.message_cap(small) == rt.MIN_MESSAGE_CAP
    specs = [TensorSpec(f"layer.{i}." + "x" * 200, (4, 4), "float32") for i in range(5000)]
    large = Manifest.from_specs(specs).unwrap()
    assert rt.message_cap(large) == p.max_message_bytes(large) > rt.MIN_MESSAGE_CAP


def test_a_foreign_error_is_a_timeout_when_it_says_so_or_comes_at_the_bound() -> None:
    error = ("RuntimeError", "Connection reset by peer")
    said = rt.foreign_failure("broadcasting chunk 0", "the group", 10.0, 1.0, error, timeout=True)
    assert said == rt.ForeignFailure(
        True, "broadcasting chunk 0 on the group: not done within 10s (Connection reset by peer)"
    )
    late = rt.foreign_failure("x", "g", 10.0, 9.5, error, timeout=False)
    assert late.timed_out
    early = rt.foreign_failure("x", "g", 10.0, 9.4, error, timeout=False)
    assert early == rt.ForeignFailure(
        False, "x on g failed after 9.4s: RuntimeError: Connection reset by peer"
    )


@given(st.lists(st.one_of(st.none(), st.sampled_from(KINDS)), min_size=1, max_size=8))
def test_a_status_round_finds_every_failed_rank_and_its_kind(kinds: list[str | None]) -> None:
    codes = [rt.status_code(kind, KINDS) for kind in kinds]
    failed = rt.status_failures(codes, KINDS)
    assert failed == {rank: kind for rank, kind in enumerate(kinds) if kind is not None}


def test_a_failed_status_round_names_each_failed_rank_as_the_first_ones_kind() -> None:
    frames = [rt.status_frame(m) for m in ("", "bad tensor", "x" * 5000, "late")]
    assert {len(f) for f in frames} == {rt.STATUS_FRAME_BYTES}
    kind, message = rt.group_failure("the end of the refit", {1: "manifest", 3: "timeout"}, frames)
    assert kind == "manifest"
    assert (
        message
        == "the weight-update group failed the end of the refit: rank 1: bad tensor; rank 3: late"
    )
    assert rt.status_frame("é").rstrip(b"\0").decode() == "é"


def test_a_senders_digest_is_its_manifests_or_empty_without_one() -> None:
    manifest = Manifest.from_specs([TensorSpec("w", (2, 3), "bfloat16")]).unwrap()
    assert rt.sender_digest(None) == Success("")
    assert rt.sender_digest(manifest) == Success(manifest.digest())
    assert rt.sender_digest({"w": ((2, 3), "bfloat16")}) == Success(manifest.digest())
    assert isinstance(rt.sender_digest({"w": ((2, 3), "complex")}), Failure)
    refused = rt.sender_digest(["w"])
    assert isinstance(refused, Failure)
    assert str(refused.failure()) == "['w']"
