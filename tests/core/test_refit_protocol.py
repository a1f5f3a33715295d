"""Laws of the refit protocol: the sender's plan fed to the receiver machine, refusals,
kept mappings and the bounds."""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import RefitSendCase, refit_budgets, refit_events, refit_send_cases

from genworker.core import refit_protocol as p
from genworker.core.refit_plan import Deviation, Manifest, TensorSpec, align_up


@attrs.frozen
class Sent:
    events: list[p.Event]
    # per tensor placed into a chunk that already held one: (seconds since it opened)
    waited: list[float]


def simulate(case: RefitSendCase, specs: tuple[TensorSpec, ...] | None = None) -> Sent:
    """A trainer's refit as ``RefitSender`` makes it: ``send_route`` and ``ChunkPlan``
    decide, storages are laid out as the IPC port lays them out."""
    specs = case.specs if specs is None else specs
    manifest = Manifest.from_specs(case.specs).unwrap()
    events: list[p.Event] = [p.Begin("r1", manifest.digest())]
    plan = p.ChunkPlan(case.budget, case.flush_after_s, opened_at=0.0)
    refs: list[p.TensorRef] = []
    storages: list[int] = []
    kinds: list[p.StorageKind] = []
    staging: dict[int, int] = {}
    waited: list[float] = []
    now = 0.0

    def flush() -> None:
        index = sum(isinstance(e, p.Chunk) for e in events)
        events.append(p.Chunk("r1", index, tuple(refs), tuple(storages), tuple(kinds)))
        refs.clear()
        storages.clear()
        kinds.clear()
        staging.clear()

    def storage(size: int, kind: p.StorageKind) -> int:
        storages.append(size)
        kinds.append(kind)
        return len(storages) - 1

    for i, spec in enumerate(specs):
        at = i % len(case.specs)
        now += case.delays[at]
        route = p.send_route(
            storage_bytes=spec.nbytes + case.extra[at],
            contiguous=case.contiguous[at],
            local=case.local[at],
            recognised=case.recognised[at],
        )
        placed = p.ChunkPlan.place(plan, route, spec.nbytes, now)
        if placed.flush:
            flush()
        elif plan.tensors:
            waited.append(now - plan.opened_at)
        plan = placed.plan
        if route is p.SendRoute.HANDLE:
            index = storage(case.extra[at] + spec.nbytes, p.StorageKind.OWN)
            offset = case.extra[at]
        elif placed.alone:
            index = storage(align_up(spec.nbytes), p.StorageKind.TEMPORARY)
            offset = 0
        else:
            if plan.buffer not in staging:
                staging[plan.buffer] = storage(case.budget, p.StorageKind.STAGING)
            index, offset = staging[plan.buffer], placed.offset
        refs.append(p.TensorRef(spec.name, spec.shape, spec.dtype, index, offset))
        if placed.alone:
            flush()
            plan = plan.flushed(now)
    if plan.tensors:
        flush()
        plan = plan.flushed(now)
    events.append(p.End("r1", plan.index, len(specs)))
    return Sent(events, waited)


def feed(receiver: p.Receiver, events: list[p.Event]) -> list[p.Step | p.Refusal]:
    out: list[p.Step | p.Refusal] = []
    for event in events:
        result = receiver.handle(event)
        if isinstance(result, Failure):
            out.append(result.failure())
            if result.failure().fatal:
                break
        else:
            out.append(result.unwrap())
            receiver = result.unwrap().receiver
    return out


def routes_of(specs: tuple[TensorSpec, ...]) -> p.Routes:
    """Every second tensor direct, so both routes appear."""
    return p.Routes(frozenset(s.name for s in specs[::2]))


# -- machine against machine --------------------------------------------------------------


@given(refit_send_cases())
def test_the_senders_plan_writes_every_tensor_exactly_once(case: RefitSendCase) -> None:
    manifest = Manifest.from_specs(case.specs).unwrap()
    routes = routes_of(case.specs)
    sent = simulate(case)
    steps = feed(p.Receiver(manifest, routes), sent.events)
    assert all(isinstance(s, p.Step) for s in steps), steps
    *_, last = steps
    assert isinstance(last, p.Step)
    assert last.decision == p.Finished(len(case.specs), len(sent.events) - 2)
    assert last.receiver.phase is p.Phase.DONE
    writes = [w for s in steps if isinstance(s, p.Step) and isinstance(s.decision, p.Writes)
              for w in s.decision.writes]  # fmt: skip
    assert [w.ref.name for w in writes] == [s.name for s in case.specs]
    for step in steps:
        assert isinstance(step, p.Step)
        if isinstance(step.decision, p.Writes):
            chunk = step.decision.chunk
            for write in step.decision.writes:
                assert write.route is routes.route(write.ref.name)
                stable = chunk.kinds[write.ref.storage].stable
                assert write.copy == (write.route is p.Route.LOADER and not stable)
    # the messages, and so the waits, are bounded by the manifest's length
    assert (
        len(sent.events) <= len(case.specs) + 2 == p.refit_waits(len(case.specs), p.Transport.IPC)
    )


@given(refit_send_cases())
def test_packed_tensors_lie_apart_inside_the_budget(case: RefitSendCase) -> None:
    for chunk in simulate(case).events:
        if not isinstance(chunk, p.Chunk):
            continue
        assert chunk.storages is not None
        taken: dict[int, list[tuple[int, int]]] = {}
        for ref in chunk.tensors:
            size = TensorSpec(ref.name, ref.shape, ref.dtype).nbytes
            assert ref.offset + size <= chunk.storages[ref.storage]
            if chunk.kinds[ref.storage] is p.StorageKind.STAGING:
                assert ref.offset % 512 == 0
                for start, end in taken.get(ref.storage, []):
                    assert ref.offset >= end or ref.offset + size <= start or size == 0
                taken.setdefault(ref.storage, []).append((ref.offset, ref.offset + size))


