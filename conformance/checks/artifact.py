"""The checkpoint itself is EP-invariant: saved at any layout, it holds what the ep=1 save holds.

Two questions, both answered by :mod:`conformance.inspection` (the same code ``python -m
conformance.inspect`` runs on real checkpoints):

- does the checkpoint hold every expert of every layer once under its global id (metadata alone:
  expert axes, chunk coverage, per-expert ids, layers, optimizer moments)?
- does it hold the same keys, global shapes, dtypes and values -- tensors and non-tensor entries
  (step, lr) alike -- as the ep=1 save of the same model (the truth checkpoint)?

and, of the truth checkpoint itself: does each expert key (or packed row) hold the model's own tensor of
that expert -- the ground truth's view of the model -- and not another expert's?

A bug that round-trips its own mistake (experts saved and loaded under the same wrong ids) passes
every check of the loaded model, and only this one catches it: the comparison with the ep=1 save
when the mistake depends on the EP degree, the attribution when it does not.  A DCP checkpoint is read directly
from its files on one rank, with no process group; another format through the adapter's optional
``read_checkpoint``.  Keys the adapter declares EP-dependent (``ep_dependent_keys``) are left out.
"""

from __future__ import annotations

from typing import Any

from conformance.adapter import capabilities_of


def read_index(adapter: Any, path: str) -> Any:
    """The checkpoint's index, or ``None`` when this adapter's format cannot be read here."""
    from conformance.inspection import index_state_dict, read_dcp

    if capabilities_of(adapter).format == "dcp":
        return read_dcp(path)
    reader = getattr(adapter, "read_checkpoint", None)
    if callable(reader):
        return index_state_dict(reader(path), path, format=capabilities_of(adapter).format)
    return None


def not_applicable(adapter: Any) -> str:
    """Why the checkpoint check cannot run for ``adapter`` ("" when it can)."""
    if capabilities_of(adapter).format == "dcp" or callable(getattr(adapter, "read_checkpoint", None)):
        return ""
    return (f"the adapter's checkpoint format ({capabilities_of(adapter).format}) is not DCP and it has no "
            "read_checkpoint(path)")


def checkpoint_findings(adapter: Any, path: str, truth_path: str, num_experts: int) -> list[str]:
    """Every way the checkpoint at ``path`` differs from an EP-invariant one, in expert terms."""
    from conformance.inspection import compare_indexes, inspect_index

    index, truth = read_index(adapter, path), read_index(adapter, truth_path)
    found = [str(f) for f in inspect_index(index, num_experts=num_experts).findings]
    ignore = tuple(getattr(adapter, "ep_dependent_keys", ()) or ())
    found += [str(f) for f in compare_indexes(index, truth, values=True, ignore=ignore,
                                              names=("checkpoint", "ep=1 checkpoint"))]
    return list(dict.fromkeys(found))


def truth_findings(adapter: Any, truth_path: str, truth_state: dict[Any, Any]) -> list[str]:
    """Expert keys of the ep=1 (truth) checkpoint that hold another expert's tensor of the model."""
    from conformance.inspection import attribute_experts, digest

    index = read_index(adapter, truth_path)
    owners = {digest(t): key for key, t in truth_state.items() if key[1] is not None and t.dim()}
    return [f"the ep=1 checkpoint: {f}" for f in attribute_experts(index, owners)]
