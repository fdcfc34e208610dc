"""What one checkpoint cell checks, on every rank: one module per check, named as the report names
it, and one row per check in :mod:`.table` -- its finding, its promise, when and in which cells it
runs, and its module's ``run(ctx)`` (:class:`~.context.CheckContext`).  The rows, in order:

- :mod:`.checkpoint` -- the checkpoint is EP-invariant (with :mod:`conformance.inspection`, which
  reads checkpoints, and :mod:`.save_plan`, which explains a save DCP refused);
- :mod:`.values` -- every tensor equals what the checkpoint holds after the load (:mod:`.saved`: the
  save side's tensors), and that the ep=1 ground truth;
- :mod:`.missing` -- nothing goes missing, per replica group;
- :mod:`.scalars` -- the optimizer's and the training state's scalars come back;
- :mod:`.resume` -- the next training step equals uninterrupted training;
- :mod:`.forward` -- the framework's forward after the load equals the truth's;
- :mod:`.hf_export` and :mod:`.hf_import` -- the Hugging Face checkpoint a release ships (what they
  share: :mod:`.hf`);
- :mod:`.layout` -- the framework formed the cell's EP groups and pipeline stages;
- :mod:`.setup` -- the experiment itself is sound;
- :mod:`.refusal` -- a legacy (lossy) checkpoint is refused;

with :mod:`.truth` (the ground truth), :mod:`.held` (a rank's tensors as the checks read them),
:mod:`.blame` (a load that raises is blamed on the side the evidence shows wrong),
:mod:`.load_plan`, :mod:`.verdict` (what a rank reports) and :mod:`.cell` (the experiment that runs
them all: :func:`run_cell`).
"""

from conformance.checks.blame import LoadFailed
from conformance.checks.table import CHECKS
from conformance.checks.truth import SEED_A, SEED_B
from conformance.checks.verdict import Mismatch, Problem, RankVerdict

__all__ = ["CHECKS", "SEED_A", "SEED_B", "LoadFailed", "Mismatch", "Problem", "RankVerdict"]
