"""Prompts, tokenization and scoring exactly as upstream's harness (`shared/eval/src/harness.rs`).

A `Task` (a task, its few-shot count and a seed) is prepared once with a tokenizer into a
`PreparedTask`; `PreparedTask.run` then scores a bounded slice of its documents into a
`RunningAverage`, so a client can evaluate between rounds and resume where it stopped.

Loglikelihood tasks. A document's context is its few-shot prefix followed by its text; the
context is tokenized once (no special tokens) and each choice's tokens are what tokenizing
`context + " " + choice` adds after the context's tokens. A request is `[BOS] + context + choice`
where BOS is the tokenizer's `<s>`, or id 1 when it has none (upstream's rule, kept as is). A
choice's loglikelihood is the sum of the log-probabilities of its tokens; a document scores
`acc` when the best choice is the answer, `acc_norm` when the best loglikelihood divided by the
choice's length in UTF-8 bytes is, and `acc_uncond` when the best loglikelihood minus the
loglikelihood of the request's "Answer: {choice}" tail alone is (ties go to the first choice).

Few-shot prefixes. MMLU, MMLU CF and ARC take a category's first examples in dataset order; the
other tasks shuffle the category's examples for every document with one ChaCha8 generator seeded
with `eval_seed` (bytes 24..32 of the seed, big-endian) and rand 0.9's shuffle, then take the
first `num_fewshot`. Each example is `text + " " + its answer's choice`, joined by blank lines.

Generation tasks (MMLU Pro) build upstream's chain-of-thought prompt, decode greedily (the last
of equal maxima, as upstream's argmax) until an end-of-sequence token, a stop string in the
decoded text or 1024 new tokens, and score the last "answer is (X)" in the generated text. A
generation interrupted by a cancel or a deadline is kept and resumed on the next run.

Models run in eval mode under `torch.no_grad()` on their own device. The choices of a document
are scored in one batch (right-padded: a causal model's logits at real positions do not depend
on later padding), where upstream runs one sequence at a time, and generation reuses a KV cache
where upstream recomputes the whole sequence for every token: the same quantities, up to
floating-point rounding.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from psyche.core.rng import ChaCha8Rng, shuffle_permutation
from psyche.core.running_average import RunningAverage
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.eval.document import ASCII_UPPERCASE, Document
from psyche.modeling.eval.tasks import (
    MMLU,
    MMLUCF,
    PIQA,
    ArcChallenge,
    ArcEasy,
    BoolQ,
    Hellaswag,
    MMLUPro,
    OpenbookQA,
)
from psyche.modeling.eval.traits import LogLikelihoodTask, TaskType
from psyche.modeling.trainer import CancelToken

GENERATE_UNTIL_MAX_TOKENS = 1024

TASKS_WITH_ACC_NORM = (
    ArcChallenge.NAME,
    ArcEasy.NAME,
    Hellaswag.NAME,
    MMLUCF.NAME,
    OpenbookQA.NAME,
    PIQA.NAME,
)
TASKS_WITH_ACC_UNCOND = (ArcChallenge.NAME, ArcEasy.NAME, MMLUCF.NAME, PIQA.NAME)
# First-n few-shot sampling; every other loglikelihood task shuffles.
TASKS_WITH_FIRST_N_FEWSHOT = (MMLU.NAME, MMLUCF.NAME, ArcEasy.NAME, ArcChallenge.NAME)


def min_reporting_ratio(name: str) -> float | None:
    """The share of a task's documents scored before its averages are reported to a run."""
    if name == MMLUPro.NAME:
        return 0.1
    if name in (
        ArcChallenge.NAME,
        BoolQ.NAME,
        ArcEasy.NAME,
        Hellaswag.NAME,
        OpenbookQA.NAME,
        MMLU.NAME,
        MMLUCF.NAME,
        PIQA.NAME,
    ):
        return 0.5
    return None


def min_samples(name: str, num_docs: int) -> int | None:
    ratio = min_reporting_ratio(name)
    # Upstream multiplies in f32 and truncates.
    return None if ratio is None else int(np.float32(ratio) * np.float32(num_docs))


