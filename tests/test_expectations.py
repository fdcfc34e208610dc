"""The expectations file on its own (no world): parsing and its errors, which entry a cell gets, how
an outcome is judged, and how an update rewrites the file while keeping what a person wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.expectations import (
    MET,
    TOLERATED,
    UNMET,
    UPDATED,
    Baseline,
    Expectations,
    ExpectationsError,
    judge,
    parse,
    parse_tolerate,
    read,
    updated_text,
)
from conformance.findings import FINDINGS, ordered, severity, worst

A = "moe-ep-matrix::checkpoint::packed::model::ep-only::ep2->ep2"
B = "moe-ep-matrix::checkpoint::packed::model::ep-only::ep2->ep4"
C = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::ep4->ep4"
UNIVERSE = [A, B, C, "moe-ep-matrix::checkpoint::packed::model::ep-only::E6::ep2->ep4"]

FILE = f'''# a team's comment at the top
# pinned to nothing: any adapter may be held against it

# the same-EP reload hands ranks each other's experts: acme#12
[[cell]]
id = "{A}"
finding = "silent"
reason = "acme#12"

[[cell]]
id = "checkpoint::packed::*::ep2->ep4"   # the prefix may be left off
finding = "refused"
reason = "DCP refuses the local shapes"

# this one is kept verbatim when nothing changes
[[cell]]
id = "{C}"
finding = "on-disk"
reason = "acme#13"
'''


def test_findings_order_is_the_one_place_that_says_which_is_worse() -> None:
    assert FINDINGS == ("silent", "on-disk", "refused", "error")
    assert ordered(["error", "silent", "refused", "silent"]) == ["silent", "refused", "error"]
    assert worst([]) == "pass" and worst(["refused", "on-disk"]) == "on-disk"
    assert (severity("pass") < severity("error") < severity("refused") < severity("on-disk")
            < severity("silent"))
    assert ordered(["made-up"]) == ["error"]  # never dropped silently


def test_an_exact_id_wins_and_the_last_matching_pattern_wins_among_patterns() -> None:
    text = FILE + '''
[[cell]]
id = "*::ep2->ep4"
finding = "error"
reason = "a later, broader line"
'''
    found = parse("x.toml", text)
    assert found.expected(A).outcome == "silent" and found.expected(A).by == A
    assert found.expected(B).outcome == "error"  # the later pattern
    assert found.expected(B).reason == "a later, broader line"
    assert (found.expected("moe-ep-matrix::checkpoint::unpacked::model::ep-only::ep1->ep1").outcome
            == "pass")


@pytest.mark.parametrize(("text", "problem"), [
    ("[[cell]\nid=", "not valid TOML"),
    ('[[cell]]\nid = "x"\nfinding = "lost"\n',
     "unknown finding 'lost'; expected one of pass, silent, on-disk"),
    ('[[cell]]\nfinding = "silent"\n', "no 'id'"),
    ('[[cell]]\nid = "x"\nfinding = "silent"\nwhy = "?"\n', "unknown key(s) 'why'"),
    ('cells = 1\n', "unknown key(s) 'cells'"),
    ('[[cell]]\nid = "x"\nfinding = 3\n', "'finding' must be a string"),
    (f'[[cell]]\nid = "{A}"\nfinding = "silent"\n[[cell]]\nid = "{A}"\nfinding = "refused"\n',
     "the same id as entry 1"),
    ('adapter = "acme"\n[[cell]]\nid = "x"\nfinding = "silent"\nadapter = "other"\n',
     "names adapter 'other'"),
])
def test_a_broken_file_says_what_is_wrong(text: str, problem: str) -> None:
    with pytest.raises(ExpectationsError) as info:
        parse("x.toml", text)
    assert problem in str(info.value) and str(info.value).startswith("x.toml: "), str(info.value)


def test_read_checks_the_ids_against_every_cell_and_the_adapter_pin(tmp_path: Path) -> None:
    path = tmp_path / "e.toml"
    path.write_text('[[cell]]\nid = "checkpoint::nope::*"\nfinding = "silent"\n')
    with pytest.raises(ExpectationsError,
                       match=r"the pattern 'moe-ep-matrix::checkpoint::nope::\*' names no cell "
                                                r"of any tier \(world size 4\)"):
        read(path, universe=UNIVERSE, universe_note=" (world size 4)")
    path.write_text(f'adapter = "acme_fw"\n[[cell]]\nid = "{A}"\nfinding = "silent"\n')
    assert read(path, adapter="acme-fw", universe=UNIVERSE).entries  # - and _ alike
    with pytest.raises(ExpectationsError,
                       match="is for adapter 'acme_fw'; this session checks 'reference'"):
        read(path, adapter="reference")
    with pytest.raises(ExpectationsError, match="no such file"):
        read(tmp_path / "absent.toml")
    assert read(tmp_path / "absent.toml", missing_ok=True).entries == []


def test_the_ids_of_pipeline_cells_are_known_with_and_without_mtp_layers() -> None:
    """An adapter without MTP layers runs the cells with pipeline stages without them (node ids
    without ``mtp``): its expectations file may name them."""
    from conformance.session import _universe

    ids, _ = _universe(None, 4, (4, 5))
    cell = "moe-ep-matrix::checkpoint::packed::model+optim::ep-only::{}E5::ep1->pp2.ep2"
    assert {cell.format(""), cell.format("mtp::")} <= set(ids)


def test_judging_names_what_was_expected_and_what_came_back() -> None:
    found = parse("x.toml", FILE)
    assert judge(found.expected(A), "silent").state == MET
    now = judge(found.expected(A), "pass")
    assert now.state == UNMET and now.text.startswith("now passes (expected silent "
                                                      "by ") and "update" in now.text
    worse = judge(found.expected(B), "silent")
    assert (worse.state == UNMET and worse.text.startswith("worse than expected: expected refused")
            and worse.text.endswith("got silent"))
    better = judge(found.expected(C), "refused")
    assert better.state == UNMET and better.text.startswith("better than expected")
    unnamed = judge(found.expected("moe-ep-matrix::checkpoint::x"), "refused")
    assert unnamed.state == UNMET and "(not in the expectations file)" in unnamed.text
    assert judge(found.expected("moe-ep-matrix::checkpoint::x"), "refused", ("refused",
                 )).state == TOLERATED
    # the file's silent is not tolerated
    assert judge(found.expected(A), "refused", ("refused",)).state == UNMET
    assert Baseline(found, update=True).judge(A, "pass").state == UPDATED


def test_tolerate_takes_loud_findings_only() -> None:
    assert parse_tolerate("error, refused") == ("error", "refused")
    assert parse_tolerate(None) == ()
    with pytest.raises(ValueError, match="never tolerated wholesale"):
        parse_tolerate("refused,silent")
    with pytest.raises(ValueError, match="the findings are"):
        parse_tolerate("typo")


def test_an_update_keeps_unchanged_entries_verbatim_and_marks_what_it_wrote() -> None:
    current = parse("x.toml", FILE)
    outcomes = {A: "silent", C: "on-disk", B: "refused"}
    same = updated_text(current, outcomes, adapter="acme", by="me")
    assert same.text == FILE and same.changes == 0
    new = "moe-ep-matrix::checkpoint::packed::model::ep-only::E6::ep2->ep4"
    update = updated_text(current, {A: "pass", C: "silent", new: "error"}, adapter="acme",
                          by="me today")
    assert (update.added, update.changed, update.removed) == ([new], [C], [A])
    text = update.text
    # A passes now: its entry and comment go
    assert "acme#12" not in text and "# the same-EP reload" not in text
    assert "# a team's comment at the top" in text and "# the prefix may be left off" in text
    # a changed entry keeps its comments
    assert "# this one is kept verbatim when nothing changes" in text
    again = parse("x.toml", text)
    assert again.expected(C).outcome == "silent" and "was on-disk" in again.expected(C).reason
    assert "written by me today" in again.expected(C).reason
    assert (again.expected(new).outcome == "error"
            and again.expected(new).reason.startswith("TODO: error"))
    # the pattern: untouched, and cells that ran did not touch it
    assert again.expected(B).outcome == "refused"


def test_an_update_overrides_a_pattern_and_drops_exact_entries_the_pattern_covers() -> None:
    current = parse("x.toml", FILE)
    update = updated_text(current, {B: "pass"}, adapter="acme", by="me")
    assert update.added == [B]
    assert parse("x.toml", update.text).expected(B).outcome == "pass"
    back = updated_text(parse("x.toml", update.text), {B: "refused"}, adapter="acme", by="me")
    assert back.removed == [B] and back.text == FILE


def test_a_first_update_writes_a_file_that_names_its_adapter_in_a_comment() -> None:
    update = updated_text(Expectations(Path("new.toml")), {A: "on-disk", C: "pass"},
                          adapter="legacy", by="me")
    assert update.added == [A]
    assert "# Written for adapter legacy." in update.text and "adapter =" not in update.text
    assert parse("new.toml", update.text).expected(A).outcome == "on-disk"


def test_an_inline_table_file_is_updated_without_its_layout() -> None:
    text = f'adapter = "acme"\ncell = [{{id = "{A}", finding = "silent", reason = "r"}}]\n'
    update = updated_text(parse("x.toml", text), {C: "refused"}, adapter="acme", by="me")
    assert not update.kept_comments and "comments not kept" in update.summary("x.toml")
    again = parse("x.toml", update.text)
    assert (again.adapter == "acme" and again.expected(A).outcome == "silent"
            and again.expected(C).outcome == "refused")
