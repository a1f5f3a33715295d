"""Laws of the sparse relay's step rules: the sender machine against receiver machines,
over a channel that drops, corrupts, cuts short and replaces steps (h11's ConnectionPair,
with faults). A receiver's bits are modelled by the step whose content they hold, and a
frame applied onto bits of another step fails its checksum, as the pieces' hashes make it
fail in the shell."""

from __future__ import annotations

import enum
import itertools
import zlib

import attrs
import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Result, Success
from strategies import BitsPair, delta_pairs

from genworker.core.delta import (
    MAX_CHUNK_ELEMENTS,
    Bits,
    DeltaError,
    NodeResult,
    Outcome,
    RelayFailure,
    RelayReport,
    apply_delta_into,
    bits_hash,
    decode_delta,
    encode_delta,
    plan_frames,
    plan_relay,
)
from genworker.core.errors import CoreError
from genworker.core.refit_plan import DTYPE_ITEMSIZE, Manifest, TensorSpec
from genworker.core.sparse_protocol import (
    TAG_BEGIN,
    TAG_END,
    TAG_FRAME,
    TAG_REPORT,
    FrameAction,
    FrameMsg,
    FrameResult,
    RelayArgumentError,
    SparseDiverged,
    SparseEngineState,
    Started,
    StepBegin,
    StepReceiver,
    StepReport,
    StepSender,
    WirePiece,
    apply_frame,
    baseline_bits,
    baseline_layout,
    begin_message,
    check_relay_addresses,
    check_relay_start,
    check_tensors,
    encode_frame,
    end_message,
    expected_relay,
    frame_message,
    fresh_bits,
    node_answer,
    read_begin,
    read_end,
    read_frame,
    read_report,
    relay_statuses,
    report_message,
    root_answer,
    sender_settings,
    sparse_steps,
    step_manifest,
    tiles,
    token_bucket,
)

CHECKSUM = "gwh64"
NUMEL = 12
MANIFEST = (("w", (NUMEL,), "float32"),)
ADDRESSES = ("tcp://a", "tcp://b", "tcp://c")


class Fault(enum.Enum):
    NONE = "none"
    DROP = "drop"  # a frame never arrives
    CORRUPT = "corrupt"  # a frame fails its CRC
    BAD_APPLY = "bad_apply"  # a frame's pieces fail their checks
    TARGET = "target"  # the engine fails to take the verified bits
    OTHER_END = "other_end"  # the end names another step
    REPLACED = "replaced"  # the next Begin comes before this step's End
    QUIET = "quiet"  # the sender goes silent past the relay's bound
    RESTART = "restart"  # the receiver restarts before the step (fresh machine)


@attrs.define
class Node:
    machine: StepReceiver
    content: int | None = None  # the step whose bits this node holds; None: garbage


def begin_of(step: int, base: int, frames: int, **overrides: object) -> StepBegin:
    fields: dict[str, object] = {
        "step": step,
        "base_step": base,
        "receivers": ADDRESSES,
        "fanout": 2,
        "hop_s": 1.0,
        "frames": frames,
        "manifest": MANIFEST,
        "checksum": CHECKSUM,
    }
    fields.update(overrides)
    return StepBegin(**fields)  # type: ignore[arg-type]


