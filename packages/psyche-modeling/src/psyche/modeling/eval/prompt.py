"""The prompt task (upstream `shared/client/src/state/prompt.rs`): while evaluations run, a client
continues one of a fixed list of prompts token by token and reports the new tokens with its
witness metadata (`prompt_results`, at most `MAX_TOKENS_TO_SEND`, and `prompt_index`).

Each `run` samples one token (temperature 0.6 over the whole vocabulary, a fresh random seed per
token, as upstream); the tokens wait in `tokens_to_send` until the client takes them. A prompt
ends at an end-of-sequence token or after 256 generated tokens; the next `run` then switches to a
randomly chosen prompt. `prompt_texts.json` is upstream's list, in upstream's order (the index is
what clients report).
"""

from __future__ import annotations

import functools
import json
import random
import threading
from importlib import resources
from typing import Any

import torch

from psyche.coordinator.run_state import MAX_TOKENS_TO_SEND
from psyche.modeling.causal_lm import CausalLM
from psyche.modeling.eval.harness import _inference, as_tokenizer, encode, eos_token_ids
from psyche.modeling.trainer import CancelToken

PROMPT_TASK_NAME = "Prompt"
MAX_TOKENS_TO_GENERATE = 256
TEMPERATURE = 0.6


@functools.cache
def get_prompt_texts() -> tuple[str, ...]:
    data = json.loads(resources.files(__package__).joinpath("prompt_texts.json").read_text("utf-8"))
    return tuple(p["text"] for p in data["prompts"])


class PromptTask:
    """One client's running prompt. `run` is called from the evaluation thread, `take_results`
    and `selected_prompt` from the client's: the shared state is behind a lock."""

    def __init__(
        self,
        selected_prompt: int,
        text: str,
        tokenizer: Any,
        rng: random.Random | None = None,
    ) -> None:
        self.tokenizer = as_tokenizer(tokenizer)
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._selected = selected_prompt
        self._tokens = encode(self.tokenizer, text, add_special_tokens=True)
        self._original_len = len(self._tokens)
        self._finished = False
        self._to_send: list[int] = []

    @classmethod
    def random(cls, tokenizer: Any, rng: random.Random | None = None) -> PromptTask:
        """A task on a randomly chosen prompt (upstream picks one when the client starts)."""
        rng = rng or random.Random()
        texts = get_prompt_texts()
        index = rng.randrange(len(texts))
        return cls(index, texts[index], tokenizer, rng)

    @property
    def selected_prompt(self) -> int:
        with self._lock:
            return self._selected

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._finished

    def take_results(self) -> list[int]:
        """The tokens generated since the last call (upstream `get_prompt_results` clears them)."""
        with self._lock:
            out, self._to_send = self._to_send, []
            return out

    def _reset_with_new_prompt(self) -> None:
        texts = get_prompt_texts()
        index = self._rng.randrange(len(texts))
        self._selected = index
        self._tokens = encode(self.tokenizer, texts[index], add_special_tokens=True)
        self._original_len = len(self._tokens)
        self._finished = False

    def run(self, model: CausalLM, cancel: CancelToken | None = None) -> bool:
        """Generate one token; False when nothing was done (the buffer is full, or cancelled)."""
        with self._lock:
            if self._finished:
                self._reset_with_new_prompt()
            if len(self._to_send) >= MAX_TOKENS_TO_SEND:
                return False
            if cancel is not None and cancel.is_set():
                return False
            token_len = len(self._tokens)
            max_context = model.max_context_length
            if token_len > max_context:
                del self._tokens[: token_len - max_context]
            tokens = list(self._tokens)
        with _inference(model):
            ids = torch.tensor([tokens], dtype=torch.int64, device=model.device)
            logits, _ = model.forward(ids, num_logits_to_keep=1)
            probs = (logits[0, -1].float() / TEMPERATURE).softmax(-1).cpu()
        generator = torch.Generator().manual_seed(self._rng.getrandbits(63))
        token = int(torch.multinomial(probs, 1, generator=generator))
        with self._lock:
            if token in eos_token_ids(model):
                self._finished = True
            # Measured before the token is added (and before any truncation), as upstream.
            if token_len - self._original_len >= MAX_TOKENS_TO_GENERATE:
                self._finished = True
            self._to_send.append(token)
            self._tokens.append(token)
        return True
