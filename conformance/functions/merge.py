"""The controller side of a functions-suite cell: fold the ranks' records into one per function."""

from __future__ import annotations

from conformance.functions.rank import SHOWN

__all__ = ["merge_rank_records"]


def merge_rank_records(per_rank: list[list[dict]]) -> list[dict]:
    """One record per function across ranks: failed if any rank failed, its detail from the first
    such rank."""
    merged: dict[str, dict] = {}
    for records in per_rank:
        for record in records:
            name = record["function"]
            if name not in merged:
                merged[name] = {**record, "disagreements": list(record["disagreements"]),
                                "failed_num_experts": list(record.get("failed_num_experts", [])),
                                "ranks": list(record.get("ranks", []))}
                continue
            into = merged[name]
            into["count"] += record["count"]
            into["disagreements"] = (into["disagreements"] + record["disagreements"])[:SHOWN]
            into["failed_num_experts"] = sorted({*into["failed_num_experts"],
                                                 *record.get("failed_num_experts", [])})
            into["ranks"] = sorted({*into["ranks"], *record.get("ranks", [])})
            if record["status"] == "fail" and into["status"] != "fail":
                into["status"], into["detail"] = "fail", record["detail"]
    for record in merged.values():
        if len(record["ranks"]) > 1:
            record["detail"] += (f" (failing ranks: {record['ranks']}, {record['count']} "
                                 "disagreements)")
    return list(merged.values())