def pieces(frames: int) -> list[tuple[str, int, int]]:
    bounds = [NUMEL * i // frames for i in range(frames + 1)]
    return [("w", a, b) for a, b in itertools.pairwise(bounds)]


def run_step(
    sender: StepSender, nodes: list[Node], faults: list[Fault], frames: int
) -> tuple[int, int, list[bool]]:
    """One step from ``sender`` to every node, each with its fault; which committed."""
    step, base = sender.start()
    committed = []
    for node, fault in zip(nodes, faults, strict=True):
        if fault is Fault.RESTART:
            node.machine, node.content = StepReceiver(node.machine.address, CHECKSUM), None
        was = node.content
        started, _ = node.machine.begin(begin_of(step, base, frames))
        assert (started.plan is not None and started.problem == "") or base >= 0
        if started.full:
            node.content = None  # fresh bits: filled by this step's frames
        results = []
        for index, piece in enumerate(pieces(frames)):
            if fault is Fault.DROP and index == 0:
                continue
            intact = not (fault is Fault.CORRUPT and index == frames - 1)
            action = node.machine.frame(step, index, intact)
            assert action is not FrameAction.IGNORE
            if action is FrameAction.APPLY:
                onto_right_bits = base < 0 or was == base
                ok = onto_right_bits and not (fault is Fault.BAD_APPLY and index == 0)
                results.append(FrameResult("", (piece,)) if ok else FrameResult("checksum", ()))
        committed.append(finish(node, step, fault, results))
    sender.conclude(all(committed))
    return step, base, committed


def finish(node: Node, step: int, fault: Fault, results: list[FrameResult]) -> bool:
    """The step's end at ``node`` (or what came instead); whether it committed. A node
    that did not holds bits nobody vouches for (a delta may have half-applied)."""
    node.content, why = None, ""
    if fault is Fault.REPLACED:
        why = node.machine.replace()
        assert why.startswith(f"step {step} was replaced")
    elif fault is Fault.QUIET:
        assert node.machine.idle(0.5) == ""  # within the bound: still open
        why = node.machine.idle(100.0)
        assert why.startswith(f"step {step} stopped mid-way")
    else:
        named = step + 1 if fault is Fault.OTHER_END else step
        problem, why = node.machine.end(named, results)
        assert why.endswith(problem)
        if not problem:
            why = node.machine.committed(step, "engine failed" if fault is Fault.TARGET else "")
    assert bool(why) == node.machine.needs_full
    if not why:
        node.content = step
    return not why


@given(
    st.integers(1, 3).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(
                st.tuples(
                    st.lists(st.sampled_from(Fault), min_size=n, max_size=n), st.integers(1, 4)
                ),
                min_size=1,
                max_size=8,
            ),
        )
    )
)
def test_receivers_commit_exactly_the_steps_they_can_vouch_for(
    case: tuple[int, list[tuple[list[Fault], int]]],
) -> None:
    n, steps = case
    sender = StepSender()
    nodes = [Node(StepReceiver(a, CHECKSUM)) for a in ADDRESSES[:n]]
    previous_ok = False
    for faults, frames in steps:
        holds = [node.machine.synced_step for node in nodes]
        step, base = run_step(sender, nodes, faults, frames)[:2]
        # the sender sends a delta only after a step every receiver applied
        assert (base >= 0) == previous_ok
        for node, fault, held in zip(nodes, faults, holds, strict=True):
            clean = fault in (Fault.NONE, Fault.RESTART)
            vouched = base < 0 or (held == base and fault is not Fault.RESTART)
            # a receiver commits exactly when nothing went wrong and it holds the base
            assert (node.machine.synced_step == step) == (clean and vouched)
            # a receiver that holds a step holds that step's content
            if node.machine.synced_step is not None:
                assert node.content == node.machine.synced_step
            else:
                assert node.machine.needs_full
        previous_ok = sender.synced_step is not None
        assert previous_ok == all(node.machine.synced_step == step for node in nodes)


@given(st.integers(1, 3), st.integers(1, 4))
def test_a_clean_full_step_recovers_every_receiver(n: int, frames: int) -> None:
    sender = StepSender()
    nodes = [Node(StepReceiver(a, CHECKSUM)) for a in ADDRESSES[:n]]
    run_step(sender, nodes, [Fault.CORRUPT] * n, frames)
    step, base, committed = run_step(sender, nodes, [Fault.NONE] * n, frames)
    assert base == -1
    assert all(committed)
    assert sender.synced_step == step
    step, base, committed = run_step(sender, nodes, [Fault.NONE] * n, frames)
    assert base == step - 1
    assert all(committed)


def fresh(address: str = ADDRESSES[0]) -> StepReceiver:
    return StepReceiver(address, CHECKSUM)


def test_a_senders_step_begins_over_its_plan_and_concludes_on_the_verdict() -> None:
    plan = plan_relay(ADDRESSES, 2).unwrap()
    manifest = Manifest.from_info({"w": ((NUMEL,), "float32")}).unwrap()
    sender = StepSender()
    first = sender.begin(plan, 1.0, 3, manifest, CHECKSUM)
    assert first == begin_of(1, -1, 3)
    assert first.full
    report = RelayReport(tuple(NodeResult(a, Outcome.APPLIED) for a in ADDRESSES))
    done = sender.finish(first, Success(report), 48, 10, 0.5)
    assert done == Success(StepReport(1, True, 48, 10, 3, 0.5, report))
    second = sender.begin(plan, 1.0, 3, manifest, CHECKSUM)
    assert (second.base_step, second.full) == (1, False)
    failure = RelayFailure("the step was applied by 2 of 3 receivers: c refused", results=())
    failed = sender.finish(second, Failure(failure), 48, 10, 1.25)
    assert isinstance(failed, Failure)
    assert failed.failure().relay == failure
    assert str(failed.failure()) == (
        "sparse refit step 2 (delta) failed after 1.25 s: the step was applied by 2 of 3 "
        "receivers: c refused"
    )
    assert sender.synced_step is None
    third = sender.begin(plan, 1.0, 3, manifest, CHECKSUM)
    assert (third.step, third.full) == (3, True)
    assert "(full)" in str(sender.finish(third, Failure(failure), 0, 0, 0.0).failure())