@given(refit_send_cases())
def test_a_chunk_never_waits_past_half_the_bound_for_its_next_tensor(
    case: RefitSendCase,
) -> None:
    """Once a chunk has a tensor, the sender sends it rather than add one produced later
    than ``flush_after_s`` after the last message: the receiver's wait stays bounded by
    that plus one tensor's production time."""
    assert all(w < case.flush_after_s for w in simulate(case).waited)


def _chunk_bytes(chunk: p.Chunk) -> int:
    return sum(TensorSpec(r.name, r.shape, r.dtype).nbytes for r in chunk.tensors)


@given(refit_send_cases())
def test_chunk_i_holds_at_most_the_budget_times_two_to_the_i_unless_one_tensor_exceeds_it(
    case: RefitSendCase,
) -> None:
    """Handles included: the receiver gets its first copies after one budget of bytes,
    however much of the refit goes by handle."""
    for chunk in simulate(case).events:
        if isinstance(chunk, p.Chunk) and len(chunk.tensors) > 1:
            assert _chunk_bytes(chunk) <= case.budget << chunk.index


@given(refit_budgets, st.data())
def test_a_refit_by_handle_takes_about_log2_of_its_bytes_over_the_budget_chunks(
    budget: int, data: st.DataObject
) -> None:
    """Every chunk but the last closes only when its next tensor would overflow it, so
    ``n`` bytes by handle (no tensor over the budget) take at most
    ``log2(n / budget + 1) + 2`` chunks, never a chunk per tensor."""
    sizes = data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=60))
    plan, chunks = p.ChunkPlan(budget, 1e9, 0.0), [list[int]()]
    for size in sizes:
        placed = plan.place(p.SendRoute.HANDLE, size, 0.0)
        if placed.flush:
            chunks.append([])
        chunks[-1].append(size)
        plan = placed.plan
    for index, (chunk, after) in enumerate(itertools.pairwise(chunks)):
        assert sum(chunk) <= budget << index or len(chunk) == 1
        assert sum(chunk) + after[0] > budget << index
    assert plan.index == len(chunks) - 1
    assert len(chunks) <= math.log2(sum(sizes) / budget + 1) + 2


@given(refit_send_cases(), st.data())
def test_a_missing_duplicate_or_foreign_tensor_is_refused_naming_it(
    case: RefitSendCase, data: st.DataObject
) -> None:
    manifest = Manifest.from_specs(case.specs).unwrap()
    victim = data.draw(st.sampled_from(case.specs))
    fault = data.draw(st.sampled_from(["missing", "duplicated", "unexpected", "mismatched"]))
    specs = list(case.specs)
    if fault == "missing":
        specs.remove(victim)
    elif fault == "duplicated":
        specs.append(victim)
    elif fault == "unexpected":
        victim = TensorSpec("not/in/the/manifest", (3,), "float32")
        specs.append(victim)
    else:
        victim = attrs.evolve(victim, shape=(*victim.shape, 2))
        specs = [victim if s.name == victim.name else s for s in specs]
    steps = feed(p.Receiver(manifest, routes_of(case.specs)), simulate(case, tuple(specs)).events)
    refusal = steps[-1]
    assert isinstance(refusal, p.Refusal)
    assert refusal.fatal
    assert refusal.kind is p.RefusalKind.MANIFEST
    assert refusal.detail is not None
    assert victim.name in refusal.detail.names(Deviation(fault))
    assert repr(victim.name) in str(refusal)


@given(st.lists(refit_events, max_size=8))
def test_any_event_sequence_gets_steps_or_refusals_naming_the_event(
    events: list[p.Event],
) -> None:
    specs = (TensorSpec("a", (2,), "float32"), TensorSpec("b", (3,), "int8"))
    receiver = p.Receiver(Manifest.from_specs(specs).unwrap(), p.Routes(frozenset({"a"})))
    for event in events:
        result = receiver.handle(event)
        if isinstance(result, Success):
            receiver = result.unwrap().receiver
            continue
        refusal = result.failure()
        assert isinstance(refusal, p.Refusal)
        assert refusal.event in str(refusal)
        assert event.refit_id in refusal.event
        if not refusal.fatal:  # a stray before any Begin: answered, nothing changes
            assert receiver.phase is p.Phase.IDLE
        else:
            break


# -- the receiver, case by case -----------------------------------------------------------

SPECS = (TensorSpec("a", (4,), "float32"), TensorSpec("b", (2,), "int8"))
MANIFEST = Manifest.from_specs(SPECS).unwrap()
A = p.TensorRef("a", (4,), "float32", 0, 0)
B = p.TensorRef("b", (2,), "int8", 0, 512)
OWN = (p.StorageKind.STAGING,)


def started() -> p.Receiver:
    return (
        p.Receiver(MANIFEST, p.Routes(frozenset({"a"}))).handle(p.Begin("r", "")).unwrap().receiver
    )


def test_a_receiver_says_what_it_waits_for() -> None:
    assert p.Receiver(MANIFEST).awaiting == "the start of a refit"
    assert started().awaiting == "chunk 0 or the end of refit r"


