"""The data the inspection works on and what it reports: plain frozen dataclasses, no torch.

A :class:`CheckpointIndex` is what a checkpoint's metadata says (key -> global shape, dtype,
chunks), read without touching tensor data; a :class:`CheckpointProblem` is one problem, in expert
terms.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["CheckpointError", "CheckpointIndex", "CheckpointProblem", "Entry", "Reader",
           "expert_ranges", "paused_gc"]

#: ``reader(keys) -> {key: value}``: tensors in global form (torch.Tensor), other entries as the
#: Python values they hold.  One call may hold every value it returns in memory at once.
Reader = Callable[[Sequence[str]], dict[str, Any]]


class CheckpointError(Exception):
    """A path that cannot be inspected: not a checkpoint, corrupt or unreadable.

    ``path`` is the file or directory at fault, ``problem`` what was wrong with it, ``expected``
    what the inspection needed there.
    """

    def __init__(self, path: str, problem: str, expected: str) -> None:
        self.path, self.problem, self.expected = str(path), problem, expected
        super().__init__(f"{self.path}: {problem}; expected {expected}")


class Entry(NamedTuple):
    """One checkpoint key.  ``shape is None`` marks a non-tensor entry (DCP bytes: step, lr, ...).
    A named tuple: a 180,000-key checkpoint makes 180,000 of them."""

    key: str
    shape: tuple[int, ...] | None
    dtype: str | None = None  # torch's name without "torch.": "float32", "bfloat16"
    #: ``(offsets, sizes)`` of every stored piece; a whole tensor is one chunk at offset 0.
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def nbytes_hint(self) -> int:
        """Elements of the global tensor (a size estimate for batching reads); 1 for non-tensors."""
        n = 1
        for s in self.shape or ():
            n *= s
        return n


@dataclass(frozen=True)
class CheckpointIndex:
    """A checkpoint's keys as its metadata describes them, and how to read their values."""

    path: str
    format: str  # "dcp" | "safetensors" | "state_dict" | "deepspeed_universal"
    entries: Mapping[str, Entry]
    #: structural problems found while reading (a key listed by an index but absent from its file).
    problems: tuple[CheckpointProblem, ...] = ()
    reader: Reader | None = field(default=None, compare=False, repr=False)


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: building 10^6 small objects (a 180,000-key index) runs
    5x faster without the collector rescanning them every 700 allocations; nothing made here is
    cyclic.

    On the way out what was made goes straight to the oldest generation (``gc.freeze()`` then
    ``gc.unfreeze()``): re-enabled with a million young objects, the collector's next young
    collection would scan them all (0.8 s of a 3.4 s read of the 179k-key metadata); in the oldest
    generation only the next full collection looks at them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def expert_ranges(experts: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``: expert lists stay one short line."""
    ids = sorted(set(experts))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}..{ids[j]}")
        i = j + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class CheckpointProblem:
    """One problem.  ``problem`` is a stable code (see ``PROBLEMS``), ``key`` the checkpoint key
    (``*`` standing for the expert id of per-expert keys), ``experts`` the global expert ids
    concerned, ``other_key`` the other checkpoint's key a comparison involves; ``message`` says
    what is wrong and what was expected, in expert terms, without repeating layer or key."""

    problem: str
    key: str
    message: str
    layer: int | None = None
    experts: tuple[int, ...] = ()
    other_key: str | None = None

    def __str__(self) -> str:
        where = [f"layer {self.layer}"] if self.layer is not None else []
        if self.key:
            where.append(f"key {self.key!r}")
        if self.experts:
            where.append(f"expert{'s' if len(self.experts) > 1 else ''} "
                         f"{expert_ranges(self.experts)}")
        return f"{', '.join(where)}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"problem": self.problem, "key": self.key, "layer": self.layer,
                "experts": list(self.experts),
                "other_key": self.other_key, "message": self.message, "text": str(self)}


#: every problem code, with what it means; the CLI's --json and the README list them.
PROBLEMS: dict[str, str] = {
    "hf_missing": "--hf-model: a key the model class has is not in the export",
    "hf_unexpected": "--hf-model: a key in the export the model class neither has nor ignores",
    "hf_shape": "--hf-model: a key whose shape is not the model class's (transposed, one rank's "
    "rows)",
    "no_expert_keys": "no key matched an expert pattern: nothing was checked (add --expert-key)",
    "local_extent": "a packed key's expert axis has fewer rows than experts: one EP rank's local "
    "count", "extent_mismatch": "a packed key's expert axis has more rows than experts",
    "local_numbering": "per-expert keys are numbered 0..k-1 only (k < E): one EP rank's local "
    "names",
    "missing_experts": "experts absent from a per-expert family, or expert rows no chunk covers",
    "unknown_experts": "per-expert keys with ids >= E",
    "duplicate_experts": "expert rows stored by more than one chunk",
    "chunk_hole": "a tensor's chunks do not cover it", "chunk_overlap": "a tensor's chunks overlap",
    "shape_mismatch": "per-expert tensors of one family differ in shape or dtype",
    "layer_missing": "an expert key present for some MoE layers and not others",
    "optimizer_missing": "optimizer state present for some experts' weights but not for these",
    "optimizer_orphan": "optimizer state for an expert weight the checkpoint does not hold",
    "index_mismatch": "a safetensors index and its files disagree",
    "key_missing": "compare: a key of the other checkpoint is absent",
    "key_unexpected": "compare: a key the other checkpoint does not have",
    "key_rekeyed": "compare: non-tensor fields the other checkpoint holds under other keys "
    "(whether values agree)", "shape_differs": "compare: global shapes differ",
    "dtype_differs": "compare: dtypes differ",
    "entry_kind_differs": "compare: a tensor in one checkpoint, a non-tensor entry in the other",
    "holds_other_key": "compare: the key holds the other checkpoint's value of another key",
    "ids_moved": "compare: positional optimizer ids (Optimizer.state_dict()) hold other "
                 "parameters' state",
    "rows_are_other_experts": "compare: rows of a key's expert axis hold other experts' values",
    "values_differ": "compare: values differ and match nothing in the other checkpoint",
    "holds_other_expert": "an expert key (or packed row) holds the model's tensor of another "
    "expert or layer", "value_differs": "compare: a non-tensor entry (step, lr, ...) differs",
    "export_holds_other": "conversion: an export's expert matrix holds another expert's, "
    "layer's or projection's values, or the shared expert's",
    "export_missing": "conversion: experts of the training checkpoint whose values are nowhere in "
    "the export", "export_values_differ": "conversion: an expert matrix of the export differs "
    "from its own in the training checkpoint beyond --ulps and matches no other",
    "export_transposed": "conversion: a projection stored transposed against the export's other "
    "projections", "export_unexpected": "conversion: expert matrices of the export the training "
    "checkpoint has no counterpart of",
}