def test_frame_and_end_messages_drive_the_machine_and_count_the_frames_taken() -> None:
    def header(step: int, index: int, payload: bytes) -> FrameMsg:
        return read_frame(frame_message(step, index, [], 0, payload)[1]).unwrap()

    node = fresh()
    node.begin(begin_of(1, -1, 2))
    assert node.take_frame(header(1, 0, b"ok"), b"ok") is FrameAction.APPLY
    assert node.take_frame(header(2, 0, b"ok"), b"ok") is FrameAction.IGNORE
    assert node.take_frame(header(1, 1, b"ok"), b"corrupted") is FrameAction.DROP
    assert node.take_frame(header(1, 1, b"ok"), b"ok") is FrameAction.FORWARD  # refused
    assert node.frames_taken == {1: 2}
    problem, why = node.take_end(end_message(1)[1], [FrameResult("", (("w", 0, NUMEL),))])
    assert problem.startswith("frame 1 of step 1 failed its CRC")
    assert why.endswith(problem)
    node.begin(begin_of(2, -1, 1))
    assert node.take_frame(header(2, 0, b"ok"), b"ok") is FrameAction.APPLY
    assert node.take_end(end_message(2)[1], [FrameResult("", (("w", 0, NUMEL),))]) == ("", "")
    node.begin(begin_of(3, -1, 0))
    problem, _ = node.take_end(end_message(3)[1][:-1], [])
    assert problem.startswith("a malformed end: ")
    assert node.frames_taken == {1: 2, 2: 1}


def test_a_node_outside_the_relay_refuses_and_forwards_nothing() -> None:
    started, replaced = fresh("tcp://z").begin(begin_of(1, -1, 1))
    assert started.plan is None
    assert replaced == ""
    assert "is not in the step's relay" in started.problem
    bad_fanout = fresh().begin(begin_of(1, -1, 1, fanout=0))[0]
    assert bad_fanout.plan is None
    assert "fanout" in bad_fanout.problem


def test_a_step_planned_over_another_relay_is_refused_but_forwarded() -> None:
    node = fresh()
    node.relay = ADDRESSES[:2]
    started = node.begin(begin_of(1, -1, 1))[0]
    assert started.plan is not None
    assert "was configured into the relay" in started.problem
    assert node.frame(1, 0, True) is FrameAction.FORWARD


def test_an_invalid_manifest_refuses_the_step() -> None:
    started = fresh().begin(begin_of(1, -1, 1, manifest=(("w", (-1,), "float32"),)))[0]
    assert "the step's manifest is invalid" in started.problem
    assert not started.full


@pytest.mark.parametrize(
    ("held", "base", "manifest", "problem"),
    [
        (None, 0, MANIFEST, "needs a full refit before a delta"),
        (1, 2, MANIFEST, "holds step 1, but the delta applies to step 2"),
        (1, 1, (("w", (NUMEL,), "bfloat16"),), "manifest differs from the one of the last full"),
    ],
)
def test_a_delta_the_node_cannot_apply_is_refused(
    held: int | None,
    base: int,
    manifest: tuple[tuple[str, tuple[int, ...], str], ...],
    problem: str,
) -> None:
    node = fresh()
    node.begin(begin_of(1, -1, 1))
    node.end(1, [FrameResult("", (("w", 0, NUMEL),))])
    node.committed(1)
    node.synced_step = held
    started = node.begin(begin_of(3, base, 1, manifest=manifest))[0]
    assert problem in started.problem


def test_a_step_with_other_checksums_is_refused() -> None:
    started = fresh().begin(begin_of(1, -1, 1, checksum="crc32"))[0]
    assert "carry 'crc32' checksums, this receiver checks 'gwh64'" in started.problem


