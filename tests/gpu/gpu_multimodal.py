"""What the multimodal GPU test runs in its child process (imported as ``gpu.gpu_multimodal``).

The session worker's sleep-mode engine owns this pytest process's CuMem pool (see
``gpu_fixtures``), so the tiny Idefics3 engine runs in a spawned child: a
``VllmGenerationWorker`` (sleep mode on, as on every GPU) checked against raw
``LLM.generate`` on its own engine (NeMo-RL's ``vllm_content`` / ``vllm_images`` batch
too, against raw vLLM on the text NeMo-RL sends), and its cache resets around sleep. The
child returns plain values; the test asserts on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["vlm_main"]

PAD, BOS, IMAGE = 2, 0, 4  # the tiny VLM's <pad>, <s>, <image>
TEXT = "<image> Describe the image."


def vlm_main(model_dir: str) -> dict[str, Any]:
    import torch
    from PIL import Image
    from transformers import AutoProcessor
    from vllm import SamplingParams
    from vllm.inputs import TextPrompt, TokensPrompt

    from genworker.core.counters import CACHE_RESETS
    from genworker.demo.tiny_model import build_tiny_vlm
    from genworker.shell.errors import BadBatchError
    from genworker.shell.vllm_engine import VllmEngine
    from genworker.shell.worker import VllmGenerationWorker

    model = build_tiny_vlm(Path(model_dir) / "tiny-idefics3-tiled", tiles=2)
    config: dict[str, object] = {
        "backend": "vllm",
        "model_name": str(model),
        "max_new_tokens": 12,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "_pad_token_id": PAD,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.2,
            "max_model_len": 256,
            "precision": "bfloat16",
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "limit_mm_per_prompt": {"image": 2},
        },
        "vllm_kwargs": {"max_num_seqs": 4},
    }
    worker = VllmGenerationWorker(config)
    try:
        engine = worker.engine
        assert isinstance(engine, VllmEngine)
        llm = engine.llm
        red, blue = Image.new("RGB", (40, 30), (255, 0, 0)), Image.new("RGB", (20, 50), (0, 0, 255))
        (text_ids,) = engine.tokenize(["Describe the image."])
        (image_ids,) = engine.tokenize([TEXT])
        rows: list[tuple[list[int], dict[str, object] | None]] = [
            (text_ids, None),
            (image_ids, {"image": red}),
            ([*image_ids[:1], IMAGE, *image_ids[1:]], {"image": [red, blue]}),
        ]
        width = max(len(p) for p, _ in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, (p, _) in enumerate(rows):
            ids[i, : len(p)] = torch.tensor(p)
        data = {
            "input_ids": ids,
            "input_lengths": torch.tensor([len(p) for p, _ in rows]),
            "multi_modal_data": [m for _, m in rows],
        }

        def worker_tokens() -> list[list[int]]:
            out = worker.generate(data, greedy=True)
            return [
                out["output_ids"][i, len(p) : len(p) + int(out["generation_lengths"][i])].tolist()
                for i, (p, _) in enumerate(rows)
            ]

        prompts = [
            TokensPrompt(prompt_token_ids=p, multi_modal_data=m)
            if m is not None
            else TokensPrompt(prompt_token_ids=p)
            for p, m in rows
        ]
        raw = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
        ours = worker_tokens()
        # NeMo-RL's side channels: its processor's expanded ids (vLLM's, here), the text,
        # the images; against raw vLLM on the text NeMo-RL sends it.
        expanded = [list(o.prompt_token_ids or []) for o in raw[1:]]
        nemo_ids = torch.full((2, max(map(len, expanded))), PAD, dtype=torch.long)
        for i, e in enumerate(expanded):
            nemo_ids[i, : len(e)] = torch.tensor(e)
        nemo = worker.generate(
            {
                "input_ids": nemo_ids,
                "input_lengths": torch.tensor([len(e) for e in expanded]),
                "vllm_content": [TEXT, "<image>" + TEXT],
                "vllm_images": [[red], [red, blue]],
            },
            greedy=True,
        )
        nemo_rl = [
            nemo["output_ids"][i, len(e) : len(e) + int(nemo["generation_lengths"][i])].tolist()
            for i, e in enumerate(expanded)
        ]
        texts = [
            TextPrompt(prompt=TEXT, multi_modal_data={"image": red}),
            TextPrompt(prompt="<image>" + TEXT, multi_modal_data={"image": [red, blue]}),
        ]
        nemo_raw = llm.generate(
            texts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False
        )
        try:
            bad = [None, {"image": [red, blue]}, {"image": [red, blue]}]
            worker.generate({**data, "multi_modal_data": bad})
            refused = ""
        except BadBatchError as e:
            refused = str(e)
        worker.sleep(1)
        worker.wake_up()
        after_sleep = worker_tokens()
        counters = worker.get_counters()
        # What one image adds to its prompt, from the model's own HF processor: with split
        # images that depends on the image's size (its tile grid), so it is not a constant.
        processor = AutoProcessor.from_pretrained(str(model))  # type: ignore[no-untyped-call]
        placeholder = len(processor.tokenizer("<image>")["input_ids"])
        extra = [
            len(processor(text="<image>", images=[image])["input_ids"][0]) - placeholder
            for image in (red, blue)
        ]
        return {
            "image_extra": extra,
            "raw": [list(o.outputs[0].token_ids) for o in raw],
            "raw_prompt_ids": [list(o.prompt_token_ids or []) for o in raw],
            "ours": ours,
            "nemo_rl": nemo_rl,
            "nemo_rl_raw": [list(o.outputs[0].token_ids) for o in nemo_raw],
            "after_sleep": after_sleep,
            "rows": [p for p, _ in rows],
            "bos": engine.tokenize(["<s>" + TEXT, TEXT]),
            "refused": refused,
            "resets": {
                c: counters.get(f'{CACHE_RESETS}{{cache="{c}"}}')
                for c in ("prefix", "mm", "encoder")
            },
            "caps": [engine.capabilities.image_token_id, engine.capabilities.max_images],
        }
    finally:
        worker.shutdown()
