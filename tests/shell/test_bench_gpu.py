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


def test_gen_tokenizer_reps_come_from_the_command_line() -> None:
    scale = bench.choose_scale(bench.parse_args(["--gen-tokenizer-reps", "9"]), has_cuda=True)
    assert scale.gen_tokenizer_reps == 9
    assert scale.gen_reps == bench.FULL.gen_reps


class _Engine:
    def generate(self, n: int) -> int:
        return _inside(n)


def _inside(n: int) -> int:
    return sum(range(n))


def _outside(n: int) -> int:
    return sum(range(n))


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_outside_profile_leaves_out_the_generate_calls_and_restores_them(
    wrapped: bool,
) -> None:
    llm = _Engine()
    instance_generate = None
    if wrapped:  # GenProbe's instance wrapper is in place

        def instance_generate(n: int) -> int:
            return _Engine.generate(llm, n)

        llm.generate = instance_generate  # type: ignore[method-assign]

    def run() -> int:
        return llm.generate(200_000) + _outside(200_000)

    seconds, hot = bench.outside_profile(run, llm, top=50)
    names = " ".join(hot)
    assert "_outside" in names
    assert "_inside" not in names
    assert seconds > 0
    if wrapped:
        assert vars(llm)["generate"] is instance_generate
    else:
        assert "generate" not in vars(llm)


def test_the_gen_probe_stamps_the_first_and_last_generate_call() -> None:
    llm = _Engine()
    with bench.GenProbe(llm) as probe:
        probe.reset()
        llm.generate(10)
        first, last_one = probe.first_start, probe.last_end
        llm.generate(10)
        assert probe.first_start == first
        assert probe.last_end > last_one >= first
        assert probe.inner_s <= probe.last_end - probe.first_start
        probe.reset()
        assert (probe.first_start, probe.last_end, probe.inner_s) == (0.0, 0.0, 0.0)
    assert "generate" not in vars(llm)


def test_the_trainer_sender_modes_patch_and_restore_the_sender() -> None:
    from genworker.core import refit_protocol
    from genworker.shell.refit import ipc, memory

    shipped = (memory.Exporter.recognised, ipc.IpcSenderPort._out, ipc.IpcSenderPort.begin)
    try:
        bench.sender_mode("handles")
        fresh = torch.zeros(4)
        _, recognised = memory.Exporter().recognised(fresh)
        assert recognised  # never seen, treated as recognised
        bench.sender_mode("buckets")
        assert memory.Exporter.recognised is shipped[0]
        assert ipc.IpcSenderPort._out is not shipped[1]
        assert ipc.IpcSenderPort.begin is not shipped[2]
        with pytest.raises(ValueError, match="warp"):
            bench.sender_mode("warp")
        assert (memory.Exporter.recognised, ipc.IpcSenderPort._out) == shipped[:2]
        bench.sender_mode("one-chunk")  # handles never close a chunk, packing still does
        plan = refit_protocol.ChunkPlan(512, 1e9, 0.0)
        for _ in range(8):
            placed = plan.place(refit_protocol.SendRoute.HANDLE, 4096, 0.0)
            assert not placed.flush
            plan = placed.plan
        assert plan.place(refit_protocol.SendRoute.PACK, 4096, 0.0).alone
    finally:
        bench.sender_mode(None)
    assert (memory.Exporter.recognised, ipc.IpcSenderPort._out, ipc.IpcSenderPort.begin) == shipped
    assert not memory.Exporter().recognised(torch.zeros(4))[1]
    assert (
        refit_protocol.ChunkPlan(512, 1e9, 0.0)
        .place(refit_protocol.SendRoute.HANDLE, 4096, 0.0)
        .plan.place(refit_protocol.SendRoute.HANDLE, 4096, 0.0)
        .flush
    )  # as it ships again


def test_without_cuda_the_driver_diagnostic_reports_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.driver_kv_cycles() == []


def test_the_cumem_probe_structs_have_the_cuda_driver_layouts() -> None:
    import ctypes

    path = BENCH.parent / "cumem_probe.py"
    spec = importlib.util.spec_from_file_location("genworker_cumem_probe", path)
    assert spec is not None
    assert spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    # CUmemAllocationProp: type, requestedHandleTypes, location {type, id}, a pointer,
    # allocFlags {compressionType, gpuDirectRDMACapable, usage, reserved[4]}
    assert ctypes.sizeof(probe.AllocationProp) == 32
    assert probe.AllocationProp.win32HandleMetaData.offset == 16
    assert probe.AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(probe.AccessDesc) == 12  # location {type, id}, flags