def test_messages_without_an_open_step_change_nothing() -> None:
    node = fresh()
    assert node.open_step is None
    assert node.idle(1e9) == ""
    assert node.replace() == ""
    node.refuse("nothing to refuse")
    assert node.frame(1, 0, True) is FrameAction.IGNORE
    other = fresh()
    other.begin(begin_of(1, -1, 2))
    assert other.open_step == 1
    assert other.frame(2, 0, True) is FrameAction.IGNORE


def test_a_refused_step_keeps_its_first_problem_and_verified_bits_must_tile() -> None:
    node = fresh()
    node.begin(begin_of(1, -1, 1))
    node.refuse("a malformed end")
    node.refuse("a second problem")
    assert node.end(1, [])[0] == "a malformed end"
    node.begin(begin_of(2, -1, 1))
    assert node.frame(2, 0, True) is FrameAction.APPLY
    problem, why = node.end(2, [FrameResult("", (("w", 0, NUMEL - 1),))])
    assert problem == "has no verified bits for all of ['w']"
    assert why.startswith("step 2 refused")


@given(st.lists(st.integers(1, 5), max_size=6), st.integers(0, 2))
def test_tiles_holds_exactly_for_back_to_back_cover(sizes: list[int], gap: int) -> None:
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    ranges = list(itertools.pairwise(bounds))
    assert tiles(ranges, bounds[-1]) == bool(ranges)
    if ranges:
        assert not tiles([*ranges, ranges[0]], bounds[-1])  # an element twice
        shifted = [(a + gap + 1, b + gap + 1) for a, b in ranges]
        assert not tiles(shifted, bounds[-1] + gap + 1)  # a gap at the start
    assert tiles([(0, 0)], 0)
    assert not tiles([], 0)


# -- the wire -------------------------------------------------------------------------

_names = st.text(min_size=1, max_size=8)
_shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
_dtypes = st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"])


@given(
    st.integers(0, 1 << 40),
    st.integers(-1, 1 << 40),
    st.lists(_names, min_size=1, max_size=4, unique=True),
    st.integers(1, 8),
    st.floats(1e-3, 1e6),
    st.integers(0, 100),
    st.dictionaries(_names, st.tuples(_shapes, _dtypes), max_size=4),
    st.sampled_from(["gwh64", "crc32"]),
    st.integers(1, 1 << 16),
)
def test_a_begin_reads_back_as_it_was_built(
    step: int,
    base: int,
    receivers: list[str],
    fanout: int,
    hop_s: float,
    frames: int,
    manifest: dict[str, tuple[tuple[int, ...], str]],
    checksum: str,
    chunk_elements: int,
) -> None:
    entries = tuple((n, shape, dtype) for n, (shape, dtype) in manifest.items())
    begin = StepBegin(step, base, tuple(receivers), fanout, hop_s, frames, entries, checksum)
    tag, body = begin_message(begin, chunk_elements)
    assert tag == TAG_BEGIN
    read = read_begin(body)
    assert isinstance(read, Success)
    assert read.unwrap() == begin


@pytest.mark.parametrize(
    "body",
    [
        b"not msgpack",
        begin_message(begin_of(1, -1, 1), 1 << 16)[1][:-3],  # cut short
        begin_message(begin_of(1, -1, 1, fanout=0), 64)[1],  # fanout >= 1
    ],
)
def test_a_malformed_begin_is_a_wire_error(body: bytes) -> None:
    read = read_begin(body)
    assert isinstance(read, Failure)
    assert str(read.failure()).startswith("malformed begin: ")


def test_a_begin_without_chunk_elements_in_range_is_malformed() -> None:
    read = read_begin(begin_message(begin_of(1, -1, 1), (1 << 16) + 1)[1])
    assert isinstance(read, Failure)
    assert "chunk_elements" in str(read.failure())


@given(
    st.integers(0, 1 << 40),
    st.integers(0, 1000),
    st.binary(max_size=20),
    st.lists(st.tuples(_names, st.integers(0, 99), st.integers(0, 1 << 63)), max_size=4),
)
def test_frames_and_ends_read_back_as_they_were_built(
    step: int, index: int, payload: bytes, pieces: list[tuple[str, int, int]]
) -> None:
    wire = [WirePiece(n, a, a + 1, a * 3, h) for n, a, h in pieces]
    tag, body, sent = frame_message(step, index, wire, 7, payload)
    assert (tag, sent) == (TAG_FRAME, payload)
    assert read_frame(body) == Success(FrameMsg(step, index, zlib.crc32(payload), 7, wire))
    tag, body = end_message(step)
    assert tag == TAG_END
    assert read_end(body) == Success(step)


