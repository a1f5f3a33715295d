"""Issue 43 on the drop-ins (fake engines): stop-string modes, stop strings without a
detokenizer, NeMo-RL's batch modules, sleep without sleep mode, unknown keys, and the
methods NeMo-RL added (``update_sampling_params``, token capture)."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from async_helpers import async_config
from helpers import base_config, right_padded

from genworker.core.stops import StopMode
from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineStateError,
    UnsupportedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.nemo_rl import SAMPLING_KEYS, NemoRlGenerationWorker
from genworker.shell.nemo_rl_async import NemoRlAsyncGenerationWorker
from genworker.shell.nemo_rl_batches import (
    NEMO_RL_BATCH_MODULES,
    NemoRlEnvironmentError,
    require_batch_modules,
)

MAX_NEW = 24


def _sync(config: dict[str, Any], **engine: Any) -> tuple[NemoRlGenerationWorker, FakeEngine]:
    factory = FakeEngineFactory(max_model_len=64, **engine)
    worker = NemoRlGenerationWorker(config, [0], engine_factory=factory)
    return worker, factory.started[-1][1]


def _async(
    config: dict[str, Any], **engine: Any
) -> tuple[NemoRlAsyncGenerationWorker, FakeAsyncEngine]:
    factory = FakeAsyncEngineFactory(max_model_len=64, **engine)
    worker = NemoRlAsyncGenerationWorker(config, [0], engine_factory=factory)
    return worker, factory.started[-1][1]


def _config(**top: Any) -> dict[str, Any]:
    vllm_cfg = top.pop("vllm_cfg", {})
    return base_config(
        max_new_tokens=MAX_NEW, ignore_eos=True, vllm_cfg={"max_model_len": 64, **vllm_cfg}, **top
    )


# --- item 3: stop_strings_mode ---------------------------------------------------------------


PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10], [11, 12]]


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _text(ids: Any) -> str:
    """The fake's detokenisation: one letter per id."""
    return "".join(LETTERS[int(t) % 26] for t in ids)


def _sync_texts(prompts: list[list[int]]) -> list[str]:
    """Each row's generated text without stop strings on the sync fake."""
    worker, _ = _sync(_config())
    out = worker.generate(right_padded(prompts), greedy=True)
    return [_text(out["output_ids"][i, len(p) : len(p) + MAX_NEW]) for i, p in enumerate(prompts)]


def _async_texts(prompts: list[list[int]]) -> list[str]:
    """The same on the async fake (its tokens are its own)."""

    async def main() -> list[str]:
        worker, _ = _async(_async_config())
        got = {
            row: out async for row, out in worker.generate_async(right_padded(prompts), greedy=True)
        }
        return [
            _text(got[i]["output_ids"][0, len(p) : len(p) + MAX_NEW]) for i, p in enumerate(prompts)
        ]

    return asyncio.run(main())


def _async_config(**top: Any) -> dict[str, Any]:
    return async_config(
        max_new_tokens=MAX_NEW, ignore_eos=True, vllm_cfg={"max_model_len": 64}, **top
    )


def _issue_batch(
    texts_of: Callable[[list[list[int]]], list[str]],
) -> tuple[list[list[int]], list[list[str] | None]]:
    """The issue's shape: row 0 stops on its own string at 16, row 1's string never shows in
    its own text (24), row 2 stops on its own string at 1, and row 3 (no strings) meets
    row 1's string at 13 and no other row's string before it. The prompt of row 2 is
    searched for (the fakes are deterministic) so that its first letter shows nowhere else
    before those ends."""

    def first_end(text: str, candidates: list[str]) -> int:
        ends = [text.find(s) + len(s) for s in candidates if s in text]
        return min(ends, default=MAX_NEW)

    for k in range(13, 400):
        prompts = [*PROMPTS[:2], [k, k + 1], PROMPTS[3]]
        t0, t1, t2, t3 = texts_of(prompts)
        strings: list[list[str] | None] = [[t0[12:16]], [t3[9:13]], [t2[0]], None]
        union = [s for row in strings if row for s in row]
        if (
            first_end(t0, [t0[12:16]]) == 16
            and first_end(t1, [t3[9:13]]) == MAX_NEW
            and first_end(t3, union) == 13
            and first_end(t0, union) == 16
            and first_end(t1, union) == MAX_NEW
            and first_end(t2, union) == 1
        ):
            return prompts, strings
    raise AssertionError("no prompt gives the issue's batch shape")


