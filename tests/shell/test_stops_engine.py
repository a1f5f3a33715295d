"""``stop_strings_mode`` on the real CPU engine, through the NeMo-RL drop-in (issue 43, item 3).

The batch has the issue's shape: a row with no stop strings of its own meets another row's
string in its text. Per sample it runs to ``max_new_tokens``; under ``batch_union``
(NeMo-RL's sync ``generate``) it stops there, and the rows that stop on their own string
stop at the same place in both modes. The session's one engine serves both drop-ins.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import base_config, right_padded

from genworker.core.engine_calls import Cache
from genworker.shell.nemo_rl import NemoRlGenerationWorker
from genworker.shell.vllm_engine import VllmEngine
from genworker.shell.worker import ExistingEngine

pytestmark = pytest.mark.engine

PAD = 2
MAX_NEW = 16
PROMPTS = [[5, 17, 99, 240, 7], [300, 12], [45, 46, 47, 48, 49, 50, 51, 52, 53], [88]]


def _worker(engine: VllmEngine, **top: Any) -> NemoRlGenerationWorker:
    config = base_config(
        model_name="tiny",
        max_new_tokens=MAX_NEW,
        ignore_eos=True,
        _pad_token_id=PAD,
        vllm_cfg={"gpu_memory_utilization": 0.05, "max_model_len": 256},
        **top,
    )
    return NemoRlGenerationWorker(config, [0], engine_factory=ExistingEngine(engine))


def _strings(texts: Sequence[str]) -> list[list[str] | None]:
    """Row 0 stops on a string of its own text; row 1's string is one of row 3's text that
    neither row 1's nor row 0's text holds; rows 2 and 3 have none."""
    own = texts[0][len(texts[0]) // 2 :][:2]
    assert own.strip(), texts[0]
    for start in range(len(texts[3]) // 3, len(texts[3]) - 2):
        other = texts[3][start : start + 3]
        if other.strip() and all(other not in texts[i] for i in (0, 1, 2)):
            return [[own], [other], None, None]
    raise AssertionError(f"no string of row 3 that no other row holds: {texts!r}")


def test_batch_union_stops_a_row_on_another_rows_string_and_per_sample_does_not(
    cpu_engine: VllmEngine, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = right_padded(PROMPTS, pad=PAD)
    per_sample = _worker(cpu_engine)
    full = per_sample.generate(data, greedy=True)
    texts = [
        str(tokenizer.decode(full["output_ids"][i, len(p) : len(p) + MAX_NEW].tolist()))
        for i, p in enumerate(PROMPTS)
    ]
    strings = _strings(texts)
    union = _worker(cpu_engine, stop_strings_mode="batch_union")
    try:
        mine = per_sample.generate({**data, "stop_strings": strings}, greedy=True)
        theirs = union.generate({**data, "stop_strings": strings}, greedy=True)
    finally:
        cpu_engine.reset_cache(Cache.PREFIX)
    mine_lengths = mine["generation_lengths"].tolist()
    their_lengths = theirs["generation_lengths"].tolist()
    assert mine_lengths[0] == their_lengths[0] < MAX_NEW  # its own string, in both modes
    assert mine_lengths[1] == their_lengths[1] == MAX_NEW  # its string is not in its text
    assert mine_lengths[3] == MAX_NEW
    assert their_lengths[3] < MAX_NEW  # NeMo-RL's union: row 1's string stops row 3
    n = len(PROMPTS[3])
    stopped = str(tokenizer.decode(theirs["output_ids"][3, n : n + their_lengths[3]].tolist()))
    assert strings[1] is not None
    assert strings[1][0] in stopped  # kept in the output (include_stop_str_in_output)
