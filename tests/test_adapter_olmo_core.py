"""The ``olmo_core`` adapter end to end: OLMo-core 3.0.0 through a small subset of the matrix.

Skipped unless OLMo-core is installed (``ci/install_olmo_core.sh`` installs the pinned 3.0.0).  The
subset, from the full tier and asserted *as found* (the whole tier runs in ``ci/conformance.sh``;
its counts are in docs/frameworks/olmo_core.md), is five packed cells in OLMo-core's consecutive EP
groups:

* ep2c->ep2c without FSDP, model and model+optimizer: pass with every check OLMo-core can run (no
  ``forward``: its kernels need a GPU).  OLMo-core stores ``w1/w2/w3`` flattened,
  ``(E * rows, cols)``; the checkpoint check learns that from the ep=1 save's content and compares
  those keys by value;
* FSDP, model+optimizer, E=5 ep1->ep1 and E=4 ep1->ep2c: pass.  FSDP2 over 4 ranks cuts the
  flattened weights mid-expert at ep=1 (E=5: 80 ``w1`` rows, 20 per rank), and the E=4 load side is
  OLMo-core's EP + HSDP composition (``prepare_experts_for_fsdp`` shards each EP rank's experts over
  ``dp_replicate``);
* E=5, ep1->ep4, model+optimizer: a ``refused`` cell whose first line is OLMo-core's own refusal of
  E % ep != 0 (``MoEMLPBase._shard_experts``: ``OLMoConfigurationError``), with the file and line
  that raised it.

The outcomes are asserted through ``ci/expectations/olmo_core.toml``, the file a framework team
would keep.

The negative control plants a load that leaves the optimizer out (``load_model_and_optim_state``
with ``optim=None``): the ``values`` check names the moment that kept its pre-load values.

Measured on a 2-core machine shared with other jobs (load average 18-25): the subset 59-78 s (its
two-cell predecessor took 43-110 s), the control 52 s.
"""

from __future__ import annotations

import pytest
from matrix_expectations import assert_as_expected, by_status, expectations_args, run_report

pytest.importorskip("olmo_core",
                    reason="OLMo-core is not installed (ci/install_olmo_core.sh installs "
                                        "ai2-olmo-core==3.0.0)")

SUBSET = ("kind_packed and ((save_ep2 and load_ep2 and save_consecutive and load_consecutive and "
          "not fsdp and not E5 and not legacy) or (model+optim and fsdp and save_ep1 and (E5 and "
          "load_ep1 or not E5 and load_ep2 and load_consecutive)) or "
          "(model+optim and E5 and not fsdp and save_ep1 and load_ep4))")
CELL = "moe-ep-matrix::checkpoint::packed::{state}::ep-only::ep2c->ep2c"
FSDP_E5 = "moe-ep-matrix::checkpoint::packed::model+optim::fsdp::E5::ep1->ep1"
FSDP_HSDP = "moe-ep-matrix::checkpoint::packed::model+optim::fsdp::ep1->ep2c"
UNEVEN = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::E5::ep1->ep4"
CELLS = {CELL.format(state=s) for s in ("model", "model+optim")} | {FSDP_E5, FSDP_HSDP}
REFUSAL = ("OLMoConfigurationError: 'num_experts' (5) must be divisible by the expert parallel "
           "shard degree (4).")


#: the seeded bug, written into the pytester directory so the matrix subprocess (and its ranks) can
#: import it.
SEEDED = '''
from conformance.adapters.olmo_core import OlmoCoreAdapter


class OptimizerNotLoaded(OlmoCoreAdapter):
    """Seeded bug: the load restores the model only, so the optimizer keeps what the load side
    built."""

    def load(self, model, optimizer, path):
        super().load(model, None, path)
'''


def test_olmo_core_subset_as_found(pytester: pytest.Pytester) -> None:
    result, doc = run_report(pytester, "--moe-ep-matrix=full", "--moe-ep-adapter=olmo_core", "-k",
                             SUBSET, *expectations_args("olmo_core"))
    assert doc["adapter"] == {"name": "olmo_core", "version": "3.0.0"}
    # the uneven cell's refusal is expected: the session is green
    cells = assert_as_expected(result, doc)
    assert {i for i, c in cells.items() if c["status"] == "pass"} == CELLS
    assert doc["summary"] == {"pass": 4, "fail": 0, "stopped": 1, "n/a": 0}
    assert (cells[UNEVEN]["finding"] == "refused"
            and cells[UNEVEN]["expectation"] in ("met", "updated"))
    for cell_id in CELLS:
        cell = cells[cell_id]
        assert "bit for bit" in cell["detail"] and "checkpoint" in cell["detail"], cell
        assert "checkpoint" not in cell.get("skipped_checks", {}), cell
    detail = cells[UNEVEN]["detail"]
    assert (detail.startswith("refused: ")
            and "the framework refused the load side's build at ep=4" in detail), detail
    assert f"{REFUSAL} (raised at olmo_core/" in detail, detail


def test_olmo_core_negative_control_optimizer_not_loaded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(olmo_core_seeded=SEEDED)
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2,4",
                        "--moe-ep-adapter=olmo_core_seeded:OptimizerNotLoaded",
                        "-k", "kind_packed and model+optim and save_ep2 and load_ep2 and not fsdp")
    cells, _, _ = by_status(doc)
    cell = cells[CELL.format(state="model+optim")]
    assert cell["status"] == "fail", cell
    # caught by the values check, ahead of the checkpoint findings every cell has
    assert cell["finding"] == "silent", cell
    assert cell["detail"].split(": ", 1)[1].startswith(
        "first difference: rank 0, layer 0, expert 0, tensor "
        "'w1.exp_avg': still holds its pre-load (seed B) values"), \
        cell["detail"]
