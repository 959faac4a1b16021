"""The progress of a long wait, for a person watching it: a line every few seconds while a
model downloads from peers or a checkpoint uploads, and nothing for a wait shorter than that.

    async with trio.open_nursery() as nursery:
        nursery.start_soon(log_progress, logger, describe)   # describe() -> the line, or None
        await the_long_wait()
        nursery.cancel_scope.cancel()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

PROGRESS_INTERVAL = 5.0
"""Seconds between two progress lines of a long wait (a model download from peers)."""


async def log_progress(
    logger: logging.Logger, describe: Callable[[], str | None], interval: float = PROGRESS_INTERVAL
) -> None:
    """Until cancelled, every `interval` seconds log what `describe` says (nothing when it says
    None): a person watching a long wait sees it move. Start it beside the wait and cancel it
    when the wait ends; a wait shorter than `interval` logs nothing."""
    while True:
        await trio.sleep(interval)
        text = describe()
        if text is not None:
            logger.info("%s", text)


class _Collected(Protocol):
    @property
    def parameters(self) -> Mapping[str, Any] | None: ...


class _ModelDownload(Protocol):
    @property
    def model(self) -> _Collected: ...


def model_download_progress(download: _ModelDownload) -> str:
    """How far a model download from peers (`psyche.network.ModelDownload`) is, for a person
    waiting on it."""
    parameters = download.model.parameters
    if not parameters:
        return "downloading the model from peers: waiting for its configuration"
    done = [t for t in parameters.values() if t is not None]
    size = sum(t.numel() * t.element_size() for t in done)
    return (
        f"downloading the model from peers: {len(done)}/{len(parameters)} parameters "
        f"({size / 1e6:,.1f} MB)"
    )


__all__ = ["PROGRESS_INTERVAL", "log_progress", "model_download_progress"]