@pytest.mark.parametrize(
    ("mode", "lengths"),
    [(None, [16, 24, 1, 24]), ("per_sample", [16, 24, 1, 24]), ("batch_union", [16, 24, 1, 13])],
)
def test_stop_strings_mode_gives_genworkers_or_nemo_rls_lengths(
    mode: str | None, lengths: list[int]
) -> None:
    prompts, strings = _issue_batch(_sync_texts)
    config = _config() if mode is None else _config(stop_strings_mode=mode)
    worker, _ = _sync(config)
    assert worker._worker is not None
    assert worker._worker.stop_mode is StopMode(mode or "per_sample")
    out = worker.generate({**right_padded(prompts), "stop_strings": strings}, greedy=True)
    assert out["generation_lengths"].tolist() == lengths


def test_the_async_drop_in_takes_the_same_mode() -> None:
    prompts, strings = _issue_batch(_async_texts)

    async def lengths(mode: str) -> list[int]:
        worker, _ = _async(_async_config(stop_strings_mode=mode))
        data = {**right_padded(prompts), "stop_strings": strings}
        got = {row: out async for row, out in worker.generate_async(data, greedy=True)}
        return [int(got[i]["generation_lengths"][0]) for i in range(len(prompts))]

    assert asyncio.run(lengths("batch_union")) == [16, 24, 1, 13]
    assert asyncio.run(lengths("per_sample")) == [16, 24, 1, 24]


# --- item 4: stop strings without a detokenizer -------------------------------------------------


def test_per_row_stop_strings_without_a_detokenizer_are_refused_before_the_engine() -> None:
    worker, engine = _sync(_config(vllm_cfg={"skip_tokenizer_init": True}))
    data = {**right_padded([[3, 4], [5, 6]]), "stop_strings": [None, ["</a>"]]}
    with pytest.raises(BadBatchError, match=r"rows \[1\].*skip_tokenizer_init"):
        worker.generate(data)
    with pytest.raises(BadBatchError, match="skip_tokenizer_init"):
        worker.generate_text({"prompts": ["ab"], "stop_strings": [["b"]]})
    assert not engine.requests
    out = worker.generate({**right_padded([[3, 4], [5, 6]]), "stop_strings": [None, None]})
    assert out["generation_lengths"].tolist() == [MAX_NEW, MAX_NEW]


def test_the_async_drop_in_refuses_them_too() -> None:
    async def main() -> None:
        config = async_config(
            max_new_tokens=4, vllm_cfg={"max_model_len": 64, "skip_tokenizer_init": True}
        )
        worker, engine = _async(config)
        data = {**right_padded([[3, 4]]), "stop_strings": [["x"]]}
        with pytest.raises(BadBatchError, match="skip_tokenizer_init"):
            async for _ in worker.generate_async(data):
                pass
        with pytest.raises(BadBatchError, match="skip_tokenizer_init"):
            async for _ in worker.generate_text_async({"prompts": ["a"], "stop_strings": [["x"]]}):
                pass
        assert engine.num_unfinished() == 0

    asyncio.run(main())


def test_config_stop_strings_with_skip_tokenizer_init_do_not_build_a_worker() -> None:
    config = _config(stop_strings=["</a>"], vllm_cfg={"skip_tokenizer_init": True})
    with pytest.raises(BadConfigError, match=r"stop_strings.*skip_tokenizer_init"):
        NemoRlGenerationWorker(config, [0], engine_factory=FakeEngineFactory())


# --- item 5: NeMo-RL's batch modules --------------------------------------------------------


def _fake_nemo_rl(tmp_path: Any) -> None:
    """A package laid out as NeMo-RL's: a generic BatchedDataDict and a TypedDict spec."""
    root = tmp_path / "nemo_rl"
    (root / "distributed").mkdir(parents=True)
    (root / "models" / "generation").mkdir(parents=True)
    for d in (root, root / "distributed", root / "models"):
        (d / "__init__.py").write_text("")
    (root / "distributed" / "batched_data_dict.py").write_text(
        "from typing import Generic, TypeVar\n"
        "T = TypeVar('T')\n"
        "class BatchedDataDict(dict, Generic[T]):\n    pass\n"
    )
    (root / "models" / "generation" / "__init__.py").write_text(
        "import os\nassert os.environ.get('FAKE_NEMO_RL_OK') == '1', 'transformers<5.12'\n"
    )
    (root / "models" / "generation" / "interfaces.py").write_text(
        "from typing import TypedDict\nclass GenerationDatumSpec(TypedDict):\n    input_ids: list\n"
    )


