"""``python -m conformance.inspect DIR`` (console script ``moe-ep-inspect``): check a checkpoint on
disk.

Does the checkpoint hold every expert of every MoE layer exactly once under its global id?  From
the metadata alone (DCP ``.metadata``, or a Hugging Face safetensors index and headers), with no
process group; ``--compare OTHER --values`` also reads every value, one batch at a time.

Exit status: 0 clean, 1 problems found, 2 usage error or unreadable input (one line on stderr).
Nothing is ever written to the checkpoint directories.  The checks are
:mod:`conformance.inspection`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from conformance.inspection import (
    DEFAULT_MEMORY_BYTES,
    DEFAULT_PATTERNS,
    CheckpointError,
    CheckpointIndex,
    CheckpointProblem,
    Inspection,
    compare_indexes,
    expert_ranges,
    inspect_index,
    pattern,
    read_checkpoint,
)
from conformance.inspection.conversion import compare_conversion, is_conversion
from conformance.rounding import ROUNDING_ULPS
from pytest_moe_ep.text import shorten

__all__ = ["main"]
PROG = "moe-ep-inspect"
SCHEMA_VERSION = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Check that a MoE checkpoint holds every expert of every layer once, under its "
        "global id (DCP or Hugging Face safetensors; metadata only unless --values).",
        epilog="exit status: 0 clean, 1 problems found, 2 usage error or unreadable checkpoint")
    p.add_argument("path", metavar="DIR",
                   help="checkpoint directory (DCP .metadata, or *.safetensors + index)")
    p.add_argument("--experts", type=int, metavar="E",
                   help="number of experts per layer, when the checkpoint has "
                   "no recognised router to read it from")
    p.add_argument("--expert-key", action="append", default=[], metavar="REGEX",
                   help="regex of expert-holding keys, tried before the built-in ones; a named "
                   "group (?P<expert>\\d+) marks per-expert keys, else the key is packed with the "
                   "expert axis first")
    p.add_argument("--compare", metavar="OTHER_DIR",
                   help="also check that OTHER_DIR (say, the same model saved "
                   "at ep=1) holds the same keys, global shapes and dtypes")
    p.add_argument("--values", action="store_true",
                   help="with --compare: compare every value too, streamed")
    p.add_argument("--ulps", type=float, default=0.0, metavar="N",
                   help="with --values: take values within N ulps of each other as equal (a fused "
                   "kernel's rounding on a differently shaped shard; the matrix uses "
                   f"{ROUNDING_ULPS}; default %(default)s: bit for bit)")
    p.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_BYTES >> 20, metavar="MB",
                   help="with --values: read at most this much per batch (default %(default)s)")
    p.add_argument("--hf-model", metavar="CLASS",
                   help="also check a Hugging Face export against transformers' CLASS "
                   "(Qwen3MoeForCausalLM, ...): every key and shape it has, none it lacks "
                   "(metadata only; needs transformers)")
    p.add_argument("--hf-config", metavar="FILE",
                   help="with --hf-model: the config's fields as JSON (model_type among them), for "
                   "an export without config.json")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also list every expert-holding key family")
    return p


def _summary(result: Inspection) -> list[str]:
    c = result.counts
    layers = f"{len(result.moe_layers)} MoE layer(s)" + (f" ({expert_ranges(result.moe_layers)})"
                                                          if result.moe_layers else "")
    experts = (f"{result.num_experts} experts (from {result.num_experts_source})"
               if result.num_experts else "number of experts unknown")
    packed = sum(g.kind == "packed" and g.stat is None for g in result.groups)
    families = sum(g.kind == "per_expert" and g.stat is None for g in result.groups)
    stats = sorted({g.stat for g in result.groups if g.stat})
    return [f"{result.path}: {result.format} checkpoint, {c.get('keys', 0)} keys "
            f"({c.get('tensors', 0)} tensors, "
            f"{c.get('non_tensors', 0)} other entries); {layers}; {experts}",
            f"expert keys: {c.get('expert_keys', 0)} ({packed} packed weights, {families} "
            "per-expert weight families"
            f"{'; optimizer state ' + ', '.join(stats) if stats else '; no optimizer state'})"]


def _where(f: CheckpointProblem) -> str:
    layer = f"layer {f.layer}" if f.layer is not None else "-"
    experts = (f"expert{'s' if len(f.experts) > 1 else ''} {expert_ranges(f.experts)}" if f.experts
               else "-")
    return f"{layer:<9} {experts:<16} {f.key}"


def _lines(problems: Sequence[CheckpointProblem]) -> list[str]:
    """One line per problem (layer, experts, key), under the explanation the problems share."""
    groups: dict[tuple[str, str], list[CheckpointProblem]] = {}
    for f in sorted(problems, key=lambda f: (f.layer is None, f.layer or 0, f.key)):
        groups.setdefault((f.problem, f.message), []).append(f)
    out: list[str] = []
    for (problem, message), group in sorted(groups.items(),
                                            key=lambda kv: list(problems).index(kv[1][0])):
        if len(group) == 1:
            out.append(f"  {problem}: {_where(group[0])}: {message}")
            continue
        out.append(f"  {problem}: {message}")
        out += [f"    {_where(f)}" for f in group]
    return out


def _run(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    patterns = (*(pattern(r) for r in args.expert_key), *DEFAULT_PATTERNS)
    index = read_checkpoint(args.path)
    result = inspect_index(index, num_experts=args.experts, patterns=patterns)
    text = _summary(result)
    if args.verbose:
        text += [
            f"  layer {g.layer}: {g.key}{' [' + g.stat + ']' if g.stat else ''} ({g.kind}, extent "
            f"{g.extent}): experts {expert_ranges(g.experts) or 'none'}" for g in result.groups]
    if result.findings:
        text.append(f"{len(result.findings)} problem(s):")
        text += _lines(result.findings)
    else:
        text.append("OK: every expert of every MoE layer is stored once under its global id"
                    + (", with optimizer state for every expert"
                       if any(g.stat for g in result.groups) else ""))
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "inspection": result.as_dict(),
                              "compare": None}
    problems = len(result.findings)
    hf_target = (index, args.path)  # what --hf-model checks: the export, in a conversion
    if args.compare:
        other = read_checkpoint(args.compare)
        if is_conversion(index, other):
            problems += len(_conversion(args, index, other, patterns, text, report))
            if other.format == "safetensors":
                hf_target = (other, args.compare)
        else:
            found = compare_indexes(index, other, values=args.values, patterns=patterns,
                                    memory_bytes=max(1, args.memory_mb) << 20,
                                    rounding_ulps=args.ulps,
                                    names=("checkpoint", "other checkpoint"))
            what = "keys, global shapes, dtypes" + (" and every value" if args.values else "")
            text.append(f"compared with the other checkpoint {args.compare} ({what}): "
                        + (f"{len(found)} difference(s):" if found else "the same"))
            text += _lines(found)
            report["compare"] = {"other": args.compare, "values": args.values,
                                 "findings": [f.as_dict() for f in found]}
            problems += len(found)
    if args.hf_model:
        from conformance.inspection.hf_model import hf_model_problems

        found = hf_model_problems(hf_target[0], args.hf_model, hf_target[1], args.hf_config)
        text.append(f"against transformers' {args.hf_model} (keys and shapes): "
                    + (f"{len(found)} difference(s):" if found else "the same"))
        text += _lines(found)
        report["hf_model"] = {"class": args.hf_model,
                              "findings": [f.as_dict() for f in found]}
        problems += len(found)
    report["problems"] = problems
    return (1 if problems else 0), report, text


def _conversion(args: argparse.Namespace, index: CheckpointIndex, other: CheckpointIndex,
                patterns: Sequence[Any], text: list[str],
                report: dict[str, Any]) -> list[CheckpointProblem]:
    """A training checkpoint against its Hugging Face export (one of each format): every expert by
    value, whichever side ``DIR`` is (:mod:`conformance.inspection.conversion`)."""
    export_is_other = other.format == "safetensors"
    training, export = (index, other) if export_is_other else (other, index)
    hf_names = None
    if args.hf_model:  # transformers' names pair what values cannot (equal experts)
        from conformance.inspection.hf_model import _config, hf_model_shapes

        own, hub, _ = hf_model_shapes(args.hf_model, _config(
            args.compare if export_is_other else args.path, args.hf_config))
        hf_names = (args.hf_model, own.keys() | hub.keys())
    found = compare_conversion(training, export, patterns=patterns,
                               memory_bytes=max(1, args.memory_mb) << 20,
                               rounding_ulps=args.ulps, hf_names=hf_names)
    head = (f"compared with its Hugging Face export {args.compare}" if export_is_other
            else f"compared with the training checkpoint it was exported from {args.compare}")
    text.append(f"{head} (every expert matrix by value, {found.atoms} of the training "
                "checkpoint; the key mapping learned from the values"
                + (f"; {found.tied} matrices whose values equal another's paired by "
                   f"{found.tie_names} instead" if found.tied else "")
                + (f"; {found.cast}" if found.cast else "") + "): "
                + (f"{len(found.problems)} problem(s):" if found.problems else "the same"))
    text += _lines(found.problems)
    if args.verbose:
        text.append("mapping (training checkpoint -> export, learned from the values"
                    + (", ties by name" if found.tied else "") + "):")
        text += [f"  {line}" for line in found.mapping]
    if found.notes:
        text.append("notes (no problem):")
        text += [f"  {note}" for note in found.notes]
    report["compare"] = {"other": args.compare, "values": True, "conversion": found.as_dict(),
                         "findings": [f.as_dict() for f in found.problems]}
    return found.problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.values and not args.compare:
        parser.error("--values needs --compare OTHER_DIR")
    if args.hf_config and not args.hf_model:
        parser.error("--hf-config needs --hf-model CLASS")
    if args.experts is not None and args.experts < 1:
        parser.error(f"--experts must be a positive number of experts, got {args.experts}")
    try:
        code, report, text = _run(args)
    except (CheckpointError, ValueError, ImportError) as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # never a traceback; MOE_EP_INSPECT_DEBUG=1 shows it
        if os.environ.get("MOE_EP_INSPECT_DEBUG"):
            raise
        print(f"{PROG}: error: {type(exc).__name__}: {shorten(str(exc), 500)} "
              "(set MOE_EP_INSPECT_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    if args.json:
        report["exit_code"] = code
    try:
        print(json.dumps(report, indent=2, default=str) if args.json else "\n".join(text))
        sys.stdout.flush()
    except BrokenPipeError:  # `moe-ep-inspect DIR | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


if __name__ == "__main__":
    sys.exit(main())