def seed_bytes(random_seed: int) -> bytes:
    """Upstream's ChaCha8 seed for a task: 24 zero bytes, then the u64 seed big-endian."""
    return bytes(24) + (random_seed % (1 << 64)).to_bytes(8, "big")


def as_tokenizer(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` (what upstream uses) from itself or a transformers fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None else tokenizer


def encode(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def eos_token_ids(model: CausalLM) -> frozenset[int]:
    """The model config's end-of-sequence ids (one or several; none when unset)."""
    eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos) if isinstance(eos, list | tuple) else frozenset([eos])


def bos_token_id(tokenizer: Any) -> int:
    token = tokenizer.token_to_id("<s>")
    return 1 if token is None else int(token)


# --------------------------------------------------------------------------------------------
# Preparing


def fewshot_prefix(
    task: LogLikelihoodTask,
    doc: Document,
    fewshot_by_category: Mapping[str, list[Document]],
    num_fewshot: int,
    rng: ChaCha8Rng,
) -> str:
    """The text put before `doc.text`: the task's preamble, then `num_fewshot` examples.

    Shuffling tasks draw from `rng` for every document (even when fewer examples exist), so the
    prefixes depend on the order documents are prepared in, as upstream's do.
    """
    category = doc.category if doc.category is not None else "default"
    preamble = task.get_preamble(category)
    if num_fewshot <= 0:
        return preamble
    examples = fewshot_by_category.get(category)
    if examples is None:
        # Upstream falls back to "the first" category of a hash map (an arbitrary one);
        # here the first in dataset order.
        examples = next(iter(fewshot_by_category.values()), [])
    if task.name not in TASKS_WITH_FIRST_N_FEWSHOT:
        examples = [examples[i] for i in shuffle_permutation(len(examples), rng)]
    shots = [f"{x.text} {x.choices[x.answer]}" for x in examples[:num_fewshot]]
    return preamble + "\n\n".join(shots) + "\n\n"


@dataclass(frozen=True)
class TokenizedLLHDocument:
    """A document's requests (`[BOS] + context + choice` token ids), one per choice."""

    choices_str: tuple[str, ...]
    answer: int
    choices_token_len: tuple[int, ...]
    requests: tuple[tuple[int, ...], ...]
    acc_uncond_tokens_len: tuple[int, ...]

    @classmethod
    def from_document(cls, doc: Document, tokenizer: Any, prefix: str) -> TokenizedLLHDocument:
        context = f"{prefix}{doc.text}" if prefix else doc.text
        context_tokens = encode(tokenizer, context)
        bos = bos_token_id(tokenizer)
        requests: list[tuple[int, ...]] = []
        lengths: list[int] = []
        uncond: list[int] = []
        for choice in doc.choices:
            full_tokens = encode(tokenizer, f"{context} {choice}")
            # The tokens past the context's count, which keeps the context's own tokens as they
            # are (a space merged into the context's last token is not counted twice).
            choice_tokens = full_tokens[len(context_tokens) :]
            requests.append((bos, *context_tokens, *choice_tokens))
            lengths.append(len(choice_tokens))
            if doc.eval_name in TASKS_WITH_ACC_UNCOND:
                uncond.append(_uncond_length(tokenizer, full_tokens, len(choice_tokens), choice))
        return cls(tuple(doc.choices), doc.answer, tuple(lengths), tuple(requests), tuple(uncond))


def _uncond_length(tokenizer: Any, full_tokens: list[int], start: int, choice: str) -> int:
    """How many trailing tokens decode to text containing "Answer: {choice}" (the fewest from
    the choice's own token count up)."""
    wanted = f"Answer: {choice}"
    for n in range(start, len(full_tokens)):
        tail = full_tokens[len(full_tokens) - n :]
        if wanted in tokenizer.decode(tail, skip_special_tokens=False):
            return n
    # Upstream would panic later on; fail here with the reason.
    raise ValueError(f"no token tail decodes to {wanted!r}")


@dataclass(frozen=True)
class TokenizedGenerateUntilDocument:
    request_str: str
    request: tuple[int, ...]
    answer: int


def generate_until_prompt(
    doc: Document, fewshot_examples: Sequence[Document], num_fewshot: int
) -> str:
    """Upstream's MMLU-Pro prompt: instructions, worked examples, the question, "Let's think"."""
    category = doc.category
    parts = [
        f"The following are multiple choice questions (with answers) about {category}. Think "
        'step by step and then finish your answer with "the answer is (X)" where X is the '
        "correct letter choice.\n"
    ]
    for example in fewshot_examples[:num_fewshot]:
        parts.append("Question:\n")
        parts.append(example.text)
        parts.append("\nOptions:\n")
        parts.extend(f"{ASCII_UPPERCASE[i]}. {c}\n" for i, c in enumerate(example.choices))
        cot = example.cot_content or ""
        if cot.startswith("A:"):
            cot = "Answer:" + cot[2:]
        parts.append(cot)
        parts.append("\n\n")
    parts.append("Question:\n")
    parts.append(doc.text)
    parts.append("\nOptions:\n")
    parts.extend(f"{ASCII_UPPERCASE[i]}. {c}\n" for i, c in enumerate(doc.choices))
    parts.append("Answer: Let's think step by step.")
    return "".join(parts)


class Task:
    """A task with its few-shot count and seed (upstream `Task::new`)."""

    def __init__(self, task_type: TaskType, num_fewshot: int, random_seed: int) -> None:
        self.task_type = task_type
        self.num_fewshot = num_fewshot
        self.random_seed = random_seed
        self._rng = ChaCha8Rng(seed_bytes(random_seed))

    @property
    def name(self) -> str:
        return self.task_type.name

    def __str__(self) -> str:
        return self.name

    def prepare(self, tokenizer: Any, limit: int | None = None) -> PreparedTask:
        """Build and tokenize every request; `limit` keeps the first documents only (upstream's
        `eval_task_max_docs`). Call once: the few-shot generator advances."""
        tokenizer = as_tokenizer(tokenizer)
        task = self.task_type
        docs = task.get_documents()
        total = len(docs)
        if limit is not None:
            docs = docs[:limit]
        fewshot = task.get_fewshot_documents()
        if isinstance(task, LogLikelihoodTask):
            llh = [
                TokenizedLLHDocument.from_document(
                    doc,
                    tokenizer,
                    fewshot_prefix(task, doc, fewshot, self.num_fewshot, self._rng),
                )
                for doc in docs
            ]
            return PreparedTask(self.name, llh_docs=llh, total_docs=total)
        requests = []
        for doc in docs:
            if doc.category not in fewshot:
                raise ValueError(f"{self.name}: no few-shot examples for category {doc.category!r}")
            prompt = generate_until_prompt(doc, fewshot[doc.category], self.num_fewshot)
            requests.append(
                TokenizedGenerateUntilDocument(prompt, tuple(encode(tokenizer, prompt)), doc.answer)
            )
        return PreparedTask(
            self.name,
            generate_requests=requests,
            tokenizer=tokenizer,
            stop_tokens=tuple(task.get_stop_string()),
            answer_regex=re.compile(task.get_answer_extraction_regex()),
            total_docs=total,
        )


# --------------------------------------------------------------------------------------------
# Running


@dataclass
class EvalTaskOptions:
    """One run of a prepared task (upstream `EvalTaskOptions`).

    `skip_and_step_by`: start at document `skip` (counting on past the end wraps around) and
    take every `step_by`-th. `limit`: at most this many documents. `cancel` and `deadline` (a
    `time.monotonic()` instant) stop the run between documents (and between generated tokens).
    `confident_only`: averages stay unreported until the task's minimum share of documents is in
    (what a client reports); False reports any average (what the evaluate example does).
    """

    model: CausalLM
    skip_and_step_by: tuple[int, int] | None = None
    live_results: RunningAverage | None = None
    cancel: CancelToken | None = None
    limit: int | None = None
    deadline: float | None = None
    confident_only: bool = True

    def stopped(self) -> bool:
        return (self.cancel is not None and self.cancel.is_set()) or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )


@dataclass(frozen=True)
class PreparedTaskResult:
    """Averages over the live results (0.0 where none is reported yet), where the next run
    starts, whether a cancel or deadline stopped this one, and how many documents it scored."""

    scores: dict[str, float]
    next_index: int
    cancelled: bool
    documents: int


@dataclass
class PreparedTask:
    name: str
    llh_docs: list[TokenizedLLHDocument] | None = None
    generate_requests: list[TokenizedGenerateUntilDocument] | None = None
    tokenizer: Any = None
    stop_tokens: tuple[str, ...] = ()
    answer_regex: re.Pattern[str] | None = None
    generate_max_tokens: int = GENERATE_UNTIL_MAX_TOKENS
    # Generated tokens of interrupted generations, by document index.
    cache: dict[int, list[int]] = field(default_factory=dict)
    total_docs: int | None = None
    """The task's documents before `prepare`'s limit (None: as many as prepared)."""

    @property
    def num(self) -> int:
        docs = self.llh_docs if self.llh_docs is not None else self.generate_requests
        return len(docs or [])

    def main_metric_name(self) -> str:
        return "acc_norm" if self.name in TASKS_WITH_ACC_NORM else "acc"

    def run(self, options: EvalTaskOptions) -> PreparedTaskResult:
        """Score the documents `options` picks into `options.live_results` (else a fresh
        average), with an entry for each metric of the task over all its documents."""
        results = options.live_results if options.live_results is not None else RunningAverage()
        floor = min_samples(self.name, self.num) if options.confident_only else None
        for metric in self._metrics():
            results.add_entry_if_needed(metric, self.num, floor)
        walk = _Walk(options, self.num)
        if not self.num:
            return PreparedTaskResult(_averages(results), walk.skip, False, 0)
        with _inference(options.model):
            if self.llh_docs is not None:
                return self._run_log_likelihood(options, results, walk)
            return self._run_generate_until(options, results, walk)

    def _metrics(self) -> list[str]:
        if self.llh_docs is None:
            return ["acc"]
        return [
            "acc",
            *(["acc_norm"] if self.name in TASKS_WITH_ACC_NORM else []),
            *(["acc_uncond"] if self.name in TASKS_WITH_ACC_UNCOND else []),
        ]

    # -- loglikelihood ------------------------------------------------------------------------

    def _run_log_likelihood(
        self, options: EvalTaskOptions, results: RunningAverage, walk: _Walk
    ) -> PreparedTaskResult:
        docs = self.llh_docs or []
        norm = self.name in TASKS_WITH_ACC_NORM
        uncond = self.name in TASKS_WITH_ACC_UNCOND
        done = 0
        for doc_index in walk:
            doc = docs[doc_index]
            scores = choice_loglikelihoods(options.model, doc)
            results.push("acc", float(_first_argmax(scores) == doc.answer))
            if norm:
                lengths = torch.tensor(
                    [len(c.encode("utf-8")) for c in doc.choices_str], dtype=torch.float32
                )
                normed = scores / lengths
                results.push("acc_norm", float(_first_argmax(normed) == doc.answer))
            if uncond:
                margins = scores - unconditional_loglikelihoods(options.model, doc)
                results.push("acc_uncond", float(_first_argmax(margins) == doc.answer))
            done += 1
        return PreparedTaskResult(
            _averages(results), walk.index + walk.fast_forward, walk.cancelled, done
        )

    # -- generation ---------------------------------------------------------------------------

    def _run_generate_until(
        self, options: EvalTaskOptions, results: RunningAverage, walk: _Walk
    ) -> PreparedTaskResult:
        requests = self.generate_requests or []
        processed = 0
        for doc_index in walk:
            request = requests[doc_index]
            generated = self.cache.pop(doc_index, [])
            complete = generate_greedy(
                options.model,
                self.tokenizer,
                request.request,
                generated,
                stop_strings=self.stop_tokens,
                max_tokens=self.generate_max_tokens,
                stopped=options.stopped,
            )
            if not complete:
                self.cache[doc_index] = generated
                continue  # the next iteration sees the cancel or the deadline
            text = self.tokenizer.decode(generated, skip_special_tokens=False)
            assert self.answer_regex is not None
            matches = list(self.answer_regex.finditer(text))
            letter = matches[-1].group(1) if matches else None
            answer = ASCII_UPPERCASE.index(letter) if letter in ASCII_UPPERCASE else None
            results.push("acc", float(answer == request.answer))
            processed += 1
        next_index = walk.fast_forward + walk.skip + processed * walk.step_by
        return PreparedTaskResult(_averages(results), next_index, walk.cancelled, processed)


def generate_greedy(
    model: CausalLM,
    tokenizer: Any,
    prompt: Sequence[int],
    generated: list[int],
    *,
    stop_strings: Sequence[str],
    max_tokens: int = GENERATE_UNTIL_MAX_TOKENS,
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Extend `generated` (the tokens already generated after `prompt`) greedily, as upstream's
    `run_generate_until`; True once complete (an end-of-sequence token, a stop string in the
    decoded generated text, or `max_tokens` generated), False when `stopped()` said so first.

    Past `model.max_context_length` tokens the oldest are dropped for good, as upstream; until
    then a KV cache saves recomputing the sequence for every token.
    """
    eos = eos_token_ids(model)
    max_context = model.max_context_length
    sequence = [*prompt, *generated]
    past: Any = None
    cache_name = _cache_argument(model.model)
    with _inference(model):
        while True:
            if stopped():
                return False
            if len(sequence) > max_context:
                del sequence[: len(sequence) - max_context]
                past = None  # the cache holds positions of the old window
            fed = sequence if past is None else sequence[-1:]
            ids = torch.tensor([fed], dtype=torch.int64, device=model.device)
            # A cache helps only if the next step keeps this window (no token dropped then).
            keep_cache = len(sequence) < max_context
            out = model.model(
                ids,
                **{cache_name: past},
                use_cache=keep_cache,
                logits_to_keep=1,
                return_dict=True,
            )
            past = out[cache_name] if keep_cache else None
            token = _last_argmax(out.logits[0, -1])
            sequence.append(token)
            generated.append(token)
            if token in eos:
                return True
            text = tokenizer.decode(generated, skip_special_tokens=False)
            if any(stop in text for stop in stop_strings):
                return True
            if len(generated) >= max_tokens:
                return True


# --------------------------------------------------------------------------------------------
# Scoring helpers


@contextlib.contextmanager
def _inference(model: CausalLM) -> Iterator[None]:
    """Eval mode and no autograd for the duration; the previous mode is restored."""
    module = model.model
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def _cache_argument(module: torch.nn.Module) -> str:
    """The KV cache's argument and output name: `cache` from transformers 5.24 on (where
    `past_key_values` is deprecated), `past_key_values` before."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class _Walk:
    """The documents one run visits, as upstream iterates them: `options.skip_and_step_by`'s
    start with whole passes over the `count` documents folded away (`fast_forward` of them),
    then every `step_by`-th, until the end of the documents, `options.limit` of them, or
    `options.stopped()` (then `cancelled`). `index`: the last document index reached (where a
    stopped run stopped)."""

    def __init__(self, options: EvalTaskOptions, count: int) -> None:
        skip, self.step_by = options.skip_and_step_by or (0, 1)
        self.fast_forward = (skip // count) * count if count else 0
        self.skip = skip - self.fast_forward
        self.index = self.skip
        self.cancelled = False
        self._options = options
        self._count = count

    def __iter__(self) -> Iterator[int]:
        options = self._options
        for num_iterations, doc_index in enumerate(_doc_indices(self.skip, self.step_by)):
            self.index = doc_index
            if options.stopped():
                self.cancelled = True
                return
            if doc_index >= self._count or (
                options.limit is not None and num_iterations >= options.limit
            ):
                return
            yield doc_index


def _doc_indices(skip: int, step_by: int) -> Iterator[int]:
    """Upstream's `docs.iter().cycle().enumerate().skip(skip).step_by(step_by)` indices."""
    index = skip
    while True:
        yield index
        index += step_by


def _averages(results: RunningAverage) -> dict[str, float]:
    return {k: (0.0 if v is None else v) for k, v in results.get_all_averages().items()}


def _first_argmax(values: torch.Tensor) -> int:
    """torch's argmax: the first of equal maxima (upstream's `Tensor::argmax`)."""
    return int(torch.argmax(values))


def _last_argmax(logits: torch.Tensor) -> int:
    """Upstream's greedy sampling: `max_by(total_cmp)`, the last of equal maxima."""
    flipped = torch.flip(logits.float(), dims=(0,))
    return int(logits.shape[0] - 1 - int(torch.argmax(flipped)))


def _padded(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Rows right-padded (with token 0) to the longest: a causal model's logits at a row's own
    positions never see the padding after them."""
    width = max(len(r) for r in rows)
    out = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def choice_loglikelihoods(model: CausalLM, doc: TokenizedLLHDocument) -> torch.Tensor:
    """Each choice's summed token log-probability given the context (float32, on the CPU).

    Every request is `[BOS] + context + choice` with the same context, so with right padding
    the last `max(choice lengths)` positions of the batch hold every choice's predictions.
    """
    keep = max(doc.choices_token_len)
    scores = torch.zeros(len(doc.requests), dtype=torch.float32)
    if keep == 0:
        return scores
    inputs = [r[:-1] for r in doc.requests]
    logits, _ = model.forward(_padded(inputs, model.device), num_logits_to_keep=keep)
    logprobs = logits.float().log_softmax(-1)
    for i, (request, n) in enumerate(zip(doc.requests, doc.choices_token_len)):
        if n == 0:
            continue
        targets = torch.tensor(request[len(request) - n :], device=logprobs.device)
        picked = logprobs[i, :n].gather(-1, targets.unsqueeze(-1))
        scores[i] = picked.sum().cpu()
    return scores


def unconditional_loglikelihoods(model: CausalLM, doc: TokenizedLLHDocument) -> torch.Tensor:
    """For each choice, the loglikelihood of its request's "Answer: {choice}" tail alone: the
    tail without BOS or context, every token after its first one scored (upstream's
    `calculate_unconditional_loglikelihood`)."""
    tails = [r[len(r) - n :] for r, n in zip(doc.requests, doc.acc_uncond_tokens_len)]
    scores = torch.zeros(len(tails), dtype=torch.float32)
    inputs = [t[:-1] for t in tails]
    if max(len(i) for i in inputs) == 0:
        return scores
    logits, _ = model.forward(_padded([i or (0,) for i in inputs], model.device))
    logprobs = logits.float().log_softmax(-1)
    for i, tail in enumerate(tails):
        if len(tail) < 2:
            continue
        targets = torch.tensor(tail[1:], device=logprobs.device)
        picked = logprobs[i, : len(tail) - 1].gather(-1, targets.unsqueeze(-1))
        scores[i] = picked.sum().cpu()
    return scores


__all__ = [
    "GENERATE_UNTIL_MAX_TOKENS",
    "TASKS_WITH_ACC_NORM",
    "TASKS_WITH_ACC_UNCOND",
    "TASKS_WITH_FIRST_N_FEWSHOT",
    "EvalTaskOptions",
    "PreparedTask",
    "PreparedTaskResult",
    "Task",
    "TokenizedGenerateUntilDocument",
    "TokenizedLLHDocument",
    "choice_loglikelihoods",
    "eos_token_ids",
    "fewshot_prefix",
    "generate_greedy",
    "generate_until_prompt",
    "min_reporting_ratio",
    "seed_bytes",
    "unconditional_loglikelihoods",
]