def test_the_sender_reads_the_roots_report_of_its_step() -> None:
    report = RelayReport((NodeResult("tcp://a", Outcome.APPLIED),))
    assert root_answer(report_message(2, report), 2, "tcp://a") == report
    assert root_answer(report_message(1, report), 2, "tcp://a") is None  # late, of step 1
    refused = NodeResult("tcp://a", Outcome.REFUSED, "sent a malformed report")
    assert root_answer([TAG_END, b""], 2, "tcp://a") == RelayReport((refused,))


def test_malformed_frame_headers_and_ends_are_wire_errors() -> None:
    frame = read_frame(b"\x01")
    assert isinstance(frame, Failure)
    assert str(frame.failure()).startswith("a malformed frame header: ")
    end = read_end(end_message(3)[1][:-1])
    assert isinstance(end, Failure)
    assert str(end.failure()).startswith("a malformed end: ")


@given(
    st.integers(0, 1 << 40),
    st.lists(st.tuples(_names, st.sampled_from(Outcome), st.text(max_size=10)), max_size=5),
)
def test_a_report_reads_back_as_it_was_built(
    step: int, results: list[tuple[str, Outcome, str]]
) -> None:
    report = RelayReport(tuple(NodeResult(*r) for r in results))
    assert read_report(report_message(step, report)) == (step, report)


def test_what_is_not_a_report_reads_as_none() -> None:
    tag, body = report_message(1, RelayReport((NodeResult("a", Outcome.APPLIED),)))
    assert read_report([tag]) is None
    assert read_report([TAG_END, body]) is None
    assert read_report([TAG_REPORT, body[:-2]]) is None
    other = body.replace(b"applied", b"happens")  # an outcome no receiver reports
    assert read_report([TAG_REPORT, other]) is None


def test_check_tensors_names_each_missing_misshaped_and_unknown_tensor() -> None:
    manifest = Manifest.from_info({"a": ((2,), "float32"), "b": ((3,), "bfloat16")}).unwrap()
    assert step_manifest(manifest) == (("a", (2,), "float32"), ("b", (3,), "bfloat16"))
    exact = {s.name: s for s in manifest.specs}
    assert check_tensors(manifest, exact) == Success(None)
    refused = check_tensors(manifest, {"b": TensorSpec("b", (4,), "bfloat16"), "c": None})
    assert isinstance(refused, Failure)
    assert str(refused.failure()) == (
        "sparse refit tensors do not match the manifest: 'a' is missing; "
        "'b' is [4] bfloat16, expected [3] bfloat16; 'c' is not in the manifest"
    )
    many = check_tensors(manifest, {f"x{i:02}": None for i in range(20)})
    assert isinstance(many, Failure)
    assert str(many.failure()).count("; ") == 11  # the first 12 named


def test_a_senders_settings_are_refused_by_name() -> None:
    assert sender_settings(1.0, 1, 1, 1) == Success(None)
    assert sender_settings(1.0, 1, 1, MAX_CHUNK_ELEMENTS) == Success(None)
    refusals = {
        (0.0, 1, 1, 1): "hop_s, frame_bytes and workers must be positive, got 0.0, 1, 1",
        (1.0, 0, 1, 1): "hop_s, frame_bytes and workers must be positive, got 1.0, 0, 1",
        (1.0, 1, 0, 1): "hop_s, frame_bytes and workers must be positive, got 1.0, 1, 0",
        (1.0, 1, 1, 0): f"chunk_elements must be in [1, {MAX_CHUNK_ELEMENTS}], got 0",
        (1.0, 1, 1, MAX_CHUNK_ELEMENTS + 1): (
            f"chunk_elements must be in [1, {MAX_CHUNK_ELEMENTS}], got {MAX_CHUNK_ELEMENTS + 1}"
        ),
    }
    for settings, message in refusals.items():
        refused = sender_settings(*settings)
        assert isinstance(refused, Failure)
        assert str(refused.failure()) == message


