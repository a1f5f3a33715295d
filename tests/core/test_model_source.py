"""Laws and documented cases for ``genworker.core.model_source``: a local path that is not
a directory is refused naming ``model_name``, before vLLM asks the Hub."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.config import ConfigError
from genworker.core.model_source import (
    ModelSource,
    classify_model,
    is_hub_id,
    looks_like_local_path,
)

# the strategies are this module's own: tests/strategies.py is being edited elsewhere
names = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["/", "~", "./", "../", ".", ".."]).flatmap(
        lambda prefix: st.text(max_size=12).map(lambda rest: prefix + rest)
    ),
    st.from_regex(r"[A-Za-z0-9_.\-]{1,12}(/[A-Za-z0-9_.\-]{1,12}){0,3}", fullmatch=True),
)


def refusal(result: object) -> ConfigError:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, ConfigError)
    return error


@pytest.mark.parametrize(
    ("name", "is_dir", "exists", "expected"),
    [
        ("/models/llama", True, True, ModelSource.LOCAL_DIRECTORY),
        ("models/tiny-llama", True, True, ModelSource.LOCAL_DIRECTORY),
        ("Qwen/Qwen3-0.6B", False, False, ModelSource.HUB_ID),
        ("gpt2", False, False, ModelSource.HUB_ID),
        ("meta-llama/Llama-3.1-8B_v2.x", False, False, ModelSource.HUB_ID),
    ],
)
def test_directories_and_hub_ids_are_accepted(
    name: str, is_dir: bool, exists: bool, expected: ModelSource
) -> None:
    assert classify_model(name, is_dir=is_dir, exists=exists) == Success(expected)


@pytest.mark.parametrize(
    ("name", "exists", "says"),
    [
        ("/no/such/model", False, "no such directory"),
        ("~/models/llama", False, "no such directory"),
        ("./llama", False, "no such directory"),
        ("../llama", False, "no such directory"),
        ("..", False, "no such directory"),
        ("models/llama/7b", False, "not a Hugging Face Hub id"),
        ("my model", False, "not a Hugging Face Hub id"),
        ("org/name.git", False, "not a Hugging Face Hub id"),
        ("org--x/name", False, "not a Hugging Face Hub id"),
        ("", False, "not a Hugging Face Hub id"),
        ("config.json", True, "is a file, not a model directory"),
        ("/models/llama/model.safetensors", True, "is a file"),
    ],
)
def test_a_path_that_is_not_a_directory_is_refused_naming_model_name(
    name: str, exists: bool, says: str
) -> None:
    error = refusal(classify_model(name, is_dir=False, exists=exists))
    assert error.keys == ("model_name",)
    assert says in error.message
    assert repr(name) in error.message


@given(names)
def test_a_directory_is_always_a_local_model(name: str) -> None:
    assert classify_model(name, is_dir=True, exists=True) == Success(ModelSource.LOCAL_DIRECTORY)


@given(names)
def test_an_existing_file_is_never_a_model(name: str) -> None:
    assert refusal(classify_model(name, is_dir=False, exists=True)).keys == ("model_name",)


@given(names)
def test_a_missing_name_is_a_hub_id_exactly_when_it_is_not_written_as_a_path(name: str) -> None:
    result = classify_model(name, is_dir=False, exists=False)
    if looks_like_local_path(name) or not is_hub_id(name):
        assert refusal(result).keys == ("model_name",)
    else:
        assert result == Success(ModelSource.HUB_ID)
        assert name.count("/") <= 1


@given(names)
def test_a_name_written_as_a_path_is_never_a_hub_id(name: str) -> None:
    if looks_like_local_path(name):
        assert not is_hub_id(name)
