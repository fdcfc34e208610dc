"""A seeded save that deadlocks: the negative control of the matrix's hang handling.

:class:`SaveDeadlocks` is the reference adapter whose save, before DCP's, all-reduces a norm per
expert over its EP group -- one collective per expert *it holds* -- the way a framework that files
experts by a truncating split (``E // ep`` per rank) believes every EP rank runs the same number.
At E=5 over ep=2 the ranks hold 3 and 2 experts: the rank with 3 waits in its third all-reduce for
a peer that already entered DCP's save, where it waits for everyone.  Planted at one save only,
``unpacked::model::fsdp::E5::ep2.etp2``, so every other cell of a slice is its no-false-alarm
control; each attempt of the save is counted in ``save-attempts.log`` beside this module (rank 0,
one line per attempt), so a test can tell a save tried once from one tried by every reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.adapters import reference

#: where rank 0 counts the attempts of the deadlocking save (beside this module).
ATTEMPTS = Path(__file__).with_name("save-attempts.log")


def _deadlocks(spec: Any) -> bool:
    layout = spec.layout
    return (layout is not None and spec.kind == "unpacked" and spec.num_experts == 5 and spec.fsdp
            and not spec.optimizer_steps and (layout.pp, layout.ep, layout.etp) == (1, 2, 2))


class SaveDeadlocks(reference.ReferenceAdapter):
    """The reference, without its HF members, whose save at ``unpacked::model::fsdp::E5::ep2.etp2``
    deadlocks (see the module docstring)."""

    name = "seeded-save-deadlocks"
    hf_model = export_hf = import_hf = hf_forward = None

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        model, optimizer = super().build(spec, mesh, seed)
        if mesh is not None and _deadlocks(spec):
            from reference_impl.meshes import sliced

            model.seeded_ep_group = sliced(mesh, ("ep",)).get_group()
        return model, optimizer

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        group = getattr(model, "seeded_ep_group", None)
        if group is not None:
            import torch
            import torch.distributed as dist

            from reference_impl.expert_layout import moe_layers

            if dist.get_rank() == 0:
                with ATTEMPTS.open("a") as f:
                    f.write(f"{path}\n")
            _, moe = next(iter(moe_layers(model)))
            for _ in range(moe.num_local_experts):  # 3 on one EP rank, 2 on the other
                dist.all_reduce(torch.zeros(1), group=group)
        super().save(model, optimizer, path)