def refused(receiver: p.Receiver, event: p.Event) -> p.Refusal:
    result = receiver.handle(event)
    assert isinstance(result, Failure), result
    refusal = result.failure()
    assert isinstance(refusal, p.Refusal)
    return refusal


def test_begin_checks_the_protocol_and_the_manifest() -> None:
    idle = p.Receiver(MANIFEST)
    assert refused(idle, p.Begin("r", "", 1)).kind is p.RefusalKind.VERSION
    assert "protocol 1" in str(refused(idle, p.Begin("r", "", 1)))
    assert refused(idle, p.Begin("r", "other")).kind is p.RefusalKind.DIGEST
    step = idle.handle(p.Begin("r", MANIFEST.digest())).unwrap()
    assert step.decision == p.Accepted("r")
    # a trainer whose Begin timed out starts over, until its first chunk
    again = step.receiver.handle(p.Begin("r2", "")).unwrap()
    assert again.receiver.refit_id == "r2"
    chunked = again.receiver.handle(p.Chunk("r2", 0, (A,), (1024,), OWN)).unwrap().receiver
    assert refused(chunked, p.Begin("r3", "")).kind is p.RefusalKind.ORDER


def test_chunks_are_checked_against_their_storages() -> None:
    receiver = started()
    cases = {
        "storage 1 is not in the chunk": p.Chunk(
            "r", 0, (attrs.evolve(A, storage=1),), (1024,), OWN
        ),
        "overrun storage 0": p.Chunk("r", 0, (A,), (8,), OWN),
        "not aligned for float32": p.Chunk("r", 0, (attrs.evolve(A, offset=2),), (1024,), OWN),
        "places no tensor in a storage": p.Chunk("r", 0, (attrs.evolve(A, offset=4),)),
    }
    for why, chunk in cases.items():
        refusal = refused(receiver, chunk)
        assert refusal.detail is not None
        assert refusal.detail.names(Deviation.MISPLACED) == ("a",)
        assert why in str(refusal)
    assert "lists no tensors" in str(refused(receiver, p.Chunk("r", 0, (), (1,), OWN)))
    assert "kinds do not match" in str(refused(receiver, p.Chunk("r", 0, (A,), (1024,), ())))
    assert "chunk 0 was expected" in str(refused(receiver, p.Chunk("r", 1, (A,), (1024,), OWN)))
    assert refused(receiver, p.Chunk("x", 0, (A,), (1024,), OWN)).kind is p.RefusalKind.STRAY


def test_writes_route_each_tensor_and_copy_what_the_sender_reuses() -> None:
    receiver = started()
    for kind, copy in [(p.StorageKind.STAGING, True), (p.StorageKind.OWN, False)]:
        step = receiver.handle(p.Chunk("r", 0, (A, B), (1024,), (kind,))).unwrap()
        assert isinstance(step.decision, p.Writes)
        assert [(w.route, w.copy) for w in step.decision.writes] == [
            (p.Route.DIRECT, False),
            (p.Route.LOADER, copy),
        ]
    broadcast = receiver.handle(p.Chunk("r", 0, (A, attrs.evolve(B, offset=0)))).unwrap()
    assert isinstance(broadcast.decision, p.Writes)
    assert not any(w.copy for w in broadcast.decision.writes)


def test_end_needs_every_tensor_and_the_senders_counts() -> None:
    receiver = started().handle(p.Chunk("r", 0, (A,), (1024,), OWN)).unwrap().receiver
    refusal = refused(receiver, p.End("r", 1, 1))
    assert refusal.detail is not None
    assert refusal.detail.missing == ("b",)
    full = receiver.handle(p.Chunk("r", 1, (B,), (1024,), OWN)).unwrap().receiver
    assert "it counts 1 chunks and 2 tensors" in str(refused(full, p.End("r", 1, 2)))
    done = full.handle(p.End("r", 2, 2)).unwrap()
    assert done.decision == p.Finished(2, 2)
    assert "the refit is done" in str(refused(done.receiver, p.Abort("r", "late")))


def test_abort_fails_the_refit_and_strays_before_begin_are_not_fatal() -> None:
    step = started().handle(p.Abort("r", "the stream broke")).unwrap()
    assert step.decision == p.Aborted("the stream broke")
    assert step.receiver.phase is p.Phase.FAILED
    stray = refused(p.Receiver(MANIFEST), p.End("old", 0, 0))
    assert not stray.fatal
    assert "no refit is in progress" in str(stray)


# -- routing -------------------------------------------------------------------------------


def described(param: p.EngineParam) -> p.EngineParam:
    """``param`` as the shell describes it: an unquantized module where it is writable,
    an fp8 one's parameter otherwise (filled and contiguous either way)."""
    method = "UnquantizedLinearMethod" if param.writable else "Fp8LinearMethod"
    return p.EngineParam.of(param.spec, method, True, param.sharded)


@pytest.mark.parametrize(
    ("method", "filled", "writable"),
    [(None, True, True), ("UnquantizedEmbeddingMethod", True, True),
     ("Fp8LinearMethod", True, False), (None, False, False)],
)  # fmt: skip
def test_a_parameter_is_writable_in_an_unquantized_module_filled_and_contiguous(
    method: str | None, filled: bool, writable: bool
) -> None:
    param = p.EngineParam.of(
        TensorSpec("layers.0.proj.weight", (2,), "float32"), method, filled, True
    )
    assert (param.module, param.writable, param.sharded) == ("layers.0.proj", writable, True)