@given(st.lists(st.integers(0, 200), max_size=6), st.sampled_from([1, 8, 64]))
def test_a_baselines_tensors_start_aligned_and_apart(sizes: list[int], align: int) -> None:
    """Law: each tensor starts at a multiple of ``align``, after the one before it ends,
    and the buffer holds the last one, with less than ``align`` bytes to spare each."""
    specs = [TensorSpec(f"t{i}", (n,), "uint8") for i, n in enumerate(sizes)]
    offsets, total = baseline_layout(specs, align)
    ends = [offsets[s.name] + s.nbytes for s in specs]
    assert all(offsets[s.name] % align == 0 for s in specs)
    assert [offsets[s.name] for s in specs] == sorted(offsets.values())
    assert all(end <= offsets[s.name] for end, s in zip(ends, specs[1:], strict=False))
    assert total == sum(-(-n // align) * align for n in sizes)
    assert baseline_layout(specs) == baseline_layout(specs, 64)


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.sampled_from(["uint8", "bfloat16", "float32"])),
        max_size=5,
    )
)
def test_a_baselines_bits_are_apart_views_of_its_buffer_of_each_width(
    tensors: list[tuple[int, str]],
) -> None:
    specs = [TensorSpec(f"t{i}", (n,), dtype) for i, (n, dtype) in enumerate(tensors)]
    storage = np.zeros(baseline_layout(specs)[1], dtype=np.uint8)
    bits = baseline_bits(specs, storage)
    for i, spec in enumerate(specs):
        view = bits[spec.name]
        assert (view.shape, view.itemsize) == ((spec.numel,), DTYPE_ITEMSIZE[spec.dtype])
        assert spec.numel == 0 or np.shares_memory(view, storage)
        view[:] = i + 1
    assert all((bits[spec.name] == i + 1).all() for i, spec in enumerate(specs))  # apart


def test_a_step_reports_its_wire_fraction() -> None:
    report = RelayReport(())
    assert StepReport(1, False, 200, 50, 1, 0.1, report).wire_fraction == 0.25
    assert StepReport(1, True, 0, 50, 1, 0.1, report).wire_fraction == 0.0


def test_a_node_answers_its_own_result_and_its_childrens_reports() -> None:
    plan = plan_relay(["a", "b"], 1).unwrap()
    alone = Started(None, 0, True, (), "")
    assert node_answer("x", "", alone, {}, 1.0) == RelayReport((NodeResult("x", Outcome.APPLIED),))
    assert node_answer("x", "no", alone, {}, 1.0) == RelayReport(
        (NodeResult("x", Outcome.REFUSED, "no"),)
    )
    root = Started(plan, 0, True, (), "")
    child = RelayReport((NodeResult("b", Outcome.APPLIED),))
    both = node_answer("a", "", root, {1: child}, 1.0)
    assert both == RelayReport((NodeResult("a", Outcome.APPLIED), *child.results))
    silent = node_answer("a", "", root, {}, 1.0)
    assert [r.outcome for r in silent.results] == [Outcome.APPLIED, Outcome.SILENT]


def test_a_started_step_names_the_nodes_children_and_when_their_reports_are_due() -> None:
    plan = plan_relay(["a", "b", "c", "d"], 2).unwrap()
    root = Started(plan, 0, True, (), "")
    assert root.children == {1: "b", 2: "c"}
    due = root.deadlines(10.0, 2.0)
    assert due == {1: 10.0 + 2.0 * plan.height(1), 2: 10.0 + 2.0 * plan.height(2)}
    assert all(at <= 10.0 + plan.answer_bound_s(0, 2.0) - 2.0 for at in due.values())
    assert Started(plan, 1, True, (), "").children == {3: "d"}
    for childless in (Started(plan, 3, True, (), ""), Started(None, -1, False, (), "outside")):
        assert childless.children == {}
        assert childless.deadlines(10.0, 2.0) == {}


def test_a_receiver_expects_a_relay_naming_it_or_any() -> None:
    assert expected_relay(None, "a") == Success(None)
    assert expected_relay(["b", "a"], "a") == Success(("b", "a"))
    outside = expected_relay(["b"], "a")
    assert isinstance(outside, Failure)
    assert str(outside.failure()) == (
        "relay_addresses ['b'] do not include this receiver's address 'a'"
    )
    twice = expected_relay(["a", "a"], "a")
    assert isinstance(twice, Failure)
    assert str(twice.failure()).startswith("relay_addresses: ")


def test_a_full_step_starts_from_zero_bits_of_each_tensors_width() -> None:
    specs = [TensorSpec("a", (2, 3), "bfloat16"), TensorSpec("b", (0,), "float32")]
    bits = fresh_bits(specs)
    assert [(n, b.shape, b.dtype.itemsize, int(b.sum())) for n, b in bits.items()] == [
        ("a", (6,), 2, 0),
        ("b", (0,), 4, 0),
    ]


