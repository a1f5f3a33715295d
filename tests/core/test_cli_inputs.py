"""``genworker.core.cli_inputs``: the prompts file refused by file and line, the local
worker config, and vLLM's engine options into that config, refused by the flag that set
a key the worker would refuse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from returns.result import Failure, Success

from genworker.core.cli_inputs import (
    COUNT_OPTIONS,
    ENGINE_OPTION_KEYS,
    LOG_LEVELS,
    InputProblem,
    check_options,
    check_prompt_lengths,
    completion_records,
    config_problems,
    engine_config,
    explain_problems,
    log_environment,
    log_level,
    parse_prompts,
    serve_keys,
    unreadable_prompts,
    worker_config,
)
from genworker.core.config import ConfigProblem, WorkerConfig


def problem(result: object) -> str:
    assert isinstance(result, Failure), result
    error = result.failure()
    assert isinstance(error, InputProblem)
    return str(error)


BAD_LINES = [
    ([], "p.jsonl:1: no prompts (empty)"),
    ([b"\n", b"  \n"], "p.jsonl:2: no prompts (blank lines only)"),
    ([b'{"prompt": "a"}\n', b'{"prompt": "x", "y": }\n'],
     "p.jsonl:2: not valid JSON: Expecting value at column 22"),
    ([b'{"prompt": "a"}\n', b"\n", b'["a"]\n'],
     'p.jsonl:3: expected a JSON object {"prompt": "..."}, got an array'),
    ([b'"a"\n'], "p.jsonl:1: expected a JSON object {\"prompt\": \"...\"}, got a string"),
    ([b"true\n"], "p.jsonl:1: expected a JSON object {\"prompt\": \"...\"}, got a boolean"),
    ([b'{"text": "a"}\n'], "p.jsonl:1: no 'prompt' key (keys: 'text')"),
    ([b"{}\n"], "p.jsonl:1: no 'prompt' key (keys: none)"),
    ([b'{"prompt": 3}\n'], "p.jsonl:1: 'prompt' must be a string, got a number"),
    ([b'{"prompt": null}\n'], "p.jsonl:1: 'prompt' must be a string, got null"),
    ([b'{"prompt": {}}\n'], "p.jsonl:1: 'prompt' must be a string, got an object"),
    ([b'{"prompt": ""}\n'], "p.jsonl:1: 'prompt' is empty"),
    ([b'{"prompt": "a"}\n', b'{"prompt": "caf\xe9"}\n'], "p.jsonl:2: not UTF-8 text (byte 16)"),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "message"), BAD_LINES)
def test_a_bad_prompts_file_is_named_by_file_and_line(lines: list[bytes], message: str) -> None:
    assert problem(parse_prompts("p.jsonl", lines)) == message


@given(st.lists(st.one_of(st.none(), st.text(min_size=1)), max_size=8))
def test_every_prompt_comes_back_with_its_line_and_blank_lines_are_skipped(
    prompts: list[str | None],
) -> None:
    lines = [b"  \n" if p is None else json.dumps({"prompt": p}).encode() + b"\n" for p in prompts]
    expected = [(n, p) for n, p in enumerate(prompts, 1) if p is not None]
    parsed = parse_prompts("p.jsonl", lines)
    if expected:
        assert parsed == Success(expected)
    else:
        assert "no prompts" in problem(parsed)


def test_a_prompt_must_leave_room_for_one_generated_token() -> None:
    fits = check_prompt_lengths("p", [1, 3], [5, 7], max_model_len=8, max_new_tokens=4)
    assert fits == Success(None)
    too_long = check_prompt_lengths("p", [1, 3], [5, 8], max_model_len=8, max_new_tokens=4)
    assert problem(too_long) == (
        "p:3: the prompt is 8 tokens, longer than the context leaves room for "
        "(--max-model-len 8: at most 7 prompt tokens, one left to generate)"
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("load_progress", [True, False])
def test_the_local_config_parses_and_is_sized_for_the_device(
    device: str, load_progress: bool
) -> None:
    config = worker_config(
        "m", pad_token_id=2, max_new_tokens=5, temperature=0.5, device=device,
        load_progress=load_progress,
    )  # fmt: skip
    parsed = WorkerConfig.from_mapping(config)
    assert isinstance(parsed, Success)
    cfg = parsed.unwrap()
    assert (cfg.model_name, cfg.max_new_tokens, cfg.temperature) == ("m", 5, 0.5)
    assert cfg.vllm.max_model_len == (256 if device == "cpu" else 4096)
    kwargs = config["vllm_kwargs"]
    assert isinstance(kwargs, dict)
    assert ("kv_cache_memory_bytes" in kwargs) is (device == "cpu")
    assert kwargs.get("use_tqdm_on_load", True) is load_progress
    assert config_problems(config) == ()


BASE = worker_config("m", pad_token_id=0, max_new_tokens=4, temperature=1.0, device="cpu")


def test_engine_options_land_under_genworkers_key_else_in_vllm_kwargs() -> None:
    options = {"max_model_len": 128, "dtype": "bfloat16", "seed": 7, "max_num_seqs": 3}
    config = engine_config(BASE, options, {"async_engine": True}).unwrap()
    vllm_cfg, kwargs = config["vllm_cfg"], config["vllm_kwargs"]
    assert isinstance(vllm_cfg, dict)
    assert isinstance(kwargs, dict)
    assert (vllm_cfg["max_model_len"], vllm_cfg["precision"], config["seed"]) == (
        128,
        "bfloat16",
        7,
    )
    assert vllm_cfg["async_engine"] is True
    assert kwargs["max_num_seqs"] == 3
    base_cfg = BASE["vllm_cfg"]
    assert isinstance(base_cfg, dict)
    assert base_cfg["max_model_len"] == 256, "the base config is left as it was"
    assert ENGINE_OPTION_KEYS["dtype"] == "vllm_cfg.precision"
    assert engine_config(BASE, {}) == Success(BASE)


def test_an_option_the_worker_refuses_is_named_by_its_flag() -> None:
    assert problem(engine_config(BASE, {"max_model_len": 0})).startswith(
        "--max-model-len (vllm_cfg.max_model_len: "
    )
    reserved = problem(engine_config(BASE, {"enable_sleep_mode": True}))
    assert reserved.startswith("--enable-sleep-mode (vllm_kwargs.enable_sleep_mode: is reserved")
    not_a_flag = problem(engine_config(BASE, {}, {"sleep_level": 3}))
    assert not_a_flag.startswith("vllm_cfg.sleep_level: ")


def test_a_problem_is_named_by_the_flag_of_the_longest_key_that_holds_it() -> None:
    problems = [
        ConfigProblem("vllm_kwargs.speculative_config.method", "bad"),
        ConfigProblem("vllm_kwargs.other", "bad too"),
        ConfigProblem("seed", "worse"),
    ]
    flags = {
        "vllm_kwargs.speculative_config": "--speculative-config",
        "vllm_kwargs.other": "--other",
        "vllm_kwargs.oth": "--oth",
    }
    assert explain_problems(problems, flags) == (
        f"--speculative-config ({problems[0]}); --other ({problems[1]}); {problems[2]}"
    )


def test_serve_runs_the_async_worker_behind_the_server_with_the_given_template() -> None:
    keys = serve_keys("0.0.0.0", 8000, on_policy_guard=False, rl_routes=True, chat_template=None)
    assert keys == {
        "async_engine": True,
        "expose_http_server": True,
        "http_server_host": "0.0.0.0",
        "http_server_port": 8000,
        "http_server_on_policy_guard": False,
        "http_server_rl_routes": True,
    }
    templated = serve_keys("h", 0, on_policy_guard=True, rl_routes=False, chat_template="{{x}}")
    assert templated["http_server_serving_chat_kwargs"] == {"chat_template": "{{x}}"}


@given(
    st.lists(st.tuples(st.text(), st.text(), st.integers(0, 99), st.integers(0, 99), st.booleans()))
)
def test_generate_writes_one_json_line_per_prompt_in_order(
    rows: list[tuple[str, str, int, int, bool]],
) -> None:
    prompts, texts = [r[0] for r in rows], [r[1] for r in rows]
    counts = [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows]
    lines = completion_records(prompts, texts, *counts)
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)
    keys = ("prompt", "completion", "prompt_tokens", "generated_tokens", "truncated")
    assert [json.loads(line) for line in lines] == [
        dict(zip(keys, row, strict=True)) for row in rows
    ]


@pytest.mark.parametrize(
    ("level", "bars_off"), [("debug", False), ("info", False), ("warning", True), ("error", True)]
)
def test_the_log_environment_sends_vllm_to_stderr_at_the_level(level: str, bars_off: bool) -> None:
    env = log_environment(level)
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert env["VLLM_LOGGING_LEVEL"] == level.upper()
    assert env["TRANSFORMERS_VERBOSITY"] == level
    assert ("HF_HUB_DISABLE_PROGRESS_BARS" in env) == bars_off


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (FileNotFoundError(2, "No such file or directory"), "--prompts p.jsonl: no such file"),
        (
            IsADirectoryError(21, "Is a directory"),
            "--prompts p.jsonl: a directory, not a JSONL file",
        ),
        (
            PermissionError(13, "Permission denied"),
            "--prompts p.jsonl: cannot be read: Permission denied",
        ),
    ],
)
def test_a_prompts_file_that_cannot_be_opened_is_named_with_how(
    error: OSError, message: str
) -> None:
    assert str(unreadable_prompts("p.jsonl", error)) == message


@given(st.booleans(), st.sampled_from([None, *LOG_LEVELS]), st.sampled_from(LOG_LEVELS))
def test_the_log_level_is_quiet_then_the_option_then_the_inherited_one(
    quiet: bool, level: str | None, inherited: str
) -> None:
    chosen = log_level(quiet, level, inherited.upper())
    assert chosen == Success("error" if quiet else level or inherited)


def test_an_inherited_log_level_that_is_no_level_is_named() -> None:
    assert problem(log_level(False, None, "loud")) == (
        "VLLM_LOGGING_LEVEL='loud': expected one of debug, info, warning, error"
    )
    assert problem(log_level(False, None, "")) == (
        "VLLM_LOGGING_LEVEL='': expected one of debug, info, warning, error"
    )


def test_quiet_and_a_log_level_together_or_a_count_below_one_are_refused_by_flag() -> None:
    assert check_options(True, None, {}) == Success(None)
    assert check_options(False, "info", dict.fromkeys(COUNT_OPTIONS, 1)) == Success(None)
    assert problem(check_options(True, "info", {})) == (
        "-q or --log-level: -q means --log-level error and no progress bar"
    )
    counts = {"max_new_tokens": None, "chunk": 0, "batch": -1}
    assert problem(check_options(False, None, counts)) == "--chunk must be at least 1, got 0"
