"""Where a checkpoint is: the directory given, or the one a trainer's checkpointer wrote below it.

Checkpointers write under a directory they name (``<root>/step-<n>/``,
``<root>/checkpoints/step_100/``), so ``save(path)`` and ``load(path)`` may treat ``path`` as the
run's checkpoint root.  Every reader of a checkpoint
(:func:`conformance.inspection.read_checkpoint`, :func:`~conformance.inspection.read_dcp`, and so
the matrix's checkpoint check and ``moe-ep-inspect``) asks :func:`find_checkpoint` first, and
opens a file only once :func:`inside` finds it inside the checkpoint directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from conformance.inspection.model import CheckpointError

__all__ = ["OUTSIDE", "ROOT_DEPTH", "WHAT", "dcp_dir", "find_checkpoint", "inside", "is_checkpoint"]

#: what every reader expects at the path it is given.
WHAT = "a DCP checkpoint directory (with .metadata) or a Hugging Face safetensors directory"
#: what a reader expects of the files a checkpoint names.
OUTSIDE = "only files inside the checkpoint directory (after resolving links)"

#: how far below a run's checkpoint root a checkpoint is looked for: checkpointers write under a
#: directory they name (``<root>/step-<n>``, ``<root>/checkpoints/step_100``).
ROOT_DEPTH = 3


def dcp_dir(p: Path) -> bool:
    return (p / ".metadata").exists() or (p / ".metadata").is_symlink()


def is_checkpoint(p: Path) -> bool:
    return dcp_dir(p) or any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json"))


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it is a checkpoint (or no directory: the reader says what it is); else
    the one checkpoint below it, ``ROOT_DEPTH`` levels at most, as a trainer's checkpointer writes
    under the run's root (``<root>/step-<n>/``).  Links are not followed.  Several checkpoints there
    are a :class:`CheckpointError` naming them (the caller names one); none returns ``path``, whose
    reader then says what it lacks."""
    p = Path(path)
    if not p.is_dir() or is_checkpoint(p):
        return p
    found: list[Path] = []
    level = [p]
    for _ in range(ROOT_DEPTH):
        below: list[Path] = []
        for directory in level:
            try:
                children = sorted(directory.iterdir())
            except OSError:
                continue
            for child in children:
                if child.is_dir() and not child.is_symlink():
                    (found if is_checkpoint(child) else below).append(child)
        level = below
    if len(found) > 1:
        names = ", ".join(str(f.relative_to(p)) for f in found[:6])
        more = ", ..." if len(found) > 6 else ""
        raise CheckpointError(str(p), f"holds {len(found)} checkpoints below it ({names}{more}), "
                              "not one", "a checkpoint directory, or a run's checkpoint root "
                              "holding exactly one: name the one to read")
    return found[0] if found else p


def inside(root: Path, file: Path, named: str = "") -> Path:
    """``file`` with its links resolved, refused unless it lies inside ``root`` (itself
    resolved): an index naming ``../../etc/passwd``, or a link out of the directory, is a
    :class:`CheckpointError` before anything is opened."""
    real = file.resolve()
    if real != root and root not in real.parents:
        what = f"{named}, which resolves" if named else "resolves"
        raise CheckpointError(str(file),
                              f"{what} to {real}, outside the checkpoint directory {root}", OUTSIDE)
    return real
