"""A small, complete RL loop: the job the worker exists for, on this CPU in about 2 minutes.

Every step:

1. **generate**: the prompts, each ``samples_per_prompt`` times, through
   :class:`~genworker.shell.worker.VllmGenerationWorker` on the real vLLM engine (sampled at
   temperature 1, the sampled tokens' logprobs returned);
2. **score**: :func:`~genworker.demo.task.number_rewards` (the share of the completion
   that is numbers);
3. **train**: the policy, a plain ``transformers`` Llama in float32 on the trainer's side,
   recomputes the sampled tokens' logprobs and takes one GRPO step (group-baseline
   advantages, token-mean policy gradient; one update per batch, so the importance ratio
   is 1 and there is nothing to clip; no KL term) with Adam;
4. **refit**: the trainer's new weights go into the engine through genworker's IPC sender
   (:func:`refit_channel`, the only place that refits).

**LoRA mode** (``RlConfig.lora``): the policy is the same Llama, frozen, with a LoRA
adapter (:mod:`genworker.demo.lora`: rank 8 on ``q_proj``, ``v_proj`` and ``lm_head``);
only the adapter trains, the engine starts with ``enable_lora``, every refit moves only
the adapter (the worker's ``prepare_lora`` once, then ``update_lora`` per step, in
:func:`refit_channel`) and every generate call names it (``data["lora"]``). The adapter
the trainer starts from (``B = 0``: the base model) is refit before the first step, so
every rollout runs under the adapter; the worker's weight version counts ``steps + 1``
adapter refits. The gap below checks the adapter refits the same way.

The check that refit is right: step *k*'s rollouts come from the weights refit after step
*k-1*, and the trainer recomputes their logprobs with those same weights before updating,
so the mean absolute difference (``gap``) must be rounding noise. ``stale_gap`` beside it
is the same measure against the policy the run started with: what the gap would grow to
if refits silently did nothing.

The trainer and the engine share this process (the engine core runs in-process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the refit still crosses shared memory and a ZMQ
socket exactly as it would from a separate trainer process on the same host.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch

from genworker.demo.lora import LoraSpec, adapter_state, add_adapter, tensor_bytes
from genworker.demo.task import (
    generated_span,
    group_advantages,
    number_rewards,
    number_token_mask,
)

__all__ = [
    "ADAPTER_NAME",
    "GAP_BOUND",
    "RL_PROMPTS",
    "RlConfig",
    "RlRun",
    "Sample",
    "StepRecord",
    "refit_channel",
    "run_rl",
]

RL_PROMPTS: tuple[str, ...] = (
    "Numbers:",
    "Once upon a time",
    "The quick brown fox",
    "Hello world!",
    "Please answer the question",
    "To be or not to be",
    "She sells sea shells",
    "Water boils at",
)

#: The largest train-vs-rollout gap a correct refit may leave (nats per sampled token).
#: Both sides are float32; vLLM's CPU kernels (oneDNN GEMMs, its own RMSNorm, rotary and
#: attention) round differently from torch's: on the tiny model the step means measured
#: 1e-7..5e-7 and the largest single token 3e-6. A refit that loses a tensor or an update
#: leaves a gap of the order of ``stale_gap`` (0.2..4.6 nats after the first step here).
GAP_BOUND = 1e-4

_REFIT_TIMEOUT_S = 120.0

#: the name the demo's adapter is served under (``data["lora"]``)
ADAPTER_NAME = "policy"


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class RlConfig:
    """What one run does: the model directory, the steps, the batch and the optimizer."""

    model: Path = attrs.field(converter=Path)
    steps: int = attrs.field(default=24, validator=_positive)
    prompts: tuple[str, ...] = attrs.field(default=RL_PROMPTS, converter=_strings)
    samples_per_prompt: int = attrs.field(default=8, validator=_positive)
    max_new_tokens: int = attrs.field(default=16, validator=_positive)
    learning_rate: float = attrs.field(default=5e-3, validator=_positive)
    seed: int = 0
    #: how many prompts the before/after samples show
    show: int = attrs.field(default=3, validator=_positive)
    #: train and refit only this LoRA adapter (None: the whole model)
    lora: LoraSpec | None = None

    @prompts.validator
    def _check_prompts(self, _: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        if not value or not all(isinstance(p, str) and p for p in value):
            raise ValueError(f"prompts must be non-empty strings, got {value!r}")

    @samples_per_prompt.validator
    def _check_group(self, _: attrs.Attribute[Any], value: int) -> None:
        if value < 2:
            raise ValueError(f"a group baseline needs samples_per_prompt >= 2, got {value}")


@attrs.frozen
class StepRecord:
    """One step's figures, as printed."""

    step: int
    mean_reward: float
    #: tokens the engine generated this step
    tokens: int
    #: the worker's generate call
    generate_s: float
    #: scoring, the trainer's forward, backward and optimizer step (and the starting
    #: policy's forward for ``stale_gap``)
    train_s: float
    #: the refit, both ends, until the engine answered
    refit_s: float
    #: mean |trainer logprob - engine logprob| over the step's sampled tokens
    gap: float
    #: the largest such difference of a single token
    gap_max: float
    #: mean |trainer logprob - starting policy's logprob| over the same tokens
    stale_gap: float

    HEADER = (
        "step  reward  tokens  generate_s  train_s  refit_s  gap (train vs rollout)  "
        "gap if not refit"
    )

    def line(self) -> str:
        return (
            f"{self.step:>4}  {self.mean_reward:>6.3f}  {self.tokens:>6}  "
            f"{self.generate_s:>10.2f}  {self.train_s:>7.2f}  {self.refit_s:>7.2f}  "
            f"{self.gap:>22.1e}  {self.stale_gap:>16.3f}"
        )