def test_a_module_goes_direct_only_with_all_its_writable_parameters() -> None:
    def param(
        name: str, shape: tuple[int, ...], *, writable: bool = True, sharded: bool = False
    ) -> p.EngineParam:
        return p.EngineParam(
            name, name.rpartition(".")[0], TensorSpec(name, shape, "float32"), writable, sharded
        )

    params = [
        param("norm.weight", (4,)),
        param("proj.weight", (3, 4)),
        param("proj.bias", (3,)),
        param("packed.weight", (0,), writable=False),
        param("tp.weight", (2,), sharded=True),
    ]
    manifest = Manifest.from_specs(
        TensorSpec(n, s, "float32")
        for n, s in [
            ("norm.weight", (4,)),
            ("proj.weight", (3, 4)),
            ("packed.weight", (2, 2)),
            ("tp.weight", (2,)),
        ]
    ).unwrap()
    routes = p.plan_routes(manifest, params, sharded_ok=False)
    assert routes == p.Routes(frozenset({"norm.weight"}), frozenset({"norm"}))
    assert routes == p.plan_routes(manifest, [described(e) for e in params], sharded_ok=False)
    assert routes.route("proj.weight") is p.Route.LOADER  # proj.bias goes to the loader
    assert p.plan_routes(manifest, params, sharded_ok=True).direct == {"norm.weight", "tp.weight"}
    assert routes.answer(manifest) == {
        "manifest_digest": manifest.digest(), "tensors": 4, "direct": 1, "loaded": 3,
    }  # fmt: skip


# -- the sender ----------------------------------------------------------------------------


def test_only_a_recognised_nonempty_local_contiguous_storage_goes_by_handle() -> None:
    good = {
        "storage_bytes": 1,  # however small: packing it would make its chunk wait a sync
        "contiguous": True,
        "local": True,
        "recognised": True,
    }
    assert p.send_route(**good) is p.SendRoute.HANDLE  # type: ignore[arg-type]
    for key, bad in [
        ("storage_bytes", 0),
        ("contiguous", False),
        ("local", False),
        ("recognised", False),
    ]:
        assert p.send_route(**{**good, key: bad}) is p.SendRoute.PACK  # type: ignore[arg-type]


@given(st.integers(0, 1 << 20), st.booleans(), st.booleans(), st.booleans())
def test_a_tensor_goes_by_handle_exactly_when_recognised_and_it_would_if_recognised(
    storage_bytes: int, contiguous: bool, local: bool, recognised: bool
) -> None:
    """What the IPC sender relies on to tell a tensor packed for good (replayed packed)
    from one packed only until its storage is recognised (sent by handle next time)."""
    facts = {"storage_bytes": storage_bytes, "contiguous": contiguous, "local": local}
    best = p.send_route(**facts, recognised=True)  # type: ignore[arg-type]
    route = p.send_route(**facts, recognised=recognised)  # type: ignore[arg-type]
    assert (route is p.SendRoute.HANDLE) == (recognised and best is p.SendRoute.HANDLE)


def test_staging_buffers_alternate_over_the_chunks_that_pack() -> None:
    plan = p.ChunkPlan(1024, 1e9, 0.0)
    assert plan.buffer == 0
    plan = plan.place(p.SendRoute.HANDLE, 10, 0.0).plan.flushed(0.0)
    assert plan.buffer == 0  # a chunk of handles only used no buffer
    plan = plan.place(p.SendRoute.PACK, 10, 0.0).plan.flushed(0.0)
    assert plan.buffer == 1
    big = plan.place(p.SendRoute.PACK, 2000, 0.0)
    assert (big.alone, big.offset, big.plan.fill) == (True, 0, 0)


# -- mappings and bounds -------------------------------------------------------------------


@given(st.lists(st.frozensets(st.integers(0, 6)), max_size=8))
def test_a_kept_mapping_is_released_by_the_first_refit_that_does_not_use_it(
    refits: list[frozenset[int]],
) -> None:
    kept: p.Kept[int] = p.Kept()
    before: frozenset[int] = frozenset()
    for used in refits:
        for key in used:
            kept = kept.use([key])
        settled = kept.settle()
        assert settled.released == before - used
        assert settled.kept.kept == used
        kept, before = settled.kept, used
    cleared = kept.clear()
    assert cleared.released == before
    assert cleared.kept == p.Kept()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0, "5", True, [1]])
def test_a_wait_bound_is_a_finite_positive_number_or_none(bad: object) -> None:
    result = p.wait_bound(bad)
    assert isinstance(result, Failure)
    assert repr(bad) in str(result.failure())
    assert result.failure().timeout_s is bad
    assert p.wait_bound(None) == Success(p.DEFAULT_TIMEOUT_S)
    assert p.wait_bound(2) == Success(2.0)


@given(
    st.integers(0, 10_000),
    st.sampled_from(list(p.Transport)),
    st.floats(1e-3, 1e6, allow_nan=False),
)
def test_the_outer_bound_exceeds_every_inner_wait_on_time(
    tensors: int, transport: p.Transport, per_wait: float
) -> None:
    waits = p.refit_waits(tensors, transport)
    assert waits >= tensors + 2
    assert p.rpc_bound(waits, per_wait) > waits * per_wait
    rendezvous = p.rpc_bound(p.RENDEZVOUS_WAITS, per_wait)
    assert rendezvous > p.RENDEZVOUS_WAITS * per_wait
    assert math.isfinite(rendezvous)