@pytest.fixture
def fake_nemo_rl(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    _fake_nemo_rl(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        del sys.modules[name]


def test_unpickling_nemo_rls_batch_imports_its_generation_package(
    fake_nemo_rl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mechanism of item 5: the generic alias pickles the spec's module by reference."""
    monkeypatch.setenv("FAKE_NEMO_RL_OK", "1")
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # type: ignore[import-not-found]
    from nemo_rl.models.generation.interfaces import (  # type: ignore[import-not-found]
        GenerationDatumSpec,
    )

    blob = pickle.dumps(BatchedDataDict[GenerationDatumSpec]({"input_ids": [1]}))
    for name in [n for n in sys.modules if n.startswith("nemo_rl.models")]:
        del sys.modules[name]
    monkeypatch.setenv("FAKE_NEMO_RL_OK", "0")
    with pytest.raises(AssertionError, match=r"transformers<5\.12"):
        pickle.loads(blob)


def test_a_venv_that_cannot_import_nemo_rls_batch_modules_fails_at_construction(
    fake_nemo_rl: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NEMO_RL_OK", "0")
    with pytest.raises(NemoRlEnvironmentError) as info:
        NemoRlGenerationWorker(_config(), [0], engine_factory=FakeEngineFactory())
    message = str(info.value)
    assert "nemo_rl.models.generation.interfaces" in message
    assert "AssertionError: transformers<5.12" in message
    assert "BatchedDataDict" in message
    monkeypatch.setenv("FAKE_NEMO_RL_OK", "1")
    assert require_batch_modules() is True
    worker, _ = _sync(_config())
    assert worker.is_alive()


NEMO_RL_SRC = os.environ.get("GENWORKER_NEMO_RL_SRC")


@pytest.mark.skipif(
    not NEMO_RL_SRC,
    reason="GENWORKER_NEMO_RL_SRC is not set (a NeMo-RL source tree, e.g. 7ea279ab's nemo_rl/ "
    "parent): NeMo-RL's own modules are not checked against this venv",
)
def test_nemo_rls_own_source_is_checked_against_this_venv_at_construction() -> None:
    """With NeMo-RL's real source importable: its batch modules either import (the drop-in
    builds) or the drop-in refuses to build, naming the module and NeMo-RL's own error (at
    7ea279ab with transformers >= 5.12: its tokenizer patch's assertion)."""
    code = (
        "from genworker.shell.nemo_rl_batches import NemoRlEnvironmentError, require_batch_modules\n"
        "try:\n"
        "    print('imported', require_batch_modules())\n"
        "except NemoRlEnvironmentError as e:\n"
        "    print('refused', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(NEMO_RL_SRC)}
    done = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith(("imported True", "refused")), out
    if out.startswith("refused"):
        assert "nemo_rl.distributed.batched_data_dict" in out or "interfaces" in out
        assert "BatchedDataDict[GenerationDatumSpec]" in out


def test_without_nemo_rl_the_drop_in_warns_once_and_reads_plain_mappings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="genworker.shell.nemo_rl_batches"):
        assert require_batch_modules(find_spec=lambda name: None) is False
    (record,) = caplog.records
    assert "BatchedDataDict" in record.getMessage()


def test_the_batch_modules_are_imported_in_order_and_any_import_error_is_named() -> None:
    seen: list[str] = []

    def failing(name: str) -> object:
        seen.append(name)
        if name.endswith("interfaces"):
            raise ImportError("no module named transformers")
        return types.ModuleType(name)

    with pytest.raises(NemoRlEnvironmentError, match="ImportError: no module named transformers"):
        require_batch_modules(find_spec=lambda name: object(), import_module=failing)
    assert tuple(seen) == NEMO_RL_BATCH_MODULES

    def broken_spec(name: str) -> object:
        raise ValueError("nemo_rl.__spec__ is None")

    assert require_batch_modules(find_spec=broken_spec) is False


# --- item 6: sleep and wake without sleep mode ---------------------------------------------------


def test_sleep_and_wake_without_sleep_mode_are_a_no_op_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, engine = _sync(_config(), sleep_mode=False)
    with caplog.at_level(logging.WARNING, logger="genworker"):
        for _ in range(3):  # NeMo-RL's colocated loop: sleep, wake weights, refit, wake kv
            worker.sleep()
            worker.wake_up(tags=["weights"])
            worker.wake_up(tags=["kv_cache"])
    said = [r.getMessage() for r in caplog.records if "sleep mode" in r.getMessage()]
    assert len(said) == 1
    assert "no-op" in said[0]
    assert not any(c.startswith(("sleep", "wake")) for c in engine.calls)
    assert worker.generate(right_padded([[3, 4]]))["output_ids"].shape[0] == 1
    with pytest.raises(BadArgumentError, match="takes only tags"):
        worker.wake_up(level=1)
    worker.shutdown()
    with pytest.raises(EngineStateError, match="shut down"):
        worker.sleep()


def test_with_sleep_mode_the_drop_in_still_sleeps() -> None:
    worker, engine = _sync(_config())
    worker.sleep()
    worker.wake_up()
    assert any(c.startswith("sleep") for c in engine.calls)


def test_the_async_drop_in_sleeps_the_same_way(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[str]:
        worker, engine = _async(async_config(vllm_cfg={"max_model_len": 64}), sleep_mode=False)
        with caplog.at_level(logging.WARNING, logger="genworker"):
            await worker.sleep_async()
            await worker.wake_up_async(tags=["weights"])
            await worker.wake_up_async()
        return engine.calls

    calls = asyncio.run(main())
    assert not any(c.startswith(("sleep", "wake")) for c in calls)
    assert sum("sleep mode" in r.getMessage() for r in caplog.records) == 1


# --- item 8: unknown keys, update_sampling_params, token capture ---------------------------------


def test_an_unknown_key_is_refused_or_under_warn_logged_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(BadConfigError, match=r"zz_future_key.*unknown_keys: warn"):
        NemoRlGenerationWorker(_config(zz_future_key=1), [0], engine_factory=FakeEngineFactory())
    with caplog.at_level(logging.WARNING, logger="genworker"):
        worker, _ = _sync(_config(zz_future_key=1, unknown_keys="warn"))
    said = [r.getMessage() for r in caplog.records if "zz_future_key" in r.getMessage()]
    assert len(said) == 1
    assert "no effect" in said[0]
    assert worker.is_alive()


def test_update_sampling_params_changes_the_next_requests_and_returns_true() -> None:
    worker, engine = _sync(_config())
    assert worker.update_sampling_params(temperature=0.5, top_k=7, max_new_tokens=3) is True
    worker.generate(right_padded([[3, 4]]))
    (_, spec) = engine.requests[-1]
    assert (spec.temperature, spec.top_k, spec.max_tokens) == (0.5, 7, 3)
    assert worker.cfg.temperature == 0.5


@pytest.mark.parametrize(
    ("params", "error", "fragment"),
    [
        ({"temperature": 3.0}, BadArgumentError, "temperature"),
        ({"n": 2}, BadArgumentError, "takes only"),
        ({"model_name": "other"}, BadArgumentError, "takes only"),
    ],
)
def test_update_sampling_params_refuses_by_name_and_changes_nothing(
    params: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    worker, engine = _sync(_config())
    before = worker.cfg
    with pytest.raises(error, match=fragment):
        worker.update_sampling_params(**params)
    assert worker.cfg == before
    worker.generate(right_padded([[3, 4]]))
    assert engine.requests[-1][1].temperature == 1.0


def test_update_sampling_params_takes_every_config_sampling_key() -> None:
    worker, _ = _sync(_config())
    values = {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": None,
        "max_new_tokens": 5,
        "stop_token_ids": [2],
        "stop_strings": ["zz"],
        "bad_words": ["q"],
        "ignore_eos": False,
    }
    assert set(values) == set(SAMPLING_KEYS)
    assert worker.update_sampling_params(**values) is True
    assert worker.cfg.stop_strings == ("zz",)
    worker.shutdown()
    with pytest.raises(EngineStateError, match="shut down"):
        worker.update_sampling_params(temperature=1.0)


@pytest.mark.parametrize(
    "method", ["setup_token_capture", "install_token_capture", "set_rollout_weight_version"]
)
def test_token_capture_is_refused_naming_what_to_use(method: str) -> None:
    worker, _ = _async(async_config(vllm_cfg={"max_model_len": 64}))
    with pytest.raises(UnsupportedError, match=rf"{method}.*token_capture\.enabled false"):
        getattr(worker, method)(object(), "partition")