@attrs.frozen
class Sample:
    """A prompt and one completion sampled for it (temperature 1, as the rollouts)."""

    prompt: str
    completion: str
    reward: float


@attrs.frozen
class RlRun:
    """A finished run: every step, the samples before and after, and the timings."""

    config: RlConfig
    steps: tuple[StepRecord, ...]
    before: tuple[Sample, ...]
    after: tuple[Sample, ...]
    #: the gap on the ``after`` samples: the check of the last refit
    final_gap: float
    #: the policy's parameters (the base model's, in LoRA mode)
    parameters: int
    #: the parameters the optimizer trains (the adapter's, in LoRA mode)
    trained: int
    #: bytes of the whole model, and bytes each refit moves (the adapter's in LoRA mode)
    model_bytes: int
    refit_bytes: int
    #: the worker's weight version at the end: the refits it counted
    weight_version: int
    engine_start_s: float
    total_s: float

    @property
    def mode(self) -> str:
        """``lora`` or ``full``: what each refit moved."""
        return "full" if self.config.lora is None else "lora"


@contextlib.contextmanager
def refit_channel(
    worker: Any, tensors: Mapping[str, torch.Tensor], lora: LoraSpec | None = None
) -> Iterator[Callable[[Mapping[str, torch.Tensor]], float]]:
    """Every refit call of the demo: declares ``tensors``' names, shapes and dtypes to the
    engine once, then yields ``push(state_dict) -> seconds``, which sends one refit over
    genworker's IPC sender from a thread while the engine receives it. With ``lora``,
    ``tensors`` are that adapter's (PEFT's names) and each push is an adapter refit
    served as :data:`ADAPTER_NAME`."""
    from genworker.shell.refit import RefitSender

    info = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    if lora is None:
        worker.prepare_refit_info(info)
        (address,) = worker.refit_address()

        def receive() -> None:
            worker.update_weights_via_ipc_zmq(timeout_s=_REFIT_TIMEOUT_S)
    else:
        (address,) = worker.prepare_lora(info, lora.peft_config())

        def receive() -> None:
            worker.update_lora(ADAPTER_NAME, timeout_s=_REFIT_TIMEOUT_S)

    with (
        RefitSender.ipc(str(address), manifest=info, timeout_s=_REFIT_TIMEOUT_S) as sender,
        ThreadPoolExecutor(1, thread_name_prefix="refit-sender") as pool,
    ):

        def push(state: Mapping[str, torch.Tensor]) -> float:
            started = time.perf_counter()
            sent = pool.submit(sender.send, list(state.items()))
            try:
                receive()
            except BaseException as e:
                with contextlib.suppress(Exception):  # the note only; e is raised
                    e.add_note(f"the sender said: {sent.exception(_REFIT_TIMEOUT_S)!r}")
                raise
            sent.result(_REFIT_TIMEOUT_S)
            return time.perf_counter() - started

        yield push


