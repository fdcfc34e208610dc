"""Which checkpoint cells exist for an adapter, and why a cell is ``n/a``.

A cell is one save/load experiment: save at ``save_ep``, load at ``load_ep``, for a layer kind
(packed, unpacked, or one kind saved and the other loaded), a state (the model alone, or the model
with its optimizer), with or without FSDP2 over ``dp_shard``, at ``num_experts`` experts.  The
default matrix adds uneven cells (E=6, so ep=4 leaves a rank without experts) and legacy cells (a
checkpoint saved the old, lossy way must be refused).  A cell the adapter's capabilities rule out
stays in the matrix as ``n/a`` with the reason -- nothing is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conformance.adapter import Capabilities, Spec

KINDS = ("packed", "unpacked")
STATES = ("model", "model+optim")
EVEN_EXPERTS = 4
UNEVEN_EXPERTS = 6
OPTIMIZER_STEPS = 2


@dataclass(frozen=True)
class Cell:
    save_kind: str
    load_kind: str
    state: str
    fsdp: bool
    save_ep: int
    load_ep: int
    num_experts: int
    legacy: bool = False
    #: why the cell does not apply to this adapter; empty when it runs.
    na: str = ""

    @property
    def kind(self) -> str:
        return self.save_kind if self.save_kind == self.load_kind else f"{self.save_kind}->{self.load_kind}"

    @property
    def node_name(self) -> str:
        """The readable part of the node id, e.g. ``checkpoint::unpacked::model+optim::fsdp::ep2->ep4``."""
        pair = f"ep{self.save_ep}->ep{self.load_ep}"
        if self.legacy:
            return f"checkpoint::legacy::{self.kind}::{pair}"
        parts = ["checkpoint", self.kind, self.state, "fsdp" if self.fsdp else "ep-only"]
        if self.num_experts != EVEN_EXPERTS:
            parts.append(f"E{self.num_experts}")
        return "::".join([*parts, pair])

    def spec(self, base: Spec, kind: str) -> Spec:
        steps = OPTIMIZER_STEPS if self.state == "model+optim" else 0
        return replace(base, kind=kind, num_experts=self.num_experts, optimizer_steps=steps, fsdp=self.fsdp)


def _why_not(cell: Cell, caps: Capabilities) -> str:
    for kind in {cell.save_kind, cell.load_kind}:
        if kind not in caps.kinds:
            return f"adapter supports layer kinds {', '.join(caps.kinds)}, not {kind}"
    if cell.save_kind != cell.load_kind and not caps.cross_kind:
        return "adapter does not declare cross_kind (loading one layer kind's checkpoint into the other)"
    if cell.state == "model+optim" and not caps.optimizer:
        return "adapter does not support optimizer state"
    if cell.fsdp and not caps.fsdp:
        return "adapter does not support FSDP2"
    if max(cell.save_ep, cell.load_ep) > caps.max_ep:
        return f"adapter supports ep up to {caps.max_ep}"
    if not caps.uneven and any(cell.num_experts % ep for ep in (cell.save_ep, cell.load_ep)):
        return f"adapter does not support E % ep != 0 (E={cell.num_experts})"
    return ""


def _with_reason(cell: Cell, caps: Capabilities, extra: str = "") -> Cell:
    return replace(cell, na=extra or _why_not(cell, caps))


def checkpoint_cells(caps: Capabilities, eps: list[int], *, has_legacy: bool = True) -> list[Cell]:
    """The default matrix for an adapter with ``caps`` over the EP degrees ``eps``."""
    pairs = [(s, t) for s in eps for t in eps]
    cells: list[Cell] = []
    for kind in KINDS:
        for state in STATES:
            for fsdp in (False, True):
                cells += [_with_reason(Cell(kind, kind, state, fsdp, s, t, EVEN_EXPERTS), caps) for s, t in pairs]
    for save_kind, load_kind in (("packed", "unpacked"), ("unpacked", "packed")):
        cells += [_with_reason(Cell(save_kind, load_kind, "model+optim", False, s, t, EVEN_EXPERTS), caps)
                  for s, t in pairs]
    uneven = [(s, t) for s, t in pairs if UNEVEN_EXPERTS % s or UNEVEN_EXPERTS % t]
    for kind in KINDS:
        cells += [_with_reason(Cell(kind, kind, "model+optim", False, s, t, UNEVEN_EXPERTS), caps)
                  for s, t in uneven]
    multi = [ep for ep in eps if ep > 1]
    if multi:
        save_ep = multi[0]
        for kind in KINDS:
            for load_ep in eps:
                cell = Cell(kind, kind, "model+optim" if caps.optimizer else "model", False, save_ep, load_ep,
                            EVEN_EXPERTS, legacy=True)
                extra = "" if has_legacy else "adapter has no save_legacy (its old, lossy save)"
                cells.append(_with_reason(cell, caps, extra))
    return cells


def parse_eps(text: str | None, world_size: int) -> list[int]:
    """``--moe-ep-matrix`` value to EP degrees; the default is every divisor of the world size."""
    if text in (None, "", "default"):
        return [ep for ep in range(1, world_size + 1) if world_size % ep == 0]
    try:
        eps = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise ValueError(f"--moe-ep-matrix takes comma-separated EP degrees such as 1,2,4, got {text!r}") from exc
    bad = [ep for ep in eps if ep < 1 or world_size % ep]
    if bad or not eps:
        raise ValueError(f"EP degrees {bad or eps} do not divide the world size {world_size}; "
                         f"choose from {[ep for ep in range(1, world_size + 1) if world_size % ep == 0]}")
    return eps
