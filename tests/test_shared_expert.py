"""``Capabilities.shared_expert``: a family without a shared expert (Qwen3-MoE) is declared, every
cell's spec asks for none, and the ``setup`` check holds the build to it.

Two small reference runs (HF members off: the checks here are the DCP path's): the reference
declaring no shared expert builds none and passes; an adapter that declares none but builds one
anyway is an ``error`` naming the shared expert's tensor, in every cell.
"""

from __future__ import annotations

import dataclasses

import pytest
from matrix_expectations import by_status, run_report

pytestmark = pytest.mark.usefixtures("shared_fork_server")

ADAPTERS = '''
import dataclasses

from conformance.adapters.reference import ReferenceAdapter


class NoShared(ReferenceAdapter):
    capabilities = dataclasses.replace(ReferenceAdapter.capabilities, shared_expert=False)
    hf_model = export_hf = import_hf = hf_forward = None
    built_shared = []

    def build(self, spec, mesh, seed):
        model, optimizer = super().build(spec, mesh, seed)
        NoShared.built_shared.append(any("shared" in n for n, _ in model.named_parameters()))
        assert not NoShared.built_shared[-1], "the reference built a shared expert"
        return model, optimizer


class SharedAnyway(NoShared):
    def build(self, spec, mesh, seed):
        return ReferenceAdapter.build(self, dataclasses.replace(spec, shared_expert=True), mesh,
                                      seed)
'''
K = "kind_packed and save_ep1 and (load_ep1 or load_ep2) and not optim and E4 and not legacy"


def _run(pytester: pytest.Pytester, adapter: str) -> tuple[dict, dict[str, set[str]]]:
    pytester.makepyfile(shared_adapters=ADAPTERS)
    _, doc = run_report(pytester, "--moe-ep-matrix=1,2",
                        f"--moe-ep-adapter=shared_adapters:{adapter}", "-k", K, inline=True)
    cells, statuses, _ = by_status(doc)
    assert {c["load_ep"] for c in cells.values() if c["status"] != "n/a"} == {1, 2}, cells
    return cells, statuses


def test_a_family_without_a_shared_expert_is_declared_and_built_so(
        pytester: pytest.Pytester) -> None:
    _, statuses = _run(pytester, "NoShared")
    assert set(statuses) <= {"pass", "n/a"}, statuses


def test_a_build_holding_the_shared_expert_the_spec_left_out_is_an_error(
        pytester: pytest.Pytester) -> None:
    cells, statuses = _run(pytester, "SharedAnyway")
    assert set(statuses) <= {"fail", "n/a"} and statuses.get("fail"), statuses
    for cell_id in statuses["fail"]:
        assert cells[cell_id]["outcome"] == "error", cells[cell_id]
        first = cells[cell_id]["detail"].splitlines()[0]
        assert "[setup]" in first and "capabilities.shared_expert=False" in first, first
        assert "shared-expert tensor(s), e.g. 'layers.0.moe.shared.down.weight'" in first, first


def test_the_spec_follows_the_capability() -> None:
    from conformance.adapter import Capabilities, Spec

    fields = {f.name: f.default for f in dataclasses.fields(Capabilities)}
    assert fields["shared_expert"] is True and Spec().shared_expert is True