def run_rl(
    config: RlConfig, emit: Callable[[str], None] = print, *, load_progress: bool = True
) -> RlRun:
    """Run the loop; ``emit`` gets the header and one line per step as they happen
    (``load_progress``: the engine's bar while it loads the checkpoint)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from genworker.shell.local import pad_rows, worker_config
    from genworker.shell.worker import VllmGenerationWorker

    started = time.perf_counter()
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    pad = int(tokenizer.pad_token_id)
    numbers = number_token_mask(
        range(len(tokenizer)), lambda i: str(tokenizer.decode([i])), len(tokenizer)
    )
    policy = LlamaForCausalLM.from_pretrained(str(config.model), dtype=torch.float32)
    policy.train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # type: ignore[no-untyped-call]
    parameters = sum(p.numel() for p in policy.parameters())
    model_bytes = tensor_bytes(policy.state_dict().values())
    lora = config.lora
    if lora is None:

        def state() -> dict[str, torch.Tensor]:
            return dict(policy.state_dict())

        named: dict[str, str] = {}
    else:
        adapted = add_adapter(policy, lora)

        def state() -> dict[str, torch.Tensor]:
            return adapter_state(adapted)

        named = {"lora": ADAPTER_NAME}
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=config.learning_rate)

    wcfg = worker_config(
        str(config.model),
        pad_token_id=pad,
        max_new_tokens=config.max_new_tokens,
        temperature=1.0,
        device="cpu",
        load_progress=load_progress,
    )
    wcfg["seed"] = config.seed
    if lora is not None:
        kwargs = wcfg["vllm_kwargs"]
        assert isinstance(kwargs, dict)
        kwargs.update(enable_lora=True, max_lora_rank=lora.rank)
    t0 = time.perf_counter()
    worker = VllmGenerationWorker(wcfg)
    engine_start_s = time.perf_counter() - t0
    prompt_ids = [list(tokenizer(p)["input_ids"]) for p in config.prompts]
    group = config.samples_per_prompt
    rollout = pad_rows([ids for ids in prompt_ids for _ in range(group)], pad)
    shown = list(range(min(config.show, len(prompt_ids))))
    probe = pad_rows([prompt_ids[i] for i in shown], pad)

    def samples() -> tuple[list[Sample], float]:
        out = worker.generate({**probe, **named})
        rewards = _rewards(out, probe, numbers, config.max_new_tokens)
        with torch.no_grad():
            logprobs, span = _trainer_logprobs(policy, out, probe["input_lengths"])
        gap = _mean(((logprobs - out["logprobs"][:, 1:]).abs())[span])
        texts = _texts(out, probe["input_lengths"], tokenizer)
        return [
            Sample(config.prompts[i], texts[j], float(rewards[j])) for j, i in enumerate(shown)
        ], gap

    records: list[StepRecord] = []
    try:
        with refit_channel(worker, state(), lora) as push:
            if lora is not None:
                push(state())  # the adapter the trainer starts from: B = 0, the base model
            before, _ = samples()
            emit(StepRecord.HEADER)
            for step in range(config.steps):
                t1 = time.perf_counter()
                out = worker.generate({**rollout, **named})
                t2 = time.perf_counter()
                rewards = _rewards(out, rollout, numbers, config.max_new_tokens)
                gaps = _grpo_step(policy, reference, optimizer, out, rollout, rewards, group)
                t3 = time.perf_counter()
                refit_s = push(state())
                record = StepRecord(
                    step=step,
                    mean_reward=float(rewards.mean()),
                    tokens=int(out["generation_lengths"].sum()),
                    generate_s=t2 - t1,
                    train_s=t3 - t2,
                    refit_s=refit_s,
                    gap=gaps.mean,
                    gap_max=gaps.max,
                    stale_gap=gaps.stale,
                )
                records.append(record)
                emit(record.line())
        after, final_gap = samples()
        weight_version = worker.weight_version
    finally:
        worker.shutdown()
    return RlRun(
        config=config,
        steps=tuple(records),
        before=tuple(before),
        after=tuple(after),
        final_gap=final_gap,
        parameters=parameters,
        trained=sum(p.numel() for p in trainable),
        model_bytes=model_bytes,
        refit_bytes=tensor_bytes(state().values()),
        weight_version=weight_version,
        engine_start_s=engine_start_s,
        total_s=time.perf_counter() - started,
    )


@attrs.frozen
class _Gaps:
    mean: float
    max: float
    stale: float


def _grpo_step(
    policy: Any,
    reference: Any,
    optimizer: torch.optim.Optimizer,
    out: Mapping[str, torch.Tensor],
    rollout: Mapping[str, torch.Tensor],
    rewards: torch.Tensor,
    group: int,
) -> _Gaps:
    """One policy-gradient step on a batch of rollouts; the train-vs-rollout gaps measured
    on the way (before the update, so on the weights the engine generated with)."""
    lengths = rollout["input_lengths"]
    logprobs, span = _trainer_logprobs(policy, out, lengths)
    diff = (logprobs.detach() - out["logprobs"][:, 1:]).abs()[span]
    with torch.no_grad():
        start_logprobs, _ = _trainer_logprobs(reference, out, lengths)
    stale = _mean((logprobs.detach() - start_logprobs).abs()[span])
    advantages = group_advantages(rewards, group)
    loss = -(advantages[:, None] * logprobs * span).sum() / max(int(span.sum()), 1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return _Gaps(
        mean=_mean(diff), max=float(diff.max()) if diff.numel() else float("nan"), stale=stale
    )


def _trainer_logprobs(
    model: Any, out: Mapping[str, torch.Tensor], input_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logprob of every token after the first (``[rows, width-1]``) and where
    those tokens were generated (bool, same shape)."""
    ids = out["output_ids"]
    ends = input_lengths + out["generation_lengths"]
    attention = (torch.arange(ids.shape[1])[None, :] < ends[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    span = generated_span(ids.shape[1], input_lengths, out["generation_lengths"])[:, 1:]
    return logprobs, span


def _rewards(
    out: Mapping[str, torch.Tensor],
    data: Mapping[str, torch.Tensor],
    numbers: torch.Tensor,
    max_new_tokens: int,
) -> torch.Tensor:
    return number_rewards(
        out["output_ids"], data["input_lengths"], out["generation_lengths"], numbers, max_new_tokens
    )


def _texts(
    out: Mapping[str, torch.Tensor], input_lengths: torch.Tensor, tokenizer: Any
) -> list[str]:
    texts = []
    for i in range(out["output_ids"].shape[0]):
        start = int(input_lengths[i])
        stop = start + int(out["generation_lengths"][i])
        texts.append(str(tokenizer.decode(out["output_ids"][i, start:stop].tolist())))
    return texts


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else float("nan")
