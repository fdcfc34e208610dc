"""What one checkpoint cell checks, on every rank, and the diagnosis when it fails.

:func:`run_cell` runs on each rank of the world (the world engine calls it):

1. build at ``save_ep`` with seed A (optimizer steps included for model+optimizer cells), save;
2. build at ``load_ep`` with seed B, and check it differs from the ground truth -- otherwise a
   load that does nothing would pass;
3. load, and compare every tensor the adapter yields for this rank bit for bit with the ground
   truth: the same build at ep=1 with seed A, made on this rank alone (no communication);
4. check that every expert of every layer is held by some rank, and for DCP checkpoints that the
   checkpoint's metadata holds every expert exactly once with global extent E.

A difference is explained, not just counted: "rank 1 holds expert 0's values" (the classic bug of
local expert names), "still holds its pre-load values" (the load did not write it), or the max
abs diff.  The controller side (``items.py``) turns the per-rank verdicts into one message.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from conformance.adapter import Spec, capabilities_of, local_region
from conformance.matrix import Cell

SEED_A = 1234
SEED_B = 5678
KEEP = 5  # mismatches kept per rank; the rest are counted

Key = tuple[Any, Any, str]  # (layer, global_expert_id or None, name)


@dataclass
class Mismatch:
    rank: int
    layer: Any
    expert: int | None
    name: str
    problem: str

    def where(self) -> str:
        what = f"expert {self.expert}, " if self.expert is not None else ""
        return f"rank {self.rank}, layer {self.layer}, {what}tensor {self.name!r}"


@dataclass
class RankVerdict:
    rank: int
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    mismatch_count: int = 0
    #: problems that are not a single tensor's values (coverage, metadata, a build ignoring its seed).
    problems: list[str] = field(default_factory=list)
    #: legacy cells: the error the adapter refused the checkpoint with, or None.
    refused: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def add(self, mismatch: Mismatch) -> None:
        self.mismatch_count += 1
        if len(self.mismatches) < KEEP:
            self.mismatches.append(mismatch)


# -- canonical views -----------------------------------------------------------------------------
def canonical(adapter: Any, model: Any, optimizer: Any, rank: int, verdict: RankVerdict | None = None
              ) -> dict[Key, tuple[Any, tuple[slice, ...] | None]]:
    """``(layer, expert, name) -> (local data copy, region)`` for everything the adapter yields."""
    out: dict[Key, tuple[Any, tuple[slice, ...] | None]] = {}
    for source in (adapter.expert_tensors(model, optimizer), adapter.other_tensors(model, optimizer)):
        for layer, expert, name, tensor in source:
            key = (layer, expert, str(name))
            if key in out and verdict is not None:
                verdict.problems.append(f"rank {rank}: the adapter yielded {key} twice")
            local, region = local_region(tensor)
            out[key] = (local.detach().cpu().clone(), region)
    return out


#: ground truths this rank process already built, by (adapter class, version, spec): the truth is a pure
#: function of them (adapters must build deterministically), and many cells share one.
_TRUTHS: dict[tuple[Any, ...], dict[Key, Any]] = {}


def _truth(adapter: Any, spec: Spec, rank: int) -> dict[Key, Any]:
    """The ep=1, unsharded build with seed A, on this rank alone (no communication)."""
    spec = Spec(**{**spec.__dict__, "fsdp": False, "layout": None})
    key = (type(adapter).__module__, type(adapter).__qualname__, str(adapter.version), spec)
    if key not in _TRUTHS:
        model, optimizer = adapter.build(spec, None, SEED_A)
        found = canonical(adapter, model, optimizer if spec.optimizer_steps else None, rank)
        if len(_TRUTHS) >= 32:
            _TRUTHS.clear()
        _TRUTHS[key] = {k: t for k, (t, _) in found.items()}
    return _TRUTHS[key]


def _expected(truth: dict[Key, Any], key: Key, region: tuple[slice, ...] | None) -> Any:
    """The truth for ``key``, cut to ``region`` when the tensor compared is a shard."""
    full = truth.get(key)
    return full if full is None or region is None or not full.dim() else full[region]


def _equal(a: Any, b: Any) -> bool:
    import torch

    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _diagnose(key: Key, got: Any, region: tuple[slice, ...] | None, truth: dict[Key, Any],
              before: dict[Key, tuple[Any, Any]]) -> str:
    """Why ``got`` is not the truth: another expert's values, untouched, or plain wrong."""
    layer, expert, name = key
    if key in before and _equal(got, before[key][0]):
        return "still holds its pre-load (seed B) values: the load did not write it"
    for (other_layer, other_expert, other_name), full in truth.items():
        if other_layer == layer and other_name == name and other_expert != key[1]:
            candidate = full if region is None else full[region]
            if _equal(got, candidate):
                return (f"holds expert {other_expert}'s values instead of expert {expert}'s" if expert is not None
                        else f"holds {other_name} of expert {other_expert}")
    expected = truth[key] if region is None else truth[key][region]
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    return f"values differ: max abs diff {diff:.3g} (dtype {got.dtype}, expected {expected.dtype})"


def compare(rank: int, got: dict[Key, tuple[Any, Any]], truth: dict[Key, Any],
            before: dict[Key, tuple[Any, Any]], verdict: RankVerdict) -> None:
    for key, (tensor, region) in sorted(got.items(), key=lambda kv: repr(kv[0])):
        layer, expert, name = key
        verdict.compared += 1
        if key not in truth:
            verdict.add(Mismatch(rank, layer, expert, name, "not in the ep=1 ground truth (unexpected name)"))
            continue
        if not _equal(tensor, _expected(truth, key, region)):
            verdict.add(Mismatch(rank, layer, expert, name, _diagnose(key, tensor, region, truth, before)))