@given(refit_send_cases())
def test_the_message_cap_grows_with_the_manifest(case: RefitSendCase) -> None:
    manifest = Manifest.from_specs(case.specs).unwrap()
    cap = p.max_message_bytes(manifest)
    assert cap >= 64 * 1024 + 512 * (len(manifest) + 2)
    smaller = Manifest.from_specs(case.specs[1:]) if len(case.specs) > 1 else None
    if smaller is not None:
        assert p.max_message_bytes(smaller.unwrap()) < cap


def test_only_temporary_storages_are_unmapped_after_their_chunk() -> None:
    assert [k.kept for k in p.StorageKind] == [True, True, False]
    assert [k.stable for k in p.StorageKind] == [False, True, False]


@given(st.lists(st.sampled_from(list(p.StorageKind)), min_size=1, max_size=6))
def test_a_chunk_is_answered_before_its_copies_only_when_no_storage_is_reused(
    kinds: list[p.StorageKind],
) -> None:
    """A chunk's answer may precede the engine's copies out of it only when the sender
    reuses or frees none of its storages once answered (its own tensors only); a broadcast
    chunk's bytes are copied before it is answered, always."""
    ref = p.TensorRef("w", (1,), "float32")
    chunk = p.Chunk("r", 0, (ref,), tuple(4 for _ in kinds), tuple(kinds))
    assert chunk.stable == all(k is p.StorageKind.OWN for k in kinds)
    assert not p.Chunk("r", 0, (ref,)).stable


# -- trust ---------------------------------------------------------------------------------

FILE = p.FileFacts(True, True, 7, 7, True, 0o40700, 42, 4096)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"absolute": False}, "not absolute"),
        ({"regular": False}, "not a regular file"),
        ({"owner": 8}, "another user"),
        ({"parent_owner": 8}, "another user"),
        ({"parent_is_dir": False}, "open to other users"),
        ({"parent_mode": 0o40755}, "open to other users"),
        ({"inode": 43}, "another file"),
        ({"size": 100}, "fewer than the 4096 declared"),
    ],
)
def test_a_shared_file_is_trusted_only_when_private_and_the_senders(
    change: dict[str, object], why: str
) -> None:
    assert p.file_problem(FILE, uid=7, inode=42, size=4096) is None
    problem = p.file_problem(attrs.evolve(FILE, **change), uid=7, inode=42, size=4096)  # type: ignore[arg-type]
    assert problem is not None
    assert why in problem


def test_a_groups_topology_and_claims_are_checked_naming_the_ranks() -> None:
    trainer = p.GroupClaim(0, 3, 1, "gloo", "trainer")
    assert p.topology_problems("127.0.0.1", 29500, trainer) == ()
    bad = p.topology_problems("", 0, p.GroupClaim(5, 1, 1, "gloo", "engine"))
    assert bad == (
        "ip is empty",
        "port 0 is not in 1..65535",
        "world_size 1 leaves no one to send to",
        "train_world_size 1 must be in 1..0",
        "rank 5 is outside 0..0",
    )
    wrong_role = p.topology_problems("h", 1, p.GroupClaim(1, 3, 1, "gloo", "trainer"))
    assert wrong_role == ("rank 1 would be a engine rank, but this process is the trainer",)
    engine = p.GroupClaim(1, 3, 1, "gloo", "engine")
    assert p.claim_problems(trainer, [trainer, engine]) == ()
    odd = p.GroupClaim(2, 4, 1, "nccl", "trainer", protocol=1)
    assert p.claim_problems(trainer, [odd]) == (
        "rank 2 has world_size=4, expected 3",
        "rank 2 has backend='nccl', expected 'gloo'",
        "rank 2 has protocol=1, expected 2",
        "rank 2 has role='trainer', expected 'engine'",
    )


def test_a_report_is_a_plain_dict_for_rpc_results() -> None:
    report = p.RefitReport(3, 96, 1, 0.5, direct=2, loaded=1, phases={"wait": 0.25})
    assert report.as_dict() == {
        "tensors": 3, "nbytes": 96, "chunks": 1, "seconds": 0.5, "direct": 2,
        "loaded": 1, "mapped": 0, "phases": {"wait": 0.25},
    }  # fmt: skip


# -- the memo: a finished refit's decisions, reused by the next one ------------------------


def _decisions(out: list[p.Step | p.Refusal]) -> list[object]:
    return [o.decision if isinstance(o, p.Step) else o for o in out]


def _again(events: list[p.Event], refit_id: str) -> list[p.Event]:
    return [attrs.evolve(e, refit_id=refit_id) for e in events]


def _remembered(case: RefitSendCase) -> tuple[Manifest, p.Routes, p.Memo, list[p.Event]]:
    manifest = Manifest.from_specs(case.specs).unwrap()
    routes = routes_of(case.specs)
    events = simulate(case).events
    out = feed(p.Receiver(manifest, routes), events)
    last = out[-1]
    assert isinstance(last, p.Step)
    assert isinstance(last.decision, p.Finished)
    return manifest, routes, last.receiver.remembered(), events


@given(refit_send_cases())
def test_a_remembered_refit_decides_as_a_fresh_receiver_and_hits_every_chunk(
    case: RefitSendCase,
) -> None:
    manifest, routes, memo, events = _remembered(case)
    again = _again(events, "r2")
    fresh = feed(p.Receiver(manifest, routes), again)
    cached = feed(p.Receiver(manifest, routes, memo=memo), again)
    assert _decisions(cached) == _decisions(fresh)
    last = cached[-1]
    assert isinstance(last, p.Step)
    assert last.receiver.hits == last.receiver.chunks == len(memo.chunks) > 0


