"""Checkpoint inspection: does a checkpoint hold every expert of every layer once, under its global
id?

The library behind ``python -m conformance.inspect`` and the matrix's checkpoint checks.  No
process group, no argparse; torch is imported only when a DCP checkpoint is read.

    index = read_checkpoint(path)                  # or read_dcp / read_safetensors /
    index_state_dict result = inspect_index(index, num_experts=None)  # metadata only ->
    Inspection(.findings) result = inspect_checkpoint(path, num_experts)   # the two in one call
    problems = compare_indexes(got, want, values=True, names=("ep=2 checkpoint", "ep=1 checkpoint"))

Every problem is a :class:`CheckpointProblem` (``problem`` code from ``PROBLEMS``, ``key``,
``layer``, ``experts``, ``other_key``, ``message``); unreadable input raises
:class:`CheckpointError` (``path``, ``problem``, ``expected``).
"""

from conformance.inspection.compare import DEFAULT_MEMORY_BYTES, attribute_experts, compare_indexes
from conformance.inspection.coverage import (
    ExpertGroup,
    Inspection,
    inspect_checkpoint,
    inspect_index,
)
from conformance.inspection.digests import digest
from conformance.inspection.keys import (
    DEFAULT_PATTERNS,
    KeyInfo,
    KeyPattern,
    classify_keys,
    pattern,
)
from conformance.inspection.model import (
    PROBLEMS,
    CheckpointError,
    CheckpointIndex,
    CheckpointProblem,
    Entry,
    expert_ranges,
)
from conformance.inspection.readers import index_state_dict, read_checkpoint, read_dcp
from conformance.inspection.safetensors_reader import read_safetensors

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_PATTERNS",
    "PROBLEMS",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointProblem",
    "Entry",
    "ExpertGroup",
    "Inspection",
    "KeyInfo",
    "KeyPattern",
    "attribute_experts",
    "classify_keys",
    "compare_indexes",
    "digest",
    "expert_ranges",
    "index_state_dict",
    "inspect_checkpoint",
    "inspect_index",
    "pattern",
    "read_checkpoint",
    "read_dcp",
    "read_safetensors",
]
