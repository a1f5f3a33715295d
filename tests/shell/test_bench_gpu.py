"""The GPU benchmark's pure parts (bench/gpu.py): the model shapes behind its claims, the
report (a failed section never hides the others) and its command line."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from genworker.core.engine_calls import RpcCall

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
    assert bench.parse_args(["--sections", "groups,lora,refit"]).sections == [
        "refit",
        "lora",
        "groups",
    ]
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "gen,warp"])


def test_every_section_has_a_title_and_its_paragraph_in_the_docstring() -> None:
    doc = bench.__doc__
    assert doc is not None
    for key in bench.SECTIONS:
        assert key in bench.TITLES
        assert f"``{key}``" in doc
    for figure in (
        "refit_finite_check_overhead",
        "lora_refit_vs_full",
        "lora_generate_overhead",
        "group_prefill_vs_unshared_rows",
        "group_prefill_vs_rows",
    ):
        assert figure in doc


class _Rpc:
    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def collective_rpc(self, call: RpcCall) -> list[object]:
        self.calls.append((call.method, call.args))
        return [call.args[0] if self.answer is None else self.answer]


class _Worker:
    def __init__(self, answer: object = None) -> None:
        self.engine = _Rpc(answer)


def test_the_finite_check_is_toggled_by_the_rpc_the_config_key_uses() -> None:
    worker = _Worker()
    bench.set_finite_check(worker, False)
    bench.set_finite_check(worker, True)
    assert worker.engine.calls == [("refit_configure", (False,)), ("refit_configure", (True,))]
    with pytest.raises(RuntimeError, match="refit_configure"):
        bench.set_finite_check(_Worker(answer=True), False)  # an engine that kept it on


def test_refit_finite_check_overhead_is_the_ratio_of_the_medians_with_its_bar() -> None:
    measured = bench.CheckedRefits(
        times={True: [0.0110, 0.0102, 0.0200], False: [0.0100, 0.0100, 0.0090]},
        phases={True: "write 1.0", False: "write 1.0"},
        warmup_s=[0.05, 0.02],
    )
    section = bench.Section("refit", "Refit")
    bench.finite_check_rows(section, measured, 16 << 30, None)
    (row,) = [r for r in section.rows if r[0].startswith("refit_finite_check_overhead")]
    assert row[1] == "1.100"  # 11.0 ms over 10.0 ms, not the best over the best
    assert section.verdicts == [("refit_finite_check_overhead 1.100 <= 1.05", False)]
    measured = bench.CheckedRefits(
        times={True: [0.0101, 0.0102], False: [0.0100, 0.0100]},
        phases={True: "", False: ""},
        warmup_s=[],
    )
    section = bench.Section("refit", "Refit")
    bench.finite_check_rows(section, measured, 16 << 30, 0.004)
    assert section.verdicts[0][1]
    assert any(r[0].startswith("the check alone") for r in section.rows)


def test_rotated_runs_rotate_the_order_and_drop_the_warm_up_round() -> None:
    order: list[str] = []

    def run(name: str, seconds: float) -> Callable[[], float]:
        def go() -> float:
            order.append(name)
            return seconds if len(order) > 3 else 99.0  # the warm-up round's are dropped

        return go

    times = bench.rotated({"a": run("a", 1.0), "b": run("b", 2.0), "c": run("c", 4.0)}, 2)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [4.0, 4.0]}
    assert bench.paired_ratio(times, "a", "c") == 0.25


class _Llm:
    def generate(self, prompts: list[int], params: object = None) -> list[int]:
        return [p + 1 for p in prompts]


def test_counted_prompts_counts_each_generate_call_and_restores_the_engine() -> None:
    llm = _Llm()
    with bench.counted_prompts(llm) as counts:
        assert llm.generate([1, 2, 3]) == [2, 3, 4]
        llm.generate([4], params=None)
    assert counts == [3, 1]
    assert "generate" not in vars(llm)


def test_the_lora_adapter_is_one_genworker_accepts_for_every_projection() -> None:
    from returns.result import Success

    from genworker.core.lora import EngineLora, check_adapter
    from genworker.core.refit_plan import Manifest

    shape = bench.LLAMA_1B
    layout = bench.adapter_layout(shape, bench.LORA_RANK, "bfloat16")
    assert len(layout) == 2 * len(bench.LORA_TARGETS) * shape.layers
    a = layout["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"]
    b = layout["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert a == ((bench.LORA_RANK, shape.intermediate), "bfloat16")
    assert b == ((shape.hidden, bench.LORA_RANK), "bfloat16")
    paths = {n.removesuffix(".weight") for n in shape.hf_shapes()}
    engine = EngineLora(bench.LORA_RANK, frozenset(bench.LORA_TARGETS), frozenset(paths))
    checked = check_adapter(Manifest.from_info(layout).unwrap(), bench.LORA_PEFT, engine)
    assert isinstance(checked, Success)
    # a few MB against the model's 1.7 GB: what makes an adapter refit cheap
    assert bench.layout_bytes(layout) < 0.02 * shape.num_params() * 2


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