@given(refit_send_cases(), st.data())
def test_any_change_to_a_chunk_misses_the_memo_and_decides_as_a_fresh_receiver(
    case: RefitSendCase, data: st.DataObject
) -> None:
    manifest, routes, memo, events = _remembered(case)
    chunks = [i for i, e in enumerate(events) if isinstance(e, p.Chunk)]
    at = data.draw(st.sampled_from(chunks))
    chunk = events[at]
    assert isinstance(chunk, p.Chunk)
    which = data.draw(st.integers(0, len(chunk.tensors) - 1))
    ref = chunk.tensors[which]
    change = data.draw(st.sampled_from(["name", "shape", "storage", "offset", "size"]))
    changed: p.Chunk
    if change == "size":
        sizes = chunk.storages or ()
        changed = attrs.evolve(chunk, storages=tuple(s + 8 for s in sizes))
    else:
        new = {
            "name": attrs.evolve(ref, name=ref.name + ".x"),
            "shape": attrs.evolve(ref, shape=(*ref.shape, 1)),
            "storage": attrs.evolve(ref, storage=ref.storage + 1),
            "offset": attrs.evolve(ref, offset=ref.offset + 8),
        }[change]
        tensors = (*chunk.tensors[:which], new, *chunk.tensors[which + 1 :])
        changed = attrs.evolve(chunk, tensors=tensors)
    again = _again([*events[:at], changed, *events[at + 1 :]], "r2")
    fresh = feed(p.Receiver(manifest, routes), again)
    cached = feed(p.Receiver(manifest, routes, memo=memo), again)
    assert _decisions(cached) == _decisions(fresh)
    index = chunks.index(at)
    assert memo.recall(attrs.evolve(changed, refit_id="r2")) is None
    steps = [o for o in cached if isinstance(o, p.Step)]
    assert all(s.receiver.hits <= index for s in steps)


def test_a_memo_of_another_manifest_or_routes_is_dropped_at_begin() -> None:
    specs = (TensorSpec("a", (2,), "float32"), TensorSpec("b", (3,), "float32"))
    manifest = Manifest.from_specs(specs).unwrap()
    chunk = p.Chunk("r1", 0, (p.TensorRef("a", (2,), "float32"), p.TensorRef("b", (3,), "float32", 0, 8)), (32,), (p.StorageKind.OWN,))  # fmt: skip
    events: list[p.Event] = [p.Begin("r1", ""), chunk, p.End("r1", 1, 2)]
    out = feed(p.Receiver(manifest), events)
    last = out[-1]
    assert isinstance(last, p.Step)
    memo = last.receiver.remembered()
    assert len(memo.chunks) == 1
    other = p.Routes(frozenset({"a"}))
    again = feed(p.Receiver(manifest, other, memo=memo), _again(events, "r2"))
    step = again[1]
    assert isinstance(step, p.Step)
    assert step.receiver.hits == 0
    assert isinstance(step.decision, p.Writes)
    assert step.decision.writes[0].route is p.Route.DIRECT
    same = feed(p.Receiver(manifest, memo=memo), _again(events, "r2"))
    hit = same[1]
    assert isinstance(hit, p.Step)
    assert hit.receiver.hits == 1
    assert p.Receiver(manifest, memo=memo).remembered() is memo  # not finished: unchanged
    assert memo.recall(attrs.evolve(chunk, index=1)) is None


# -- CUDA IPC in the runtime (failure-modes R8) ---------------------------------------------

