"""DeepSpeed's universal checkpoint for the ``deepspeed-autoep`` adapters: which EP degree a
checkpoint was saved at, its conversion (``deepspeed.checkpoint.ds_to_universal``) once per saved
checkpoint, and the ``load_universal`` flag for one ``load_checkpoint`` call.

A saved directory serves any number of later loads: the conversion's output stays beside the saved
tag (``<tag>_universal`` and ``latest_universal``, which DeepSpeed writes last, so its presence
means a complete conversion) and is never redone; global rank 0 converts under a file lock (loads of
one checkpoint in concurrent worlds convert it once) and broadcasts its outcome, so a failed
conversion fails every rank instead of leaving the others waiting at a barrier.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from typing import Any

from conformance.adapter import FrameworkRefusal

__all__ = ["convert_locked", "convert_once", "load_universal", "saved_ep"]


def _tag(path: str) -> str:
    with open(os.path.join(path, "latest")) as fd:
        return fd.read().strip()


def saved_ep(path: str) -> int:
    """The AutoEP degree the checkpoint in ``path`` was saved at, from its own model-states file."""
    import torch

    tag_dir = os.path.join(path, _tag(path))
    state = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu",
                       weights_only=False)
    return int(state["ds_config"]["expert_parallel"]["autoep_size"])


def convert_once(path: str) -> None:
    """``ds_to_universal`` of the checkpoint in ``path`` unless done before (a collective; see the
    docstring)."""
    import torch.distributed as dist

    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            convert_locked(path)
        except Exception as exc:  # every rank must learn of it; see the docstring
            outcome[0] = f"ds_to_universal failed: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(outcome, src=0)
    # DeepSpeed's conversion failed on rank 0: its refusal, on every rank
    if outcome[0] is not None:
        raise FrameworkRefusal(outcome[0])


def convert_locked(path: str) -> None:
    """The conversion in this process: one extract and one merge worker, since rank processes may
    not fork a process pool."""
    from types import SimpleNamespace

    from deepspeed.checkpoint import ds_to_universal

    with open(os.path.join(path, ".universal.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(path, "latest_universal")):
            return
        tag = _tag(path)
        output = os.path.join(path, f"{tag}_universal")
        shutil.rmtree(output, ignore_errors=True)  # an interrupted conversion's leftovers
        args = SimpleNamespace(
            input_folder=os.path.join(path, tag), output_folder=output, num_extract_workers=1,
            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
        with (open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet),
              contextlib.redirect_stderr(quiet)):
            ds_to_universal.main(args)  # its progress lines and bars; a failure still raises


@contextlib.contextmanager
def load_universal(engine: Any, universal: bool) -> Iterator[None]:
    """``checkpoint.load_universal`` for one ``load_checkpoint`` call.

    DeepSpeed reads the flag only while loading (``runtime/engine.py``: ``load_checkpoint``,
    ``_load_checkpoint``, ``_load_zero_checkpoint``, ``_get_all_ckpt_names``), so setting it on the
    engine's config for the call is what a fresh job configured with it does."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
