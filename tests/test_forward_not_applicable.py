"""``forward`` raising :class:`conformance.adapter.NotApplicable`: the check is skipped with the
adapter's reason.

The reference adapter with a forward that cannot run at ep > 1 (on the load side) or at all (on the
ground truth too): the cells still pass on their other checks, and each record's ``skipped_checks``
carries the reason -- the mechanism the framework adapters use to name what stops their forward (a
dispatcher, a GPU-only kernel).  A forward raising anything else still errors the cell.  Three small
reference runs of a few cells each.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from matrix_expectations import by_status, run_report

pytestmark = pytest.mark.usefixtures("shared_fork_server")

ADAPTERS = '''
from conformance.adapter import NotApplicable
from conformance.adapters.reference import ReferenceAdapter


class NoForwardAtEp2(ReferenceAdapter):
    def forward(self, model, batch):
        if getattr(model, "_ep", 1) > 1:
            raise NotApplicable("the dispatcher cannot run at ep=2")
        return super().forward(model, batch)

    def build(self, spec, mesh, seed):
        model, optimizer = super().build(spec, mesh, seed)
        object.__setattr__(model, "_ep", 1 if mesh is None else mesh["ep"].size())
        return model, optimizer


class NoForwardAnywhere(ReferenceAdapter):
    def forward(self, model, batch):
        raise NotApplicable("a GPU-only kernel")


class ForwardBroken(ReferenceAdapter):
    def forward(self, model, batch):
        raise RuntimeError("not a NotApplicable")
'''
K = ("kind_unpacked and save_ep1 and (load_ep1 or load_ep2) and not fsdp and not optim and E4 and "
     "not legacy")


def _cells(pytester: pytest.Pytester, adapter: str) -> tuple[dict[str, Any], dict[str, set[str]]]:
    pytester.makepyfile(fwd_adapters=ADAPTERS)
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2", f"--moe-ep-adapter=fwd_adapters:{adapter}",
                        "-k", K, inline=True)
    cells, statuses, _ = by_status(doc)
    assert {c["load_ep"] for c in cells.values() if c["status"] != "n/a"} == {1, 2}, cells
    return cells, statuses


def test_forward_not_applicable_at_one_ep_names_the_reason(pytester: pytest.Pytester) -> None:
    cells, statuses = _cells(pytester, "NoForwardAtEp2")
    assert set(statuses) <= {"pass", "n/a"}, statuses
    for cell in cells.values():
        if cell["status"] == "pass" and cell["load_ep"] == 2:
            assert cell["skipped_checks"] == {"forward": "the framework's forward cannot run in "
                                              "this cell: the dispatcher cannot run at ep=2"}, cell
            assert ("forward check skipped: the framework's forward cannot run in this cell"
                    in cell["detail"]), cell
        elif cell["status"] == "pass":
            assert not cell["skipped_checks"], cell
            assert re.search(r"\(checks: [a-z_, ]*\bforward\b", cell["detail"]), cell


def test_forward_not_applicable_on_the_truth_names_it_in_every_cell(
        pytester: pytest.Pytester) -> None:
    cells, statuses = _cells(pytester, "NoForwardAnywhere")
    assert set(statuses) <= {"pass", "n/a"}, statuses
    for cell in cells.values():
        if cell["status"] == "pass":
            assert cell["skipped_checks"] == {"forward": "the framework's forward cannot run on "
                                              "the ep=1 ground truth: a GPU-only kernel"}, cell


def test_forward_raising_anything_else_errors_the_cell(pytester: pytest.Pytester) -> None:
    """The negative control: only NotApplicable is a reason; any other exception is the framework's
    failure."""
    cells, statuses = _cells(pytester, "ForwardBroken")
    ran = {i for i, c in cells.items() if c["status"] != "n/a"}
    assert statuses.get("stopped") == ran, statuses
    assert all("RuntimeError: not a NotApplicable" in cells[i]["detail"] for i in ran), cells
