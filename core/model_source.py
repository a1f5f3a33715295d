"""Where ``model_name`` points: a local directory or a Hugging Face Hub id, decided up front.

Theory of operation
-------------------
vLLM (0.32, ``vllm/transformers_utils/config.py``) treats any ``model`` that is not an
existing directory as a Hub id: a mistyped local path costs a round of Hub retries and ends
in ``huggingface_hub``'s "Repo id must be in the form 'repo_name' or
'namespace/repo_name'". :func:`classify_model` refuses such a name at config load, from
what the filesystem says about it (``is_dir``, ``exists``: the shell asks, core decides):

* an existing directory is a local model;
* anything else that exists (a file) is refused: a model is a directory;
* a name written as a path (absolute, ``~``, ``./``, ``../``, ``.`` or ``..``) that is not a
  directory is refused: the user meant a local model;
* otherwise the name must have the shape of a Hub id, ``name`` or ``org/name``
  (``huggingface_hub.utils.validate_repo_id``: letters, digits, ``-``, ``_``, ``.``, each
  part starting and ending with a letter, digit or ``_``; no ``--`` or ``..``; at most 96
  characters a part; not ending in ``.git``); a name of
  another shape (``models/llama/7b``, spaces) is refused as neither.
"""

from __future__ import annotations

import enum
import re
from typing import Final

from returns.result import Failure, Result, Success

from genworker.core.config import ConfigError, ConfigProblem

__all__ = ["ModelSource", "classify_model", "is_hub_id", "looks_like_local_path"]

_HUB_PART: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?")
_PATH_PREFIXES: Final = ("/", "~", "./", "../")


class ModelSource(enum.Enum):
    """Where vLLM will read the model from."""

    LOCAL_DIRECTORY = "a local directory"
    HUB_ID = "a Hugging Face Hub id"


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` is written as a filesystem path (not a Hub id)."""
    return name in (".", "..") or name.startswith(_PATH_PREFIXES)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face Hub repo id (``name`` or
    ``org/name``)."""
    parts = name.split("/")
    return (
        len(parts) <= 2
        and all(_HUB_PART.fullmatch(part) for part in parts)
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
    )


def classify_model(name: str, *, is_dir: bool, exists: bool) -> Result[ModelSource, ConfigError]:
    """``model_name``'s source, or a :class:`ConfigError` naming ``model_name`` when it
    cannot be a model (see the module docstring). ``is_dir`` and ``exists`` are what the
    filesystem says about ``name`` (``~`` expanded)."""
    if is_dir:
        return Success(ModelSource.LOCAL_DIRECTORY)
    if exists:
        why = "is a file, not a model directory"
    elif looks_like_local_path(name):
        why = "no such directory (a local model is a directory of config.json and weights)"
    elif is_hub_id(name):
        return Success(ModelSource.HUB_ID)
    else:
        why = (
            "no such directory, and not a Hugging Face Hub id either (Hub ids are 'name' "
            "or 'org/name')"
        )
    return Failure(ConfigError.from_problems([ConfigProblem("model_name", f"{name!r}: {why}")]))
