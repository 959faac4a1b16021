"""Generate the tiny CPU run's dataset (data/tiny-cpu/, gitignored) from CPython's pydoc text.

    .venv/bin/python scripts/make_tiny_dataset.py          # skips when already present
    .venv/bin/python scripts/make_tiny_dataset.py --force  # rewrite it

The output directory and sequence length come from configs/tiny-cpu/data.toml; the tokenizer is
configs/tiny-cpu/model/tokenizer.json. See psyche.centralized.tiny_run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny-cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rewrite an existing dataset")
    parser.add_argument("--data-config", type=Path, default=CONFIG / "data.toml")
    parser.add_argument("--tokenizer", type=Path, default=CONFIG / "model" / "tokenizer.json")
    args = parser.parse_args()

    from psyche.centralized.tiny_run import DATASET_FILE, write_tiny_dataset
    from psyche.data_provider import DataServerInfo

    info = DataServerInfo.load(args.data_config)
    out_dir = Path(info.dir).resolve()
    target = out_dir / DATASET_FILE
    if target.exists() and not args.force:
        print(f"tiny dataset: {target.relative_to(REPO)} exists (--force to rewrite)")
        return 0
    started = time.perf_counter()
    path = write_tiny_dataset(out_dir, tokenizer_path=args.tokenizer, seq_len=info.seq_len)
    tokens = path.stat().st_size // info.token_size.num_bytes
    print(
        f"tiny dataset: wrote {path.relative_to(REPO)} ({tokens} tokens, "
        f"{tokens // info.seq_len} sequences of {info.seq_len}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