#: What torch raised when a trainer's CUDA IPC handle could not be opened, as reported
#: (pytorch#165685, alibaba/ROLL#417, Open-Reasoner-Zero#51, triton-server#5798, WSL2), and
#: the words of the cause each one names.
_TORCH_TAIL = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
    "assertions.\n"
)
IPC_FAILURES = {
    "pidfd_getfd: Operation not permitted": "expandable segments",
    "pidfd_open:Operation not permitted": "expandable segments",
    "The kernel on this machine does not support the pidfd_open syscall needed to use IPC "
    "for CUDA tensors when expandable_segments:True is set.": "expandable segments",
    "CUDA error: invalid resource handle" + _TORCH_TAIL: "refused the trainer's handle",
    "CUDA error: invalid device context" + _TORCH_TAIL: "refused the trainer's handle",
    "CUDA error: mapping of buffer object failed": "refused the trainer's handle",
    "CUDA error: operation not permitted": "refused the trainer's handle",
    "CUDA driver error: operation not permitted": "refused the trainer's handle",
    "cudaIpcOpenMemHandle failed: cudaErrorInvalidResourceHandle": "refused the trainer's handle",
    "failed to open CUDA IPC handle: invalid resource handle": "refused the trainer's handle",
    "CUDA error: operation not supported" + _TORCH_TAIL: "does not support CUDA IPC",
    "cuda runtime error (801) : operation not supported at StorageSharing.cpp:245": (
        "does not support CUDA IPC"
    ),
    # the CUDA runtime's and driver's names of the same errors
    "cudaErrorNotSupported": "does not support CUDA IPC",
    "CUDA_ERROR_NOT_SUPPORTED": "does not support CUDA IPC",
    "CUDA_ERROR_INVALID_HANDLE": "refused the trainer's handle",
    "cudaErrorInvalidContext": "refused the trainer's handle",
    "cudaErrorDeviceUninitialized": "refused the trainer's handle",
    "CUDA_ERROR_INVALID_CONTEXT": "refused the trainer's handle",
    "cudaErrorMapBufferObjectFailed": "refused the trainer's handle",
    "cudaErrorNotPermitted": "refused the trainer's handle",
    "CUDA_ERROR_NOT_PERMITTED": "refused the trainer's handle",
    "cuMemImportFromShareableHandle returned 1": "refused the trainer's handle",
}
#: Every fix the explanation must name, whatever the cause.
FIXES = (
    "CUDA IPC is unavailable in this runtime",
    "--ipc=host",
    "--pid=host",
    "CAP_SYS_PTRACE",
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "pidfd_open and pidfd_getfd",
    "drop expandable_segments on the trainer",
    "WSL2",
    "RefitSender.collective",
)
#: The documented signs of a runtime without CUDA IPC (casefolded): the spec the
#: word-soup law checks the function against.
SIGNS = (
    "pidfd",
    "operation not supported",
    "cudaerrornotsupported",
    "cuda_error_not_supported",
    "invalid resource handle",
    "cudaerrorinvalidresourcehandle",
    "cuda_error_invalid_handle",
    "invalid device context",
    "cudaerrorinvalidcontext",
    "cudaerrordeviceuninitialized",
    "cuda_error_invalid_context",
    "mapping of buffer object failed",
    "cudaerrormapbufferobjectfailed",
    "operation not permitted",
    "cudaerrornotpermitted",
    "cuda_error_not_permitted",
    "cudaipcopenmemhandle",
    "cumemimportfromshareablehandle",
    "failed to open cuda ipc handle",
)
#: Words of CUDA and refit errors, so random sentences come near the signs and cross them.
WORDS = (
    "CUDA", "error:", "invalid", "resource", "handle", "device", "context", "argument",
    "operation", "not", "permitted", "supported", "mapping", "of", "buffer", "object",
    "failed", "out", "memory", "pid", "fd", "pidfd_open:", "cudaIpcOpenMemHandle", "open",
    "to", "IPC", "illegal", "access", "RuntimeError:", "cudaErrorInvalidValue", "\n",
)  # fmt: skip
UNRELATED = (
    "",
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
    "CUDA error: an illegal memory access was encountered" + _TORCH_TAIL,
    "CUDA error: device-side assert triggered",
    "CUDA error: invalid argument",
    "Expected all tensors to be on the same device, but found cuda:0 and cuda:1!",
    "No CUDA GPUs are available",
    "NCCL error: unhandled system error, NCCL version 2.21.5",
    "Connection reset by peer",
)


@pytest.mark.parametrize(("text", "cause"), list(IPC_FAILURES.items()))
def test_known_cuda_ipc_failures_are_explained_with_their_cause_and_every_fix(
    text: str, cause: str
) -> None:
    explained = p.explain_cuda_ipc_failure(text)
    assert explained is not None
    assert cause in explained
    for fix in FIXES:
        assert fix in explained, fix


@pytest.mark.parametrize("text", UNRELATED)
def test_other_torch_and_transport_errors_are_not_explained(text: str) -> None:
    assert p.explain_cuda_ipc_failure(text) is None


@given(st.sampled_from(sorted(IPC_FAILURES)), st.text(), st.text(), st.booleans())
def test_a_known_failure_is_recognised_anywhere_in_any_case_and_noise_changes_nothing(
    known: str, before: str, after: str, upper: bool
) -> None:
    """Torch wraps the same text in tracebacks, prefixes and changing case: recognised the
    same, with the same advice, whatever surrounds it (unless that names a sign too)."""
    text = f"{before}\n{known.upper() if upper else known}\n{after}"
    explained = p.explain_cuda_ipc_failure(text)
    assert explained is not None
    if p.explain_cuda_ipc_failure(f"{before}\n{after}") is None:
        assert explained == p.explain_cuda_ipc_failure(known)


@given(st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join) | st.text())
def test_text_is_explained_exactly_when_it_names_a_sign(text: str) -> None:
    explained = p.explain_cuda_ipc_failure(text)
    named = any(sign in text.casefold() for sign in SIGNS)
    assert (explained is not None) == named
    if explained is not None:
        assert all(fix in explained for fix in FIXES)


# -- dtypes against the engine's parameters (issue 44 item 2) ---------------------------

_FLOATS = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float64")
_OTHERS = ("int32", "int16", "int8", "uint8", "int64", "bool", "complex64")
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@given(
    param=st.sampled_from(_FLOATS),
    declared=st.sampled_from(_FLOATS + _OTHERS),
    shard=st.sampled_from(("", "q_proj", "k_proj", "v_proj")),
)
def test_a_float_parameter_takes_any_float_and_refuses_the_rest_naming_both_dtypes(
    param: str, declared: str, shard: str
) -> None:
    """Law: a tensor loading into a floating-point parameter (itself, or the packed one
    its module is a shard of) is refused exactly when its declared dtype is not a float,
    the error naming the tensor, both dtypes and the parameter it loads into."""
    engine = "model.layers.0.self_attn.qkv_proj.weight" if shard else "model.norm.weight"
    name = f"model.layers.0.self_attn.{shard}.weight" if shard else engine
    manifest = Manifest.from_specs([TensorSpec(name, (4,), declared)]).unwrap()
    result = p.dtype_problems(manifest, {engine: param, "lm_head.weight": "float32"}, _PACKED)
    if declared in _FLOATS:
        assert result == Success(manifest)
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert error.mismatched == (name,)
    assert f"{name!r} is declared {declared}" in str(error)
    assert param in str(error)
    assert (f"parameter {engine!r}" in str(error)) == bool(shard)


