"""Evaluations between rounds (upstream `shared/client/src/state/evals.rs`), run: while the
trainer is idle (its round's training is done, the next round has not started), a worker thread
scores the `--eval-tasks` on the model with `psyche.modeling.eval.EvalRunner`; the next round's
training step stops it first and gets the model back.

    worker = EvalWorker(settings, tokenizer_json, model, nursery, on_scores)
    worker.start()          # the trainer is idle: evaluate in a thread
    await worker.stop()     # the trainer needs the model: cancel, wait for the thread

What is guaranteed:

* the model is never evaluated while it trains: `stop()` returns only once the evaluation
  thread has let go of it (it checks its cancel token between documents and generated tokens,
  so the wait is about one document's forward pass, as upstream's);
* tokenizing the tasks (which may take long for large datasets) happens once, in its own thread,
  and never holds up `stop()`: until it is done, `start()` does nothing;
* an evaluation that fails is switched off with one warning; training goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import trio

from psyche.client.background import in_abandoned_thread
from psyche.client.observe.evals import EvalSettings, split_scores

if TYPE_CHECKING:
    from psyche.modeling.causal_lm import CausalLM
    from psyche.modeling.eval import EvalRunner, TaskScore

log = logging.getLogger(__name__)

EVAL_SLICE_SECONDS = 2.0
"""Seconds of one `run_some` call: scores are reported after each slice."""


class EvalWorker:
    """Runs `EvalRunner.run_some` in a worker thread while the trainer is idle (see the module
    docstring). Every method is called from the client's trio loop."""

    def __init__(
        self,
        settings: EvalSettings,
        tokenizer_json: str,
        model: CausalLM,
        nursery: trio.Nursery,
        on_scores: Callable[[Mapping[str, float], frozenset[str]], None] | None = None,
        *,
        slice_seconds: float = EVAL_SLICE_SECONDS,
    ) -> None:
        self.settings = settings
        self.model = model
        self.runner: EvalRunner | None = None
        self.failed = False
        self.slices = 0
        self.documents = 0
        self.prompt_tokens = 0
        self._tokenizer_json = tokenizer_json
        self._nursery = nursery
        self._on_scores = on_scores
        self._slice_seconds = slice_seconds
        self._cancel: threading.Event | None = None
        self._stopped: trio.Event | None = None
        self._last_scores: dict[str, float] = {}
        nursery.start_soon(self._prepare)

    @property
    def running(self) -> bool:
        return self._stopped is not None

    async def _prepare(self) -> None:
        from psyche.modeling.eval import EvalRunner

        settings = self.settings

        def make() -> EvalRunner:
            from tokenizers import Tokenizer

            return EvalRunner(
                settings.tasks,
                Tokenizer.from_str(self._tokenizer_json),
                max_docs=settings.max_docs,
                prompt_task=settings.prompt_task,
            )

        try:
            runner = await in_abandoned_thread(make)
        except Exception as e:
            self._fail(e)
            return
        self.runner = runner
        log.info(
            "evaluations ready: %s",
            ", ".join([*runner.task_names, *(["prompt"] if runner.prompt else [])]),
        )

    def _fail(self, error: BaseException) -> None:
        self.failed = True
        log.warning(
            "evaluations failed and are off for the rest of the run: %s",
            error,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def start(self) -> None:
        """The trainer is idle: evaluate until `stop`. Nothing happens while the tasks are still
        being prepared, after a failure, or when already running."""
        if self.runner is None or self.failed or self.running:
            return
        cancel = threading.Event()
        stopped = trio.Event()
        self._cancel, self._stopped = cancel, stopped
        self._nursery.start_soon(self._run, self.runner, cancel, stopped)

    async def _run(self, runner: EvalRunner, cancel: threading.Event, stopped: trio.Event) -> None:
        try:
            while not cancel.is_set():
                report = await trio.to_thread.run_sync(
                    lambda: runner.run_some(self.model, seconds=self._slice_seconds, cancel=cancel)
                )
                self.slices += 1
                self.documents += report.documents
                self.prompt_tokens += report.prompt_tokens
                self._report_scores(runner)
                if report.stopped_by == "idle":
                    break
        except Exception as e:
            self._fail(e)
        finally:
            stopped.set()
            if self._stopped is stopped:
                self._cancel = self._stopped = None

    def _report_scores(self, runner: EvalRunner) -> None:
        scores, partial = split_scores(runner.task_scores())
        if scores and scores != self._last_scores:
            self._last_scores = dict(scores)
            if self._on_scores is not None:
                self._on_scores(scores, partial)

    def scores(self) -> dict[str, float]:
        """Each task's latest score (empty until enough documents are in)."""
        return {} if self.runner is None else self.runner.scores()

    def task_scores(self) -> dict[str, TaskScore]:
        """`scores` with the documents each averages and its task's size (`partial`)."""
        return {} if self.runner is None else self.runner.task_scores()

    def prompt_results(self) -> tuple[list[int], int]:
        """The prompt task's tokens since the last call, and which prompt (for the witness
        metadata, as upstream's `get_prompt_results` / `get_prompt_index`)."""
        if self.runner is None:
            return [], 0
        return self.runner.take_prompt_results(), self.runner.prompt_index

    async def stop(self) -> None:
        """Cancel the evaluation and return once its thread has let go of the model (at once
        when none is running)."""
        stopped = self._stopped
        if stopped is None:
            return
        assert self._cancel is not None
        self._cancel.set()
        await stopped.wait()


__all__ = ["EVAL_SLICE_SECONDS", "EvalWorker"]
