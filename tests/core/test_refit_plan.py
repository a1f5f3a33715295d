"""Laws of the refit manifest and its values (the protocol's are in test_refit_protocol)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success
from strategies import refit_shapes, refit_specs

from genworker.core.refit_plan import (
    DTYPE_ITEMSIZE,
    Deviation,
    Manifest,
    ManifestError,
    TensorProblem,
    TensorSpec,
    align_up,
    bucket_budget,
    dtype_name,
    manifest_error,
)


def _error(result: object) -> ManifestError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, ManifestError)
    return error


def test_invalid_budget_is_refused() -> None:
    for bad in (0, -512, 100, 513, 1.5, True, "512"):
        result = bucket_budget(bad)
        assert isinstance(result, Failure)
        assert repr(bad) in str(result.failure())
        assert result.failure().budget_bytes == bad
    assert bucket_budget(1024) == Success(1024)


@given(st.integers(0, 1 << 20))
def test_align_up_is_the_least_multiple_of_512_holding_the_bytes(nbytes: int) -> None:
    aligned = align_up(nbytes)
    assert aligned % 512 == 0
    assert nbytes <= aligned < nbytes + 512


# -- values ---------------------------------------------------------------------------


@given(refit_shapes, st.sampled_from(sorted(DTYPE_ITEMSIZE)))
def test_spec_of_a_tensor_matches_its_bytes(shape: tuple[int, ...], dtype: str) -> None:
    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    spec = TensorSpec.of("w", tensor)
    assert spec.nbytes == tensor.numel() * tensor.element_size()
    assert DTYPE_ITEMSIZE[dtype] == tensor.element_size()
    assert spec.describe() == f"{list(shape)} {dtype}"


def test_dtype_names_are_normalised() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("torch.float32") == "float32"
    assert dtype_name("int8") == "int8"


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", ""), ("shape", (-1,)), ("shape", [2]), ("shape", (True,)), ("dtype", "float128")],
)
def test_spec_invariants(field: str, value: object) -> None:
    good = {"name": "w", "shape": (2,), "dtype": "float32"}
    with pytest.raises(ValueError, match=field if field != "name" else "name"):
        TensorSpec(**{**good, field: value})  # type: ignore[arg-type]


def test_a_manifest_needs_unique_names() -> None:
    with pytest.raises(ValueError, match="unique"):
        Manifest(())


# -- the manifest ---------------------------------------------------------------------


@given(refit_specs(min_size=1))
def test_info_round_trips(specs: list[TensorSpec]) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    again = Manifest.from_info(manifest.to_info()).unwrap()
    assert again == manifest
    assert again.digest() == manifest.digest()
    assert len(again) == len(specs)
    assert again.names == tuple(s.name for s in specs)
    assert again.total_bytes == sum(s.nbytes for s in specs)
    assert all(s.name in again for s in specs)


@given(refit_specs(min_size=2), st.randoms())
def test_digest_ignores_order_but_not_content(specs: list[TensorSpec], rng: object) -> None:
    manifest = Manifest.from_specs(specs).unwrap()
    shuffled = list(specs)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    assert Manifest.from_specs(shuffled).unwrap().digest() == manifest.digest()
    changed = [attrs.evolve(specs[0], shape=(*specs[0].shape, 1)), *specs[1:]]
    assert Manifest.from_specs(changed).unwrap().digest() != manifest.digest()


def test_info_accepts_torch_dtypes_and_sizes() -> None:
    info: dict[object, object] = {
        "a": (torch.Size([2, 3]), torch.bfloat16),
        "b": ([4], "torch.float32"),
    }
    manifest = Manifest.from_info(info).unwrap()
    assert manifest.get("a") == TensorSpec("a", (2, 3), "bfloat16")
    assert manifest.get("b") == TensorSpec("b", (4,), "float32")
    assert manifest.get("c") is None


def test_invalid_info_names_every_bad_entry() -> None:
    info: dict[object, object] = {
        "ok": ([1], "float32"),
        "neg": ([2, -1], "float32"),
        "float_dim": ([2.0], "float32"),
        "bad_dtype": ([2], "float128"),
        "not_a_dtype": ([2], 7),
        "not_a_pair": [2],
        "": ([1], "float32"),
        3: ([1], "float32"),
    }
    error = _error(Manifest.from_info(info))
    bad = {p.name for p in error.problems}
    assert bad == {"neg", "float_dim", "bad_dtype", "not_a_dtype", "not_a_pair", "", "3"}
    assert all(p.kind is Deviation.INVALID for p in error.problems)
    for name in ("neg", "float_dim", "bad_dtype", "not_a_pair"):
        assert repr(name) in str(error)


def test_empty_manifest_is_refused() -> None:
    assert "no tensors" in str(_error(Manifest.from_info({})))
    assert "no tensors" in str(_error(Manifest.from_specs([])))


def test_duplicate_specs_are_refused() -> None:
    spec = TensorSpec("w", (1,), "float32")
    error = _error(Manifest.from_specs([spec, spec]))
    assert error.duplicated == ("w",)


def test_long_problem_lists_are_summarised_but_complete() -> None:
    problems = [TensorProblem(f"t{i}", Deviation.MISSING, "never arrived") for i in range(40)]
    error = manifest_error("the refit ended incomplete", problems)
    assert len(error.missing) == 40
    assert "and 28 more" in str(error)
    assert error.unexpected == error.mismatched == error.duplicated == ()
