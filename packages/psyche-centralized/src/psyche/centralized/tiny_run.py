"""Assets of the tiny CPU run (`configs/tiny-cpu`): a dataset and a tokenizer that need no download.

The text is the English reference documentation that ships with CPython (`pydoc_data.topics`).
The tokenizer (`configs/tiny-cpu/model/tokenizer.json`) is a small byte-level BPE trained once on
that text with `train_tiny_tokenizer` and committed; the model is built by the clients from
`config.json` with random weights, so nothing large is stored in the repository.

`write_tiny_dataset` tokenizes the topics (end-of-text between topics) and writes them as one
token file of little-endian u16 tokens, the format of the local data provider and the TCP data
server. The topics are written in several passes, each in its own seeded order, until at least
`min_sequences` sequences exist: the run's data indices never run past the dataset.
"""

from __future__ import annotations

import random
from pathlib import Path

from psyche.core.atomic_file import write_atomically

DEFAULT_SEQ_LEN = 128
DEFAULT_MIN_SEQUENCES = 4096
DEFAULT_VOCAB_SIZE = 512
END_OF_TEXT = "<|endoftext|>"
DATASET_FILE = "pydoc-topics.ds"


def pydoc_topics() -> list[str]:
    """The documentation topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_tiny_tokenizer(out_path: Path | str, *, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train the byte-level BPE on the pydoc topics and write it as `tokenizer.json`.

    Used once to produce the committed file; `END_OF_TEXT` is token 0.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(pydoc_topics(), trainer=trainer)
    out_path = Path(out_path)
    write_atomically(out_path, tokenizer.to_str(pretty=True) + "\n")
    return out_path


def tokenize_topics(tokenizer_path: Path | str) -> list[list[int]]:
    """Each topic's token ids, followed by the end-of-text token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise ValueError(f"{tokenizer_path}: no {END_OF_TEXT} token")
    if tokenizer.get_vocab_size() > 1 << 16:
        raise ValueError(f"{tokenizer_path}: vocabulary too large for 2-byte tokens")
    encodings = tokenizer.encode_batch(pydoc_topics(), add_special_tokens=False)
    return [[*e.ids, eot] for e in encodings]


def write_tiny_dataset(
    out_dir: Path | str,
    *,
    tokenizer_path: Path | str,
    seq_len: int = DEFAULT_SEQ_LEN,
    min_sequences: int = DEFAULT_MIN_SEQUENCES,
    seed: int = 0,
) -> Path:
    """Write `out_dir/pydoc-topics.ds` (2-byte LE tokens) and return its path.

    Holds at least `min_sequences` whole sequences of `seq_len` tokens as the local provider cuts
    them (it drops a file's last whole sequence, so one extra is written). Deterministic for a
    given CPython (its topics), tokenizer and seed; written atomically.
    """
    if seq_len <= 0 or min_sequences <= 0:
        raise ValueError("seq_len and min_sequences must be positive")
    docs = tokenize_topics(tokenizer_path)
    need = (min_sequences + 1) * seq_len
    tokens: list[int] = []
    passes = 0
    while len(tokens) < need:
        order = list(range(len(docs)))
        random.Random(seed * 1_000_003 + passes).shuffle(order)
        for i in order:
            tokens.extend(docs[i])
        passes += 1
    # Whole sequences only, plus the one the provider leaves out.
    whole = len(tokens) // seq_len
    tokens = tokens[: whole * seq_len]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DATASET_FILE
    data = bytearray(2 * len(tokens))
    for i, t in enumerate(tokens):
        data[2 * i] = t & 0xFF
        data[2 * i + 1] = t >> 8
    write_atomically(path, bytes(data))
    return path


__all__ = [
    "DATASET_FILE",
    "DEFAULT_MIN_SEQUENCES",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_VOCAB_SIZE",
    "END_OF_TEXT",
    "pydoc_topics",
    "tokenize_topics",
    "train_tiny_tokenizer",
    "write_tiny_dataset",
]
