"""DeepSpeed universal checkpoints: ``<tag>_universal/zero/<param>/{fp32,exp_avg,...}.pt``.

``ds_to_universal`` turns a ZeRO checkpoint (each rank's flat partitions) into one directory per
parameter, every file holding the *whole* tensor: ``fp32.pt`` the fp32 parameter (the master,
under mixed precision), ``exp_avg.pt`` / ``exp_avg_sq.pt`` Adam's moments, ``step.pt`` the step.
An expert parameter is whole too -- AutoEP's packed ``model.layers.N.mlp.experts.w1`` is
``[E, ...]`` with every EP rank's experts, marked ``is_expert_param`` with ``ep_num_experts`` --
which is why a universal checkpoint is what loads at another EP degree, and why an inspection can
read it as global tensors without the engine checkpoint it came from.

The index names each file the way the rest of the inspection reads keys: ``fp32.pt`` under the
parameter's own name, every other statistic under ``optimizer.state.<param>.<stat>``.  Files are
loaded with ``torch.load(weights_only=True, mmap=True)`` -- no code runs, and the index touches
only each file's header and pickle, not its data -- and only once :func:`~conformance.inspection.
roots.inside` finds them inside the checkpoint directory (a parameter directory linked out of it is
a :class:`~conformance.inspection.model.CheckpointError` before anything is opened).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.inspection.model import CheckpointError, CheckpointIndex, Entry, paused_gc
from conformance.inspection.roots import inside

__all__ = ["FORMAT", "read_universal", "universal_dir"]

FORMAT = "deepspeed_universal"
#: the file ``ds_to_universal`` writes a parameter's own value to.
PARAM_FILE = "fp32.pt"
#: what a universal checkpoint directory holds.
WHAT = ("a DeepSpeed universal checkpoint (a directory holding zero/<param>/fp32.pt, or a "
        "checkpoint root whose latest_universal names one)")


def _has_params(zero: Path) -> bool:
    try:
        return zero.is_dir() and any((d / PARAM_FILE).is_file() for d in zero.iterdir())
    except OSError:
        return False


def universal_dir(path: str | os.PathLike[str]) -> Path | None:
    """The universal checkpoint ``path`` names, or ``None``: the ``<tag>_universal`` directory
    itself, its ``zero`` directory, or the checkpoint root whose ``latest_universal`` names it
    (what DeepSpeed's ``load_universal`` reads)."""
    p = Path(path)
    if not p.is_dir():
        return None
    if _has_params(p / "zero"):
        return p
    if p.name == "zero" and _has_params(p):
        return p.parent
    latest = p / "latest_universal"
    if latest.is_file():
        tag = inside(p.resolve(), p / latest.read_text().strip(), "latest_universal")
        if _has_params(tag / "zero"):
            return tag
    return None


def _load(file: Path) -> Any:
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # a truncated file, or a pickle weights_only refuses
        raise CheckpointError(str(file), f"cannot be read as a tensor file ({type(exc).__name__}: "
                              f"{exc})", "a torch.save file of a tensor or a dict holding "
                              "'param'") from exc


def _tensor(value: Any, file: Path) -> Any:
    import torch

    tensor = value.get("param") if isinstance(value, dict) else value
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(str(file), f"holds {type(tensor).__name__}, not a tensor",
                              "a tensor, or a dict whose 'param' is one")
    return tensor


def _key(param: str, stat: str) -> str:
    return param if stat == PARAM_FILE[:-3] else f"optimizer.state.{param}.{stat}"


def read_universal(path: str | os.PathLike[str]) -> CheckpointIndex:
    """The index of the universal checkpoint at ``path`` (see :func:`universal_dir`), its values
    read file by file."""
    found = universal_dir(path)
    if found is None:
        raise CheckpointError(str(path), "holds no zero/<param>/fp32.pt", WHAT)
    root = found.resolve()
    files: dict[str, Path] = {}
    entries: dict[str, Entry] = {}
    with paused_gc():
        for param_dir in sorted((root / "zero").iterdir()):
            if not param_dir.is_dir():
                continue  # optimizer_state.pt: the param groups' settings, no tensor
            for file in sorted(param_dir.glob("*.pt")):
                real = inside(root, file)
                key = _key(param_dir.name, file.name[:-3])
                tensor = _tensor(_load(real), file)
                shape = tuple(tensor.shape)
                entries[key] = Entry(key, shape, str(tensor.dtype).removeprefix("torch."),
                                     (((0,) * len(shape), shape),))
                files[key] = real

    def reader(keys: Sequence[str]) -> dict[str, Any]:
        return {k: _tensor(_load(files[k]), files[k]).clone() for k in keys}

    return CheckpointIndex(str(found), FORMAT, entries, reader=reader)
