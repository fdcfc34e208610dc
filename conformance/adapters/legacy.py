"""The built-in ``legacy`` adapter: the reference MoE saved *without* ExpertLayout.

This is the bug as frameworks have it today: every EP rank saves its experts under local names
and shapes, and DCP keeps one rank's copy.  It is the suite's negative control -- every cell that
saves at ep > 1 must fail, and every ep=1 save (where local and global names agree) must pass; the
project's tests assert exactly that, proving the matrix can fail.  Its load is the reference load
without the ``check_saved_experts`` guard, so the damage shows as wrong values or a failed load
rather than a refusal.

It does not declare ``cross_kind``: its saves keep each kind's raw form (a packed layer's
``[rows, ...]`` tensors), which only the same kind can load, even at ep=1.  Nor has it the
reference's Hugging Face members: its bug is in the DCP save, and the reference's export would be
checked in every model cell of every legacy run to no end (the reference's own tier checks it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from conformance.adapters.reference import ReferenceAdapter


class LegacyAdapter(ReferenceAdapter):
    name = "legacy"
    #: no fine-tuning cells: the lossy save is the base layout's bug, shown in its own cells
    capabilities = replace(ReferenceAdapter.capabilities, cross_kind=False, finetune=())

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import save_legacy

        save_legacy(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import load

        load(model, optimizer, path, check_saved=False)

    check_saved = None  # type: ignore[assignment]  # no guard: that is the point
    save_legacy = None  # type: ignore[assignment]
    hf_model = export_hf = import_hf = hf_forward = None  # type: ignore[assignment]