def test_an_engines_sparse_state_forgets_a_divergence_after_another_refit() -> None:
    state = SparseEngineState()
    frames = {3: 2}
    assert state.status(0, None, {}) == {
        "address": None, "applied": 0, "step": None, "diverged": "", "frames": {}
    }  # fmt: skip
    state.took(3)
    state.diverge("bad", 5)
    assert state.status(5, "tcp://a", frames) == {
        "address": "tcp://a", "applied": 1, "step": 3, "diverged": "bad", "frames": {3: 2}
    }  # fmt: skip
    assert state.status(6, "tcp://a", frames)["diverged"] == ""
    state.diverge("again", 6)
    state.took(4)
    assert (state.applied, state.step, state.status(6, None, {})["diverged"]) == (2, 4, "")


@given(st.lists(st.tuples(st.floats(0, 2), st.integers(0, 3000)), max_size=8))
def test_a_token_bucket_lets_through_its_burst_and_then_its_rate(
    takes: list[tuple[float, int]],
) -> None:
    """Law: over any sequence of takes, the bytes let through by time ``t`` (each take at
    the time it was asked, plus its wait) never exceed the burst plus the rate times
    ``t``, and a take within the saved tokens waits for nothing."""
    bucket = token_bucket(8000, 1000, 0.0).unwrap()  # 1,000 bytes a second
    now, sent = 0.0, 0
    for gap, nbytes in takes:
        now += gap
        saved = min(1000.0, bucket.tokens + (now - bucket.at) * 1000)
        wait = bucket.take(now, nbytes)
        assert (wait == 0) == (nbytes <= saved)
        now += wait
        sent += nbytes
        assert sent <= 1000 + 1000 * now + 1e-6


def test_a_token_bucket_needs_a_rate_and_a_burst() -> None:
    for bits_per_s, burst in [(0, 1), (-1.0, 1), (1.0, 0)]:
        refused = token_bucket(bits_per_s, burst, 0.0)
        assert isinstance(refused, Failure)
        assert str(refused.failure()) == (
            "a link throttle needs bits_per_s > 0 and burst_bytes >= 1, got "
            f"{bits_per_s!r} and {burst!r}"
        )


# -- frames ---------------------------------------------------------------------------


def _encode_wire(old: Bits, new: Bits, chunk: int) -> bytes:
    return encode_delta(old, new, chunk).to_bytes()


def _apply_wire(target: Bits, data: memoryview) -> Result[None, DeltaError]:
    return decode_delta(data).bind(lambda delta: apply_delta_into(target, delta))


_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def _spec_of(name: str, bits: Bits) -> TensorSpec:
    return TensorSpec(name, (len(bits),), _DTYPES.get(bits.itemsize, "float64"))


def _send(
    frame_bytes: int, old: dict[str, Bits], new: dict[str, Bits], full: bool
) -> list[tuple[FrameMsg, bytes]]:
    specs = [_spec_of(n, b) for n, b in new.items()]
    frames = plan_frames(specs, frame_bytes, 8)
    out = []
    for index, frame in enumerate(frames):
        before = None if full else old.__getitem__
        raw, pieces, deltas = encode_frame(frame, new, before, 8, _encode_wire, bits_hash)
        assert [piece for piece, _ in deltas] == list(frame)
        assert b"".join(data for _, data in deltas) == raw
        out.append((FrameMsg(1, index, 0, len(raw), pieces), raw))
    return out


@given(delta_pairs(max_numel=120), delta_pairs(max_numel=60), st.integers(8, 200), st.booleans())
def test_a_step_encoded_and_applied_frame_by_frame_makes_the_new_bits(
    a: BitsPair, b: BitsPair, frame_bytes: int, full: bool
) -> None:
    old, new = {"a": a.old, "b": b.old}, {"a": a.new, "b": b.new}
    specs = {n: _spec_of(n, bits) for n, bits in new.items()}
    held = {n: (np.zeros_like(bits) if full else bits.copy()) for n, bits in old.items()}
    covered: list[tuple[str, int, int]] = []
    for header, raw in _send(frame_bytes, old, new, full):
        result = apply_frame(header, raw, specs, held, _apply_wire, bits_hash)
        assert result.problem == ""
        covered.extend(result.pieces)
    assert all(np.array_equal(held[n], new[n]) for n in new)
    for name, spec in specs.items():
        assert tiles([(s, e) for n, s, e in covered if n == name], spec.numel)