@given(declared=st.sampled_from(_FLOATS + _OTHERS), param=st.sampled_from(_OTHERS))
def test_non_float_parameters_and_unknown_tensors_are_left_to_the_loader(
    declared: str, param: str
) -> None:
    """Law: a packed quantized parameter (not a float) and a tensor no parameter takes are
    not this check's business: it passes them."""
    manifest = Manifest.from_specs(
        [
            TensorSpec("model.layers.0.mlp.gate_proj.qweight", (4,), declared),
            TensorSpec("model.rotary.inv_freq", (4,), declared),
            TensorSpec("model.layers.1.mlp.up_proj.weight", (4,), declared),  # no such layer
        ]
    ).unwrap()
    params = {"model.layers.0.mlp.gate_up_proj.qweight": param}
    assert p.dtype_problems(manifest, params, _PACKED) == Success(manifest)


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=12, unique=True))
def test_a_nonfinite_refusal_names_the_first_eight_tensors_and_counts_the_rest(
    names: list[str],
) -> None:
    said = p.nonfinite_refusal("chunk 3", names, "the weights are as before")
    assert said.startswith("chunk 3: refused, non-finite values (NaN or inf) in ")
    assert all(repr(n) in said for n in names[:8])
    assert (f" and {len(names) - 8} more" in said) is (len(names) > 8)
    assert "the weights are as before (vllm_cfg.refit_finite_check: false" in said


@given(
    shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    dtype=st.sampled_from([("float32", 4), ("bfloat16", 2), ("uint8", 1), ("int64", 8)]),
)
def test_a_tensor_refs_bytes(shape: tuple[int, ...], dtype: tuple[str, int]) -> None:
    """A listed tensor takes its elements times its dtype's size, wherever it lies."""
    ref = p.TensorRef("w", shape, dtype[0], 1, 64)
    assert ref.nbytes == math.prod(shape) * dtype[1] == TensorSpec("w", shape, dtype[0]).nbytes


_sent_chunks = st.lists(
    st.lists(
        st.tuples(st.integers(0, 3), st.none() | st.tuples(st.integers(0, 1), st.integers(0, 64))),
        min_size=1,
        max_size=4,
    ),
    max_size=4,
)


def _replay(chunks: list[list[tuple[int, tuple[int, int] | None]]]) -> p.Replay[str]:
    replay: p.Replay[str] = p.Replay()
    for index, chunk in enumerate(chunks):
        sent = tuple(
            p.Sent(("t", index, i, tag), f"ref{tag}", packed)
            for i, (tag, packed) in enumerate(chunk)
        )
        replay = replay.add(p.SentChunk(f"listing {index}".encode(), sent, 10 * len(sent)))
    return replay


@given(_sent_chunks)
def test_a_replay_expects_what_was_sent_in_order_at_the_same_place(
    chunks: list[list[tuple[int, tuple[int, int] | None]]],
) -> None:
    """Each chunk's tensors come back in order at their places, each its reference and
    packing; a tensor at another place, or past the last chunk, is not the replay's."""
    replay = _replay(chunks)
    assert [c.listing for c in replay.chunks] == [
        f"listing {i}".encode() for i in range(len(chunks))
    ]
    for index, chunk in enumerate(chunks):
        assert replay.chunks[index].by_handle == sum(packed is None for _, packed in chunk)
        for held, (tag, packed) in enumerate(chunk):
            here = replay.expects(index, held, ("t", index, held, tag))
            assert here is not None
            assert (here.ref, here.packed) == (f"ref{tag}", packed)
            assert replay.expects(index, held, ("t", index, held, tag + 1)) is None
    assert replay.expects(len(chunks), 0, ("t", len(chunks), 0, 0)) is None


@given(
    st.lists(st.integers()),
    st.dictionaries(st.sampled_from(["prefix", "mm", "encoder"]), st.floats(0, 10)),
)
def test_a_refit_report_holds_the_workers_reports_its_fields_and_each_resets_seconds(
    reports: list[int], resets: dict[str, float]
) -> None:
    report = p.refit_report(reports, resets, adapter="a")
    assert report["engine_workers"] == reports
    assert report["adapter"] == "a"
    for cache, seconds in resets.items():
        assert report[f"reset_{cache}_cache_seconds"] == seconds
    assert len(report) == 2 + len(resets)


@given(st.lists(st.floats(0, 1e6), min_size=4, max_size=4).map(sorted))
def test_an_inflight_refits_pause_and_resume_add_up_to_the_whole_pause(
    clock: list[float],
) -> None:
    started, paused, rpc_done, resumed = clock
    seconds = p.inflight_seconds(started, paused, rpc_done, resumed)
    assert seconds["pause_seconds"] == paused - started
    assert seconds["resume_seconds"] == resumed - rpc_done
    assert seconds["paused_seconds"] == resumed - started
    assert min(seconds.values()) >= 0


@given(st.floats(0.001, 1e6) | st.none())
def test_a_group_join_waits_its_bound_rendezvous_times_and_a_grace(timeout_s: float | None) -> None:
    bound, outer = p.rendezvous_bounds(timeout_s).unwrap()
    assert bound == (p.DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    assert outer == p.rpc_bound(p.RENDEZVOUS_WAITS, bound) > p.RENDEZVOUS_WAITS * bound


def test_a_group_joins_bad_timeout_is_refused_as_wait_bound_refuses_it() -> None:
    assert p.rendezvous_bounds(-1) == p.wait_bound(-1)