# -- checkpoint metadata --------------------------------------------------------------------------
_UNPACKED = re.compile(r"^(?P<prefix>.*experts?)\.(?P<id>\d+)\.(?P<suffix>.+)$", re.IGNORECASE)
#: a shared expert (torchtitan's and DeepSeek's ``shared_experts``) is a dense FFN with no expert axis.
_SHARED = re.compile(r"shared_?experts?", re.IGNORECASE)


def metadata_problems(path: str, num_experts: int) -> list[str]:
    """Every expert present exactly once with global extent E; chunks with no overlap and no hole."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    problems: list[str] = []
    unpacked: dict[tuple[str, str], set[int]] = defaultdict(set)
    for key, meta in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        size = tuple(meta.size)
        total = math.prod(size)
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        volume = sum(math.prod(s) for _, s in boxes)
        overlap = any(all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(a, sa, b, sb, strict=True))
                      for i, (a, sa) in enumerate(boxes) for b, sb in boxes[i + 1:]) if size else False
        if overlap or volume != total:
            problems.append(f"checkpoint key {key!r}: its {len(boxes)} chunks cover {volume} of {total} "
                            f"elements{' and overlap' if overlap else ''}")
        if "expert" not in key.lower() or _SHARED.search(key):
            continue
        found = _UNPACKED.match(key)
        if found:
            unpacked[(found["prefix"], found["suffix"])].add(int(found["id"]))
        elif size and size[0] != num_experts:
            problems.append(f"checkpoint key {key!r} has {size[0]} rows on its expert axis, expected all "
                            f"{num_experts} experts (global extent)")
    for (prefix, suffix), ids in sorted(unpacked.items()):
        if ids != set(range(num_experts)):
            problems.append(f"checkpoint holds experts {sorted(ids)} of {num_experts} for "
                            f"'{prefix}.<id>.{suffix}' (missing {sorted(set(range(num_experts)) - ids)})")
    return problems


def _coverage(rank: int, got: dict[Key, Any], truth: dict[Key, Any], verdict: RankVerdict) -> None:
    """Every (layer, expert) of the truth is held by some rank after the load (a collective)."""
    import torch.distributed as dist

    held = sorted({(k[0], k[1]) for k in got if k[1] is not None}, key=repr)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    union = {tuple(x) for rank_held in everyone for x in rank_held}
    wanted = {(k[0], k[1]) for k in truth if k[1] is not None}
    missing = sorted(wanted - union, key=repr)
    if missing and rank == 0:
        verdict.problems.append(f"after the load no rank holds {len(missing)} expert(s) of the ep=1 model, "
                                f"first (layer, expert): {missing[:4]}")


# -- the cell -------------------------------------------------------------------------------------
def run_cell(adapter: Any, cell: Cell, base: Spec, path: str) -> RankVerdict:
    """The whole experiment of ``cell`` on this rank; its verdict goes back to the controller."""
    import torch.distributed as dist

    rank = dist.get_rank()
    verdict = RankVerdict(rank)
    optim = cell.state == "model+optim"
    save_spec, load_spec = cell.spec(base, "save"), cell.spec(base, "load")

    t0 = time.perf_counter()
    model, optimizer = adapter.build(save_spec, cell.save.build_mesh(), SEED_A)
    t1 = time.perf_counter()
    (adapter.save_legacy if cell.legacy else adapter.save)(model, optimizer if optim else None, path)
    verdict.timings["save"] = time.perf_counter() - t1
    verdict.timings["build"] = t1 - t0
    del model, optimizer
    dist.barrier()
    if rank == 0 and capabilities_of(adapter).format == "dcp" and not cell.legacy:
        verdict.problems += metadata_problems(path, cell.num_experts)

    truth = _truth(adapter, load_spec, rank)
    model, optimizer = adapter.build(load_spec, cell.load.build_mesh(), SEED_B)
    optimizer = optimizer if optim else None
    before = canonical(adapter, model, optimizer, rank, verdict)
    same = {k for k, (t, region) in before.items() if _equal(t, _expected(truth, k, region))}
    experts_unchanged = sorted((k for k in same if k[1] is not None), key=repr)
    if before and (experts_unchanged or len(same) == len(before)):
        verdict.problems.append(
            f"rank {rank}: the build with seed {SEED_B} already equals the ground truth (seed {SEED_A}) for "
            f"{len(experts_unchanged) or len(before)} tensor(s), e.g. {(experts_unchanged or list(before))[0]}: "
            "a load that does nothing would pass; build() must derive every expert's values from its seed")

    t2 = time.perf_counter()
    try:
        check_saved = getattr(adapter, "check_saved", None)
        if cell.legacy and callable(check_saved):
            check_saved(model, path)
        adapter.load(model, optimizer, path)
    except Exception as exc:
        if not cell.legacy:
            raise
        verdict.refused = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return verdict
    verdict.timings["load"] = time.perf_counter() - t2
    got = canonical(adapter, model, optimizer, rank, verdict)
    compare(rank, got, truth, before, verdict)
    if not cell.legacy:  # a collective; legacy cells may have refused on some ranks only
        _coverage(rank, got, truth, verdict)
    return verdict
