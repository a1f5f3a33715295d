"""The GPU benchmark's pure parts (bench/gpu.py): the model shapes behind its claims, the
report (a failed section never hides the others) and its command line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("genworker_bench_gpu", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_refit_model_is_llama3_8b_sized_16_gb_of_bf16() -> None:
    shape = bench.LLAMA3_8B
    assert shape.num_params() == 8_030_261_248  # Llama-3-8B's parameter count
    assert shape.num_params() * 2 / 1e9 == pytest.approx(16.06, abs=0.01)  # the README's 16.06 GB


def test_the_generation_model_is_about_1b() -> None:
    assert 0.8e9 <= bench.LLAMA_1B.num_params() <= 1.2e9


@pytest.mark.parametrize("shape_name", ["TINY", "LLAMA_1B"])
def test_hf_shapes_are_the_checkpoint_names_and_shapes_transformers_writes(
    shape_name: str,
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = getattr(bench, shape_name)
    config = LlamaConfig(**{k: v for k, v in shape.config("float32").items() if k != "dtype"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shape.hf_shapes() == expected


def test_a_failed_section_is_reported_with_its_error_and_the_others_survive() -> None:
    ok = bench.Section("gen", "Generation")
    ok.row("worker_overhead", "1.01", "bar <= 1.03")
    ok.verdict("worker_overhead 1.01 <= 1.03", True)
    bad = bench.Section("refit", "Refit")
    bad.errors.append("Traceback ...\nRefitTimeoutError: no refit message")
    slow = bench.Section("nccl", "NCCL")
    slow.verdict("NCCL refit at 50% of the raw broadcast", False)
    text = bench.render(["- machine: test"], [ok, bad, slow])
    assert "| worker_overhead | 1.01 | bar <= 1.03 |" in text
    assert "**worker_overhead 1.01 <= 1.03: PASS**" in text
    assert "RefitTimeoutError: no refit message" in text
    assert "**NCCL refit at 50% of the raw broadcast: FAIL**" in text
    assert text.index("## Generation") < text.index("## Refit") < text.index("## NCCL")


def _fail(error: Exception) -> None:
    raise error


def test_guarded_and_part_record_failures_and_go_on() -> None:
    section = bench.Section("refit", "Refit")
    with bench.guarded(section):
        with bench.part(section, "load_weights"):
            _fail(ValueError("load_weights broke"))
        section.row("after the failed part", "still measured")
        _fail(RuntimeError("the section broke"))
        section.row("never", "reached")
    assert [r[0] for r in section.rows] == ["after the failed part"]
    assert "load_weights:" in section.errors[0]
    assert "load_weights broke" in section.errors[0]
    assert "the section broke" in section.errors[1]


def test_command_line_sections() -> None:
    assert bench.parse_args([]).sections == [
        "gen",
        "gen-tokenizer",
        "sleep",
        "refit",
        "ipc-nosleep",
    ]
    assert bench.parse_args(["--nccl"]).sections == [
        "gen",
        "gen-tokenizer",
        "sleep",
        "refit",
        "ipc-nosleep",
        "nccl",
    ]
    assert bench.parse_args(["--sections", "refit,gen"]).sections == ["gen", "refit"]
    assert bench.parse_args(["--sections", "server,async"]).sections == ["async", "server"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "gen,warp"])


def test_without_cuda_the_dry_run_goes_to_the_cpu_in_float32() -> None:
    args = bench.parse_args(["--dry-run", "--gen-reps", "1"])
    scale = bench.choose_scale(args, has_cuda=False)
    assert (scale.device, scale.dtype, scale.gen_reps) == ("cpu", "float32", 1)
    assert scale.gen_shape is bench.TINY
    assert bench.choose_scale(bench.parse_args([]), has_cuda=True) == bench.FULL


def test_the_generation_tokenizer_has_the_dummy_models_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    shape = bench.LLAMA_1B
    bench.write_tokenizer(tmp_path, shape.vocab)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == shape.vocab
    config = shape.config("bfloat16")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
    )
    text = "The worker reads token ids, not text."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < shape.vocab
    assert isinstance(tokenizer.decode([shape.vocab - 1, 3, 300]), str)
