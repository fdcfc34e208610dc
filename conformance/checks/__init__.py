"""What one checkpoint cell checks, on every rank, and the diagnosis when it fails.

One module per promise of the matrix:

- :mod:`.artifact` -- the checkpoint is EP-invariant (``checkpoint``);
- :mod:`.values` -- every tensor equals the ep=1 ground truth after the load (``values``);
- :mod:`.completeness` -- nothing goes missing, per replica group (``missing``);
- :mod:`.resume` -- optimizer scalars, the forward and the next step (``scalars``, ``forward``, ``resume``);
- :mod:`.layout` -- the framework formed the cell's EP groups (a mismatch is an ``error``);
- :mod:`.refusal` -- a legacy (lossy) checkpoint is refused (``refusal``);
- :mod:`.blame` -- a load that raises is blamed on the side the evidence shows wrong;

with :mod:`.truth` (the ground truth, cached per spec), :mod:`.verdict` (what a rank reports) and
:mod:`.cell` (the experiment that runs them all: :func:`run_cell`).
"""

from conformance.checks.blame import LoadFailed
from conformance.checks.cell import CellPlan, run_cell
from conformance.checks.truth import SEED_A, SEED_B
from conformance.checks.verdict import CHECKS, Mismatch, Problem, RankVerdict

__all__ = ["CHECKS", "SEED_A", "SEED_B", "CellPlan", "LoadFailed", "Mismatch", "Problem", "RankVerdict", "run_cell"]