def test_a_frame_that_cannot_apply_names_its_problem() -> None:
    old: dict[str, Bits] = {"w": np.arange(40, dtype=np.uint16)}
    new: dict[str, Bits] = {"w": old["w"] ^ np.uint16(3)}
    specs = {"w": TensorSpec("w", (40,), "bfloat16")}
    [(header, raw)] = _send(1 << 20, old, new, False)

    def apply(raw: bytes, header: FrameMsg = header, bits: dict[str, Bits] | None = None) -> str:
        held = {"w": old["w"].copy()} if bits is None else bits
        return apply_frame(header, raw, specs, held, _apply_wire, bits_hash).problem

    assert apply(raw[:-1]) == f"frame 0 decompressed to {len(raw) - 1} bytes, not {len(raw)}"
    longer = msgspec.structs.replace(header, raw_bytes=len(raw) + 2)
    assert apply(raw + b"xy", longer) == "frame 0 has 2 bytes past its pieces"
    piece = header.pieces[0]
    for bad in (msgspec.structs.replace(piece, name="v"), msgspec.structs.replace(piece, stop=41)):
        named = msgspec.structs.replace(header, pieces=[bad])
        assert "not in the manifest" in apply(raw, named)
    broken = b"XXXX" + raw[4:]  # the wire form's magic
    assert apply(broken).startswith("'w'[0:40]: invalid delta: magic")
    diverged: dict[str, Bits] = {
        "w": old["w"] ^ np.uint16(1)
    }  # a receiver whose bits are not the baseline
    assert "'w'[0:40] failed its checksum: gwh64 0x" in apply(raw, bits=diverged)


def _status(applied: object, step: object = 1, diverged: str = "") -> dict[str, object]:
    return {"applied": applied, "step": step, "diverged": diverged}


@given(st.integers(0, 9), st.integers(0, 9), st.integers(1, 4))
def test_sparse_steps_count_what_the_workers_applied_since_last_seen(
    before: int, after: int, workers: int
) -> None:
    """No change: no step; more applied: that many; a count that went down or is not a
    number (a restarted relay): one step, as the counts changed."""
    statuses = [_status(after, step=after)] * workers
    steps = sparse_steps(statuses, [before] * workers)
    assert steps == Success(0 if after == before else after - before if after > before else 1)
    assert sparse_steps([_status("x")], [before]) == Success(1)
    assert sparse_steps([_status(after)], []) == Success(max(after, 1))


def test_sparse_steps_refuse_diverged_workers_or_different_steps_naming_them() -> None:
    diverged = sparse_steps([_status(1), _status(1, diverged="crc mismatch")], [0, 0])
    assert isinstance(diverged, Failure)
    assert isinstance(diverged.failure(), SparseDiverged)
    assert diverged.failure().problems == ("engine worker 1: crc mismatch",)
    assert diverged.failure().message.startswith(
        "generate refused: the sparse refit left weights nobody can vouch for (engine worker 1"
    )
    apart = sparse_steps([_status(1, step=3), _status(1, step=4)], [1, 1])
    assert isinstance(apart, Failure)
    assert apart.failure().problems == ("the engine workers hold different sparse steps [3, 4]",)


def test_the_relay_calls_take_a_host_a_flag_and_a_list_of_addresses() -> None:
    assert check_relay_start("0.0.0.0", True) == Success(("0.0.0.0", True))
    assert check_relay_start("h", 1) == Failure(
        RelayArgumentError("host must be a str and allow_remote a bool, got 'h' and 1")
    )
    assert check_relay_start(None, False) == Failure(
        RelayArgumentError("host must be a str and allow_remote a bool, got None and False")
    )
    assert check_relay_addresses(("tcp://a:1", "tcp://b:2")) == Success(["tcp://a:1", "tcp://b:2"])
    for bad in ("tcp://a:1", 3, None):
        assert check_relay_addresses(bad) == Failure(
            RelayArgumentError(f"relay_addresses must be a list of addresses, got {bad!r}")
        )


def test_the_relay_statuses_are_a_list_of_dicts_one_per_engine_worker() -> None:
    """``relay_statuses``: a list of dicts is taken (copied); anything else is refused
    naming what came back."""
    status = {"applied": 2, "step": 3, "diverged": ""}
    assert relay_statuses([status]) == Success([status])
    for bad in ({"applied": 2}, [status, "x"]):
        assert relay_statuses(bad) == Failure(CoreError(f"sparse_relay_status returned {bad!r}"))
