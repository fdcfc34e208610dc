"""Seeded-bug adapters: the reference adapter with one real bug class planted each.

They are the negative controls of the matrix's checks: each must be caught by the check named in
its docstring (``tests/test_detection.py`` asserts which cells fail and how they read), while the
reference itself passes every cell.  The bugs come from framework bug trackers:

- :class:`StepNotRestored` -- the load leaves Adam's step count as it was (``scalars``, ``resume``);
- :class:`MomentsDropped` -- the load leaves experts without optimizer state (``missing``);
- :class:`PermutedExperts` -- save and load name experts as if EP placed them round-robin
  (``local * ep + ep_rank``) while they sit in contiguous ranges: at the same EP degree the values
  round-trip and only the checkpoint itself shows it (``checkpoint``); across EP degrees the
  values go wrong too (``values``);
- :class:`GlobalRankAsEpRank` -- the EP split takes ``global_rank % ep`` as its EP rank, which is
  right for consecutive EP groups and wrong for strided ones (``missing``, per replica group);
- :class:`LegacyNeverRefused` -- a legacy guard that never refuses and a load that re-raises DCP's
  error as ``RuntimeError`` (``refusal``);
- :class:`LayerDropped` -- the save leaves out layer 1's experts; the load then fails, and the cell
  still names the layer and experts (``checkpoint``);
- :class:`OneExpertOf64Misfiled` -- at a real expert count (E=64) layer 1's expert 41 is filed under
  id 42 and 42 under 41, on save and load alike: every value round-trips, and only the checkpoint
  shows it (``checkpoint``: the ep=1 checkpoint's attribution names the layer, the expert and the
  tensor).

The checkpoint bugs are planted where a framework would have them: between the state dict and DCP
(:func:`_dcp_with`), not in the model.  Those that rename or drop per-expert keys
(``experts.<id>.``) run on ``reference-per-expert`` (:class:`ReferencePerExpertAdapter`), whose
packed layers save one key per expert as its unpacked ones do; the packed form's own misfiling is
:class:`PackedRowsSwapped`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from conformance.adapter import Capabilities
from conformance.adapters import reference
from reference_impl.layout import balanced_range


class ReferenceAdapter(reference.ReferenceAdapter):
    """The reference adapter without its Hugging Face members, so its cells run no HF check.

    The bugs here are planted in the DCP path (state dict, save, load, optimizer); the reference's
    HF export goes through that same checkpoint, so the HF checks would only read each bug a second
    time, at twice a cell's cost.  The HF checks' negative controls are ``seeded_hf.py``, and their
    no-false-alarm control the reference's own default tier (``test_matrix.py``).
    """

    hf_model = export_hf = import_hf = hf_forward = None
    #: no fine-tuning cells either: a bug planted here reads the same in a fine-tuned model's
    #: DCP path, and the fine-tuning cells' own controls are ``seeded_finetune.py``.
    capabilities = replace(reference.ReferenceAdapter.capabilities, finetune=())


class ReferencePerExpertAdapter(ReferenceAdapter, reference.ReferencePerExpertAdapter):
    """``reference-per-expert`` (one key per expert in both kinds), without the HF members."""


_EXPERT_KEY = re.compile(r"(experts\.)(\d+)(\.)")


def _rename(obj: Any, name: Callable[[str], str]) -> Any:
    """``obj`` with every string key (and string in a list) renamed; tensors stay the same
    objects."""
    if isinstance(obj, dict):
        return {name(k) if isinstance(k, str) else k: _rename(v, name) for k, v in obj.items()}
    if isinstance(obj, list):
        return [name(x) if isinstance(x, str) else _rename(x, name) for x in obj]
    return obj


def _copy_back(into: Any, loaded: Any, name: Callable[[str], str]) -> None:
    """Put what a load wrote into the renamed dict (param-group settings included) back under the
    original names."""
    pairs = (((k, loaded.get(name(k) if isinstance(k, str) else k)) for k in list(into))
             if isinstance(into, dict) else zip(range(len(into)), loaded, strict=False))
    for key, other in pairs:
        value = into[key]
        if any(isinstance(value, kind) and isinstance(other, kind) for kind in (dict, list)):
            _copy_back(value, other, name)
        # names (a group's "params") stay ours
        elif other is not None and not isinstance(value, str):
            into[key] = other


@contextlib.contextmanager
def _dcp_with(save_name: Callable[[str], str] = lambda k: k, load_name: Callable[[str], str]
              | None = None, drop: Callable[[str], bool] = lambda k: False) -> Iterator[None]:
    """reference_impl.checkpoint's DCP calls with keys renamed (or dropped) on the way to the
    files."""
    import reference_impl.checkpoint as ck

    real = ck.dcp
    load_name = load_name or save_name

    class _Shim:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def save(state: dict[str, Any], **kwargs: Any) -> Any:
            renamed = _rename(state, save_name)
            for part in (renamed.get("model", {}), renamed.get("optimizer", {}).get("state", {})):
                for key in [k for k in part if drop(k)]:
                    del part[key]
            return real.save(renamed, **kwargs)

        @staticmethod
        def load(state: dict[str, Any], **kwargs: Any) -> Any:
            renamed = _rename(state, load_name)
            result = real.load(renamed, **kwargs)
            _copy_back(state, renamed, load_name)
            return result

    ck.dcp = _Shim()
    try:
        yield
    finally:
        ck.dcp = real


class StepNotRestored(ReferenceAdapter):
    """The load restores weights and moments but leaves each parameter's Adam ``step`` as it was."""

    name = "seeded-step-not-restored"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        kept = {p: s["step"].clone()
                for p, s in optimizer.state.items()} if optimizer is not None else {}
        super().load(model, optimizer, path)
        for p, step in kept.items():
            optimizer.state[p]["step"] = step


class MomentsDropped(ReferenceAdapter):
    """The load leaves every expert parameter without optimizer state (as if its moments were never
    saved)."""

    name = "seeded-moments-dropped"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.moe import moe_layers

        super().load(model, optimizer, path)
        if optimizer is None:
            return
        for _, moe in moe_layers(model):
            for p in moe.expert_parameters():
                optimizer.state.pop(p, None)


def _round_robin_names(model: Any) -> Callable[[str], str]:
    """Global id ``g`` (contiguous placement) renamed ``(g - start) * ep + ep_rank``: the bug's
    ids."""
    from reference_impl.layout import expert_owner, expert_range
    from reference_impl.moe import moe_layers

    moe = next(moe for _, moe in moe_layers(model))
    num_experts, ep = moe.num_experts, moe.ep_world_size

    def rename(match: re.Match[str]) -> str:
        g = int(match[2])
        owner = expert_owner(g, num_experts, ep)
        return f"{match[1]}{(g - expert_range(num_experts, ep, owner)[0]) * ep + owner}{match[3]}"

    return lambda key: _EXPERT_KEY.sub(rename, key)


class PermutedExperts(ReferencePerExpertAdapter):
    """Experts filed under round-robin ids (see the module docstring); even E % ep only."""

    name = "seeded-permuted-experts"
    capabilities = Capabilities(kinds=("packed", "unpacked"), optimizer=True, fsdp=True,
                                uneven=False, max_ep=64, format="dcp", cross_kind=True,
                                ep_orders=("strided", "consecutive"), hsdp=True, etp=True)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(_round_robin_names(model)):
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(_round_robin_names(model)):
            super().load(model, optimizer, path)


class LayerDropped(ReferencePerExpertAdapter):
    """The save leaves layer 1's experts (weights and moments) out of the checkpoint."""

    name = "seeded-layer-dropped"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(drop=lambda key: key.startswith("layers.1.moe.experts.")):
            super().save(model, optimizer, path)


class OneExpertOf64Misfiled(ReferencePerExpertAdapter):
    """One expert among 64: layer 1's expert 41 is saved and loaded as expert 42 and 42 as 41
    (weights and moments), as one wrong entry in a framework's expert-id table would.  Models with
    42 experts or fewer are untouched."""

    name = "seeded-one-expert-of-64-misfiled"
    SWAP = {"41": "42", "42": "41"}

    @classmethod
    def _names(cls, model: Any) -> Callable[[str], str]:
        if _num_experts(model) <= 42:
            return lambda key: key
        pattern = re.compile(
            r"^((?:model\.|optimizer\.state\.)?layers\.1\.moe\.experts\.)(41|42)(\.)")
        return lambda key: pattern.sub(lambda m: f"{m[1]}{cls.SWAP[m[2]]}{m[3]}", key)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(self._names(model)):
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(self._names(model)):
            super().load(model, optimizer, path)


def _num_experts(model: Any) -> int:
    from reference_impl.moe import moe_layers

    return next(moe for _, moe in moe_layers(model)).num_experts


class _GlobalRankEpMesh:
    """The ep mesh, except that its "local rank" is the global rank modulo its size (the bug)."""

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._mesh, attr)

    def get_local_rank(self, *args: Any, **kwargs: Any) -> int:
        import torch.distributed as dist

        return dist.get_rank() % self._mesh.size()


class _MeshWithBuggyEp:
    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._mesh, attr)

    def __getitem__(self, dims: Any) -> Any:
        found = self._mesh[dims]
        return _GlobalRankEpMesh(found) if dims in ("ep", ("ep",)) else found


class GlobalRankAsEpRank(ReferenceAdapter):
    """The EP split takes ``global_rank % ep`` for the EP rank (unpacked layers, EP only)."""

    name = "seeded-global-rank-as-ep-rank"
    capabilities = Capabilities(kinds=("unpacked",), optimizer=True, fsdp=False, uneven=True,
                                max_ep=64, format="dcp", ep_orders=("strided", "consecutive"))

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        return super().build(spec, None if mesh is None else _MeshWithBuggyEp(mesh), seed)


class LegacyNeverRefused(ReferenceAdapter):
    """A legacy guard that never refuses, and a load that re-raises whatever DCP raised as
    RuntimeError."""

    name = "seeded-legacy-never-refused"
    check_saved = None  # type: ignore[assignment]

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        from reference_impl.checkpoint import load

        try:
            load(model, optimizer, path, check_saved=False)
        # DCP's CheckpointException is a BaseException
        except (Exception, CheckpointException) as exc:
            raise RuntimeError(f"load failed: {exc}") from exc


# -- a correct framework passes whatever it names its keys; a broken one is blamed for the right
# thing
def _bank(key: str) -> str:
    return key.replace("moe.experts.", "moe.bank.")


class RenamedExpertKeys(ReferencePerExpertAdapter):
    """Not a bug: the reference with its per-expert keys renamed (``moe.bank.<id>.up.weight``) to
    names no pattern knows.  The checkpoint check learns them from the ep=1 save's content, so every
    cell passes."""

    name = "seeded-renamed-expert-keys"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(_bank):
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import load

        # the guard reads the file's (renamed) keys: check_saved covers legacy cells
        with _dcp_with(_bank):
            load(model, optimizer, path, check_saved=False)


def _packed_state(model: Any, global_rows: bool) -> dict[str, Any]:
    """The model's state (parameters and persistent buffers: the router's expert bias) under
    ``mlp.`` names (no pattern knows them); packed expert weights as DTensors of their global rows
    (``Shard(0)`` over EP) when ``global_rows``, else as this rank's plain local rows."""
    from torch.distributed.tensor import DTensor, Shard

    from reference_impl.moe import moe_layers

    packed = {id(getattr(moe, w)) for _, moe in moe_layers(model) for w in moe.packed_weights()}
    ep_mesh = getattr(model, "_seeded_ep_mesh", None)
    out: dict[str, Any] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        value = p.detach()
        if global_rows and ep_mesh is not None and id(p) in packed:
            value = DTensor.from_local(value, ep_mesh, [Shard(0)], run_check=False)
        out[f"model.{name.replace('.moe.', '.mlp.')}"] = value
    return out


class PackedLocalRowLoad(ReferenceAdapter):
    """A correct save and a broken load (packed layers, EP only, model state): the save hands DCP
    each packed expert weight as a DTensor of its global rows, so the checkpoint is EP-invariant;
    the load hands DCP this rank's plain local rows, which DCP refuses at ep > 1 ("Size mismatch ...
    for model.layers.0.mlp.up_w").  The cell's first line must blame the load, in expert terms --
    and the save, named as no pattern knows, is fine."""

    name = "seeded-packed-local-row-load"
    capabilities = Capabilities(kinds=("packed",), optimizer=False, fsdp=False, uneven=False,
                                max_ep=64, format="dcp", ep_orders=("strided", "consecutive"))
    save_legacy = None  # type: ignore[assignment]

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        model, optimizer = super().build(spec, mesh, seed)
        model._seeded_ep_mesh = None if mesh is None or mesh["ep"].size() == 1 else mesh["ep"]
        return model, optimizer

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(_packed_state(model, global_rows=True), checkpoint_id=path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        # in place into the parameters
        dcp.load(_packed_state(model, global_rows=False), checkpoint_id=path)


class WithScheduler(ReferenceAdapter):
    """Not a bug: the reference trained with a cosine LR scheduler that rides in ``build``'s
    training state, a save that needs the optimizer even in model-only cells
    (``model_saves_optimizer``), and the scheduler saved and restored beside the DCP checkpoint.
    Every cell passes; the scheduler's state is part of ``scalars``."""

    name = "seeded-with-scheduler"
    capabilities = Capabilities(**{**ReferenceAdapter.capabilities.__dict__,
                                   "model_saves_optimizer": True})

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any, dict[str, Any]]:
        import torch

        from conformance.adapter import run_steps

        model, _ = super().build(replace(spec, optimizer_steps=0), mesh, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        state = {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)}
        run_steps(lambda index: self.step(model, optimizer, seed, index, state=state), 0,
                  spec.optimizer_steps)
        return model, optimizer, state

    def step(self, model: Any, optimizer: Any, seed: int, step: int, state: Any = None) -> None:
        super().step(model, optimizer, seed, step)
        state["scheduler"].step()

    def scalars(self, model: Any, optimizer: Any, state: Any = None) -> dict[str, Any]:
        # the scheduler's own scalars the harness adds from ``state``
        return super().scalars(model, optimizer)

    def save(self, model: Any, optimizer: Any, path: str, state: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if optimizer is None or state is None:
            raise ValueError("this trainer's save needs its optimizer and scheduler (its step-0 "
                             "save included)")
        super().save(model, optimizer, path)
        torch.save(state["scheduler"].state_dict(), f"{path}/scheduler-rank{dist.get_rank()}.pt")

    def load(self, model: Any, optimizer: Any, path: str, state: Any = None) -> None:
        super().load(model, optimizer, path)
        self._restore_scheduler(path, state)

    @staticmethod
    def _restore_scheduler(path: str, state: Any) -> None:
        import torch
        import torch.distributed as dist

        state["scheduler"].load_state_dict(torch.load(f"{path}/scheduler-rank{dist.get_rank()}.pt"))


class SchedulerNotRestored(WithScheduler):
    """The load restores model and optimizer but not the LR scheduler: its ``last_epoch`` and
    ``base_lrs`` stay the load side's (``scalars``)."""

    name = "seeded-scheduler-not-restored"

    @staticmethod
    def _restore_scheduler(path: str, state: Any) -> None:
        return None


class ScheduleClosesOverConfig(WithScheduler):
    """Not a bug: a warm-down schedule that closes over its configuration, as many trainers' do:
    ``LambdaLR`` with ``min_lr_ratio = MIN_LR / spec.lr``, which no checkpoint holds.  The load
    restores the scheduler exactly; the next step's lr is then computed from the load side's
    configuration, which is the run's own (a load side built with another lr in its configuration
    read this as a wrong lr).  Every cell passes."""

    name = "seeded-schedule-closes-over-config"
    MIN_LR = 1e-3

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any, dict[str, Any]]:
        import torch

        from conformance.adapter import run_steps

        model, _ = ReferenceAdapter.build(self, replace(spec, optimizer_steps=0), mesh, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        min_lr_ratio = self.MIN_LR / spec.lr  # configuration, closed over: never in a checkpoint

        def factor(step: int) -> float:
            return min_lr_ratio + (1 - min_lr_ratio) * max(0.0, 1 - step / 10)

        state = {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor)}
        run_steps(lambda index: self.step(model, optimizer, seed, index, state=state), 0,
                  spec.optimizer_steps)
        return model, optimizer, state


class LrNotRestored(WithScheduler):
    """The load restores the scheduler, then puts back the lr the load side had (a trainer that
    re-applies its own lr after loading): on a schedule whose lr changes every step the load side's
    lr (one step further) is not the saved one (``scalars``)."""

    name = "seeded-lr-not-restored"

    def load(self, model: Any, optimizer: Any, path: str, state: Any = None) -> None:
        before = [group["lr"] for group in optimizer.param_groups] if optimizer is not None else []
        super().load(model, optimizer, path, state=state)
        for group, lr in zip(optimizer.param_groups if optimizer is not None else [], before,
                             strict=True):
            group["lr"] = lr


# -- bug classes the default tier must reach -----------------------------------------------
def _rename_or_drop(obj: Any, name: Callable[[str], str | None]) -> Any:
    """``obj`` with string keys renamed and those ``name`` maps to None left out (strings in lists
    kept)."""
    if isinstance(obj, dict):
        return {(name(k) if isinstance(k, str) else k): _rename_or_drop(v, name) for k, v
                in obj.items() if not isinstance(k, str) or name(k) is not None}
    if isinstance(obj, list):
        return [x if isinstance(x, str) else _rename_or_drop(x, name) for x in obj]
    return obj


@contextlib.contextmanager
def _dcp_placed(name: Callable[[str], str | None]) -> Iterator[None]:
    """reference_impl.checkpoint's DCP calls with expert keys renamed, or dropped, on save and on
    load alike."""
    import reference_impl.checkpoint as ck

    real = ck.dcp

    class _Shim:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def save(state: dict[str, Any], **kwargs: Any) -> Any:
            return real.save(_rename_or_drop(state, name), **kwargs)

        @staticmethod
        def load(state: dict[str, Any], **kwargs: Any) -> Any:
            renamed = _rename_or_drop(state, name)
            result = real.load(renamed, **kwargs)
            _copy_back(state, renamed, lambda k: name(k) or "\0dropped")
            return result

    ck.dcp = _Shim()
    try:
        yield
    finally:
        ck.dcp = real


def _balanced_first(num_experts: int, ep: int, rank: int) -> int:
    """The first expert id of ``rank`` under the balanced split ("the first E % ep ranks get one
    more")."""
    return balanced_range(num_experts, ep, rank)[0]


class _MisplacedIds(ReferencePerExpertAdapter):
    """The rank holds the experts of the layout rule (DTensor's ``Shard(0)``) but files its local
    expert ``i`` under :meth:`ids`'s id -- None: the framework thinks it has no such local expert
    and neither saves nor loads it."""

    @staticmethod
    def ids(num_experts: int, ep: int, rank: int, count: int) -> list[int | None]:
        raise NotImplementedError

    def _names(self, model: Any) -> Callable[[str], str | None]:
        from reference_impl.layout import expert_owner, expert_range
        from reference_impl.moe import moe_layers

        moe = next(moe for _, moe in moe_layers(model))
        num_experts, ep = moe.num_experts, moe.ep_world_size

        def name(key: str) -> str | None:
            match = _EXPERT_KEY.search(key)
            if match is None:
                return key
            g = int(match[2])
            owner = expert_owner(g, num_experts, ep)
            start, stop = expert_range(num_experts, ep, owner)
            ids = self.ids(num_experts, ep, owner, stop - start)
            new = ids[g - start] if g - start < len(ids) else None
            return None if new is None else key[:match.start(2)] + str(new) + key[match.end(2):]

        return name

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_placed(self._names(model)):
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_placed(self._names(model)):
            super().load(model, optimizer, path)


class FirstRanksGetOneMore(_MisplacedIds):
    """NeMo's "the first E % k ranks get one more" ids: at E=6, ep=4 rank 2 files only expert 4,
    rank 3 expects expert 5 and holds none -- the checkpoint has no expert 5."""

    name = "seeded-first-ranks-get-one-more"

    @staticmethod
    def ids(num_experts: int, ep: int, rank: int, count: int) -> list[int | None]:
        start, end = balanced_range(num_experts, ep, rank)
        return [start + i if start + i < end else None for i in range(count)]


class FloorExpertsPerRank(_MisplacedIds):
    """Experts per rank = ``E // ep``: at E=6, ep=4 rank r files local expert 0 as expert r; experts
    4..5 are never saved."""

    name = "seeded-floor-experts-per-rank"

    @staticmethod
    def ids(num_experts: int, ep: int, rank: int, count: int) -> list[int | None]:
        per = num_experts // ep
        return [rank * per + i if i < per else None for i in range(count)]


class BalancedStartChunkCount(_MisplacedIds):
    """The first id from the balanced split, the count from ``Shard(0)``'s: at E=5, ep=4 the row
    counts (2, 2, 1, 0) agree with DCP while rank 2 files expert 4 as expert 3 (invisible at
    E=6)."""

    name = "seeded-balanced-start-chunk-count"

    @staticmethod
    def ids(num_experts: int, ep: int, rank: int, count: int) -> list[int | None]:
        return [_balanced_first(num_experts, ep, rank) + i for i in range(count)]


class MomentsKeptUnderHsdpOrEtp(ReferenceAdapter):
    """The load leaves the Adam moments of parameters on an HSDP or expert-TP mesh (a
    ``dp_replicate`` or ``etp`` dim) as they were: a framework that converts only the meshes it
    knows."""

    name = "seeded-moments-kept-under-hsdp-or-etp"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from torch.distributed.tensor import DTensor

        kept = {}
        for p, s in (optimizer.state.items() if optimizer is not None else ()):
            names = set(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else set()
            if names & {"dp_replicate", "etp"} and p.device_mesh.size() > 1:
                kept[p] = {m: s[m].clone() for m in ("exp_avg", "exp_avg_sq") if m in s}
        super().load(model, optimizer, path)
        for p, moments in kept.items():
            for m, value in moments.items():
                optimizer.state[p][m].copy_(value)


class GlobalRankAsEpRankEtp(GlobalRankAsEpRank):
    """:class:`GlobalRankAsEpRank` with expert TP: at ep2.etp2 the ranks of EP coordinate 0 hold
    experts 0..3, so a replica would hold one etp shard of each expert twice and the other never,
    and a save there would offer DCP the same shard twice; the layout check stops both cells first
    (an ``error`` naming the placement)."""

    name = "seeded-global-rank-as-ep-rank-etp"
    capabilities = Capabilities(kinds=("unpacked",), optimizer=True, fsdp=False, uneven=True,
                                max_ep=64,
                                format="dcp", ep_orders=("strided", "consecutive"), etp=True)


class EtpShardTransposed(ReferenceAdapter):
    """The load turns every square expert-TP shard of an expert weight into its transpose: the shard
    a split on the other axis of an ``[in, out]`` layout gives (model weights; moments
    untouched)."""

    name = "seeded-etp-shard-transposed"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        from reference_impl.moe import moe_layers

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, moe in moe_layers(model):
                for p in moe.expert_parameters():
                    if isinstance(p, DTensor) and "etp" in (p.device_mesh.mesh_dim_names or ()):
                        local = p.to_local()
                        if local.shape[-1] == local.shape[-2]:
                            local.copy_(local.transpose(-1, -2).clone())


class EtpPeerFreedAfterLoad(ReferenceAdapter):
    """After the load the expert-TP peer (etp rank 1) no longer holds its expert weight shards: the
    load treats it as a replica of etp rank 0, zeroes its shards and drops them from what it reports
    (moments stay).  Every EP coordinate still holds its experts (the layout check passes) and etp
    rank 0's shards are right (values pass): only ``missing``'s per-replica coverage of the
    expert-TP shards sees shard 1 of every expert weight gone."""

    name = "seeded-etp-peer-freed-after-load"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        from reference_impl.moe import moe_layers

        super().load(model, optimizer, path)
        freed = set()
        with torch.no_grad():
            for _, moe in moe_layers(model):
                for p in moe.expert_parameters():
                    names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
                    if "etp" in names and p.device_mesh.get_local_rank("etp") == 1:
                        p.to_local().zero_()
                        freed.add(_storage(p))
        model._seeded_freed = freed

    def expert_tensors(self, model: Any, optimizer: Any) -> Any:
        freed = getattr(model, "_seeded_freed", set())
        return (entry for entry in super().expert_tensors(model, optimizer)
                if _storage(entry[3]) not in freed)


def _storage(t: Any) -> int:
    """The address of the storage under ``t`` (a DTensor's local shard's): a packed weight's expert
    rows share it."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.untyped_storage().data_ptr())


# -- a kernel's rounding is not a wrong value; re-keyed state is named as re-keyed -----------------
def _ep_degree(mesh: Any) -> int:
    return mesh["ep"].size() if mesh is not None and "ep" in (mesh.mesh_dim_names or ()) else 1


class PerShardRounding(ReferenceAdapter):
    """Not a bug: a "fused" AdamW that rounds each rank's shard on its own, as torch's fused CPU
    kernel and the GPU trainers' fused and foreach optimizers do (their vector body and scalar tail
    round one formula two ways). After every step the last element of each rank's local tensor -- a
    parameter's shard and its moments -- is one ulp up: at ep=1 that is the last element of each
    whole tensor, under FSDP2 or a packed EP split the last of each rank's shard.  The saved state
    then differs from the ep=1 truth by an ulp or two, and every load gives back exactly what was
    saved: every cell passes (a first line reading "values differ" by 2.98e-8 would be a false
    alarm)."""

    name = "seeded-per-shard-rounding"

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        super().step(model, optimizer, seed, step)
        with torch.no_grad():
            for p in model.parameters():
                moments = optimizer.state.get(p, {})
                for t in (p, *(moments[k] for k in ("exp_avg", "exp_avg_sq") if k in moments)):
                    local = t.to_local() if isinstance(t, DTensor) else t
                    if local.numel():
                        last = local[(-1,) * local.dim()]
                        last.copy_(torch.nextafter(last,
                                                   torch.tensor(float("inf"), dtype=last.dtype)))


class FusedAdamW(ReferenceAdapter):
    """Not a bug: the reference stepped with torch's own ``AdamW(fused=True)`` (its fused CPU
    kernel), whatever it rounds on each rank's shard (measured: under 1 ulp of a tensor on a few
    tensors of the E=4 cells).  Every cell passes but one kind: loaded at ep=4 with E=5 into
    unpacked layers, rank 3's expert group is empty and torch's DCP optimizer load leaves it without
    hyperparameters (the next step: KeyError 'betas'), a refusal, as found."""

    name = "seeded-fused-adamw"

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        from conformance.adapter import run_steps

        model, _ = super().build(replace(spec, optimizer_steps=0), mesh, seed)
        if spec.optimizer_steps <= 0:
            return model, None
        from reference_impl.moe import moe_layers

        # two groups, the experts' parameters and the rest, as trainers keep them under EP: the
        # fused kernel refuses a group that mixes DTensors and plain tensors ("got mixed
        # torch.Tensor and DTensor"), which expert TP without FSDP gives (the experts' shards
        # DTensors, the router plain)
        experts = {id(p) for _, moe in moe_layers(model) for p in moe.expert_parameters()}
        groups = [{"params": [p for p in model.parameters() if (id(p) in experts) == wanted]}
                  for wanted in (True, False)]
        optimizer = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=0.01, fused=True)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer


class OneMomentOffUnderEp(ReferenceAdapter):
    """Under EP (ep > 1) the optimizer leaves layer 1's last expert's ``up.exp_avg`` off by one part
    in ten thousand (800 ulps: far more than any rounding).  The save and the load are right -- a
    load gives back what was saved -- so only the save side's state against the ep=1 truth
    (``values``: "as saved at ...") and the checkpoint against the ep=1 save (``checkpoint``) show
    it, in every model+optimizer cell saved at ep > 1."""

    name = "seeded-one-moment-off-under-ep"

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        from conformance.checks.held import held_tensors

        model, optimizer = super().build(spec, mesh, seed)
        if optimizer is not None and _ep_degree(mesh) > 1:
            with torch.no_grad():
                for held in held_tensors(self.expert_tensors(model, optimizer)):
                    if (held.layer, held.expert,
                        held.name) == (1, spec.num_experts - 1, "up.exp_avg"):
                        held.local.mul_(1 + 1e-4)
        return model, optimizer


def _settings_per_parameter(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's param-group settings keyed per parameter instead of per group (what some
    trainers save under EP: ``optimizer.param_groups.<fqn>.lr``); the step-0 groups' ``params``
    lists go."""
    optimizer = state.get("optimizer")
    if not optimizer or "param_groups" not in optimizer:
        return state
    per_parameter = {name: {k: v for k, v in group.items() if k != "params"}
                     for group in optimizer["param_groups"] for name in group["params"]}
    return {**state, "optimizer": {**optimizer, "param_groups": per_parameter}}


class SettingsPerParameterUnderEp(ReferenceAdapter):
    """Under EP the save keys the optimizer's settings per parameter
    (``optimizer.param_groups.<fqn>.lr``), not per group as at ep=1: the checkpoint is not
    EP-invariant (``checkpoint``), and a load that asks for the per-group keys is refused.  The
    checkpoint check names it as re-keyed, with the values agreeing, after the findings of more
    consequence."""

    name = "seeded-settings-per-parameter-under-ep"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        import reference_impl.checkpoint as ck
        from reference_impl.moe import moe_layers

        if optimizer is None or all(moe.ep_world_size <= 1 for _, moe in moe_layers(model)):
            return super().save(model, optimizer, path)
        real = ck.dcp.save
        try:
            ck.dcp.save = lambda state, **kw: real(_settings_per_parameter(state), **kw)
            super().save(model, optimizer, path)
        finally:
            ck.dcp.save = real


class SchedulersPerGroupUnderEp(WithScheduler):
    """Not a bug: under EP the trainer keeps its scheduler in a dict (one per parameter group, here
    one group), so its training state changes structure with EP
    (``state.scheduler.model.last_epoch`` beside the ep=1 truth's ``state.scheduler.last_epoch``);
    its save and load translate between the forms, and the values come back as the checkpoint holds
    them.  Every cell passes: the structure is no missing scalar."""

    name = "seeded-schedulers-per-group-under-ep"

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any, dict[str, Any]]:
        model, optimizer, state = super().build(spec, mesh, seed)
        if _ep_degree(mesh) > 1:
            state = {"scheduler": {"model": state["scheduler"]}}
        return model, optimizer, state

    def step(self, model: Any, optimizer: Any, seed: int, step: int, state: Any = None) -> None:
        ReferenceAdapter.step(self, model, optimizer, seed, step)
        self._one(state).step()

    @staticmethod
    def _one(state: Any) -> Any:
        found = state["scheduler"]
        return found["model"] if isinstance(found, dict) else found

    def save(self, model: Any, optimizer: Any, path: str, state: Any = None) -> None:
        super().save(model, optimizer, path, state={"scheduler": self._one(state)})

    def load(self, model: Any, optimizer: Any, path: str, state: Any = None) -> None:
        super().load(model, optimizer, path, state={"scheduler": self._one(state)})


# -- the layout right, a save DCP refuses ----------------------------------------------------------
@contextlib.contextmanager
def _offered_elsewhere(shift: Callable[[str, Any], tuple[int, int] | None]) -> Iterator[None]:
    """DCP's save plan with some DTensor chunks offered at other offsets: ``shift(fqn, dtensor)``
    gives ``(axis, rows)`` to move this rank's chunk of that tensor by (None: where DTensor places
    it), as a framework that computes a chunk's offset itself would."""
    import dataclasses

    import torch
    import torch.distributed.checkpoint.planner_helpers as helpers

    real = helpers._create_write_items_for_dtensor

    def offered(fqn: str, tensor: Any) -> Any:
        item = real(fqn, tensor)
        moved = shift(fqn, tensor)
        if moved is None:
            return item
        axis, rows = moved
        data = item.tensor_data
        offsets = list(data.chunk.offsets)
        offsets[axis] += rows
        chunk = dataclasses.replace(data.chunk, offsets=torch.Size(offsets))
        return dataclasses.replace(
            item, index=dataclasses.replace(item.index, offset=torch.Size(offsets)),
            tensor_data=dataclasses.replace(data, chunk=chunk))

    helpers._create_write_items_for_dtensor = offered
    try:
        yield
    finally:
        helpers._create_write_items_for_dtensor = real


class EtpShardOfferedTwice(ReferencePerExpertAdapter):
    """The save offers etp rank 1's shard of every expert weight at etp rank 0's offsets (a
    framework that places a shard by its EP coordinate alone).  The layout is right -- every rank
    holds its experts and its own shard, so the layout check passes -- and DCP refuses the global
    plan (one shard twice, the other never): the cell names, per layer, expert and key, the ranks
    and rows offered and the rows no rank offered (``checkpoint``)."""

    name = "seeded-etp-shard-offered-twice"

    @staticmethod
    def _shift(fqn: str, tensor: Any) -> tuple[int, int] | None:
        from torch.distributed.tensor import Shard

        from reference_impl.regions import local_region

        mesh = tensor.device_mesh
        names = mesh.mesh_dim_names or ()
        if "experts" not in fqn or "etp" not in names or mesh.get_local_rank("etp") != 1:
            return None
        axis = next(p.dim for i, p in enumerate(tensor.placements) if names[i] == "etp"
                    and isinstance(p, Shard))
        return axis, -local_region(tensor)[0].shape[axis]  # etp rank 0's rows

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _offered_elsewhere(self._shift):
            super().save(model, optimizer, path)


# -- the packed form's own misfiling ---------------------------------------------------------------
class PackedRowsSwapped(ReferenceAdapter):
    """Layer 1's packed ``up_w`` goes to the checkpoint with the rows of its last two experts (E-2
    and E-1) swapped, weights and Adam moments, and comes back swapped again: one wrong entry in a
    framework's packed-row order.  A rank that holds both rows swaps them, on save and on load
    alike, so every value round-trips wherever one rank holds both (at E=256 every layout of a
    4-rank world); only the checkpoint shows it (``checkpoint``: the ep=1 save's row E-1 holds
    expert E-2's ``up``).  Unpacked layers are untouched."""

    name = "seeded-packed-rows-swapped"

    @staticmethod
    def _swap(model: Any, optimizer: Any) -> None:
        import torch

        from conformance.adapter import ADAM_MOMENTS, local_region
        from reference_impl.expert_layout import expert_rows
        from reference_impl.moe import moe_layers

        moe = dict(moe_layers(model)).get("layers.1.moe")  # by name: a stage may also hold mtp.0
        if moe is None or moe.kind != "packed":
            return
        state = optimizer.state.get(moe.up_w, {}) if optimizer is not None else {}
        pair = (moe.num_experts - 2, moe.num_experts - 1)
        with torch.no_grad():
            for tensor in (moe.up_w, *(state[m] for m in ADAM_MOMENTS if m in state)):
                rows = dict(expert_rows(moe, tensor))
                if all(g in rows for g in pair):
                    a, b = (local_region(rows[g])[0] for g in pair)
                    held = a.clone()
                    a.copy_(b)
                    b.copy_(held)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        self._swap(model, optimizer)
        try:
            super().save(model, optimizer, path)
        finally:
            self._swap(model, optimizer)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        super().load(model, optimizer, path)
        self._swap(model, optimizer)


class PackedBalancedStart(ReferenceAdapter):
    """The packed form's twin of :class:`BalancedStartChunkCount`: each rank offers its packed rows
    (the ``Shard(0)`` chunk it holds) at the balanced split's first id ("the first E % ep ranks get
    one more") instead of the chunk's. At E=5, ep=4 rank 2 offers expert 4's row as row 3 (which
    rank 1 offers too) and no rank offers row 4: DCP refuses the save plan, and the cell names the
    layer, expert, key and who offered what (``checkpoint``).  At E=6 the two splits agree on every
    rank that holds rows, and nothing shows."""

    name = "seeded-packed-balanced-start"

    @staticmethod
    def _shift(fqn: str, tensor: Any) -> tuple[int, int] | None:
        from reference_impl.layout import expert_range

        names = tensor.device_mesh.mesh_dim_names or ()
        if not re.search(r"\.moe\.(gate|up|down)_w", fqn) or "ep" not in names:
            return None
        num_experts, ep = tensor.shape[0], tensor.device_mesh.size(names.index("ep"))
        rank = tensor.device_mesh.get_local_rank("ep")
        return 0, _balanced_first(num_experts, ep, rank) - expert_range(num_experts, ep, rank)[0]

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _offered_elsewhere(self._shift):
            super().save(model, optimizer, path)


# -- pipeline stages name their layers -------------------------------------------------------------
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def _stage_of(model: Any) -> tuple[int, int, int]:
    """``(stage, stages, num_layers)`` of the reference model (or stage) ``model``, FSDP2 or not."""
    return int(model.stage), int(model.num_stages), int(model.num_layers)


def _renumbered(first: Callable[[int, int, int], int],
                prefix: Callable[[int], str] = lambda stage: "") -> Any:
    """A key function factory: ``layers.{g}.`` -> ``{prefix(stage)}layers.{g - start + first(L, pp,
    stage)}.`` where ``start`` is the stage's first layer by the stage rule -- a framework counting
    layers from its stage's own origin (``first``), under its own stage name (``prefix``)."""
    from reference_impl.layout import stage_layers

    def for_model(model: Any) -> Callable[[str], str]:
        stage, stages, layers = _stage_of(model)
        start = stage_layers(layers, stages, stage)[0]

        def name(key: str) -> str:
            found = _LAYER_KEY.match(key)
            if not found:
                return key
            g = int(found.group(1))
            return (f"{prefix(stage)}layers.{g - start + first(layers, stages, stage)}."
                    f"{key[found.end():]}")
        return name
    return for_model


class StageLocalLayerNames(ReferencePerExpertAdapter):
    """Each pipeline stage saves its layers under its own name and their index within the stage
    (``stage1.layers.0`` for global layer 2 at L=3, pp=2), as a trainer that writes one part per
    stage does.  At the same pp the keys round-trip; the checkpoint is not the pp=1 one, so every
    cell saved with stages is caught by ``checkpoint``, named by layer, and a load at another pp
    cannot find its keys."""

    name = "seeded-stage-local-layer-names"
    local = staticmethod(_renumbered(lambda layers, stages, stage: 0,
                                     lambda stage: f"stage{stage}."))

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(self.local(model)):
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(self.local(model)):
            super().load(model, optimizer, path)


def _last_stages_longer(layers: int, stages: int, stage: int) -> int:
    """The first layer of ``stage`` when the *last* ``L % pp`` stages are the longer ones (the other
    common split)."""
    base, extra = divmod(layers, stages)
    return stage * base + max(0, stage - (stages - extra))


class StageMapDisagreesOnLoad(ReferenceAdapter):
    """The save names layers by the stage rule (right); the load maps each stage's layers with the
    other split, the last ``L % pp`` stages one longer -- as a resume whose stage map is configured
    otherwise.  At L=3, pp=2 stage 1 holds layer 2 and loads it from ``layers.1``: every cell loaded
    with stages is caught by ``values`` (layer 2 holds layer 1's values), silently; a load at pp=1
    is right."""

    name = "seeded-stage-map-disagrees-on-load"
    on_load = staticmethod(_renumbered(_last_stages_longer))

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _dcp_with(self.on_load(model)):
            super().load(model, optimizer, path)


class StagesReversed(ReferenceAdapter):
    """The pipeline's stages built in reverse (stage ``pp - 1 - s`` on the ranks of coordinate
    ``s``), as a framework that orders its stage groups from the last rank does: the layout check
    stops every cell built with stages, naming the stage, its ranks and the layers they hold
    (``layout``)."""

    name = "seeded-stages-reversed"

    def build(self, spec: Any, mesh: Any, seed: int) -> Any:
        import reference_impl.moe as moe

        real = moe.apply_pipeline
        moe.apply_pipeline = lambda model, pp, stage: real(model, pp, pp - 1 - stage)
        try:
            return super().build(spec, mesh, seed)
        finally:
            moe.apply_pipeline = real  # type: ignore[assignment]


class ParamGroupsFromCheckpoint(ReferenceAdapter):
    """The load hands torch's ``set_optimizer_state_dict`` each param group as the checkpoint holds
    it, ``params`` list included -- a mistake the reference itself once made, found by the full
    tier's pipeline cells.  DCP keeps one rank's copy of ``param_groups.0.params``; ranks of two
    pipeline stages list different parameters, so the other stage's ranks find none of theirs in the
    loaded group and lose its lr, betas, eps and weight decay: the next step raises
    ``KeyError: 'betas'`` there (refused), in every cell that saves and loads with stages.  (The
    reference's own version was narrower: where its expert layout translated names it put each
    rank's list back, so only a load at ep=1 into unpacked layers showed it.)"""

    name = "seeded-param-groups-from-checkpoint"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import reference_impl.checkpoint as ck

        real_load, real_set = ck._load_here, ck.set_optimizer_state_dict
        loaded: list[list[str]] = []

        def load_here(state: dict[str, Any], reader: Any, where: str) -> None:
            real_load(state, reader, where)
            loaded[:] = [list(g["params"])
                         for g in state.get("optimizer", {}).get("param_groups", [])]

        def set_state(model: Any, optimizer: Any, state: dict[str, Any], **kwargs: Any) -> None:
            groups = [{**g, "params": p}
                      for g, p in zip(state["param_groups"], loaded, strict=True)]
            real_set(model, optimizer, {**state, "param_groups": groups}, **kwargs)

        ck._load_here = load_here  # type: ignore[assignment]
        ck.set_optimizer_state_dict = set_state  # type: ignore[assignment]
        try:
            super().load(model, optimizer, path)
        finally:
            ck._load_here, ck.set_optimizer_state_dict = real_load, real_set


# -- today's MoE state: the expert bias, fused gate/up weights, MTP layers -------------------------
def _routers(model: Any) -> list[Any]:
    from reference_impl.moe import moe_layers

    return [moe.router for _, moe in moe_layers(model) if moe.router.has_expert_bias]


def _fused(model: Any) -> list[Any]:
    from reference_impl.moe import moe_layers

    return [moe for _, moe in moe_layers(model) if moe.kind == "fused"]


class ExpertBiasOutOfPlace(ReferenceAdapter):
    """The bias update rebinds a new tensor instead of stepping the registered buffer (torchtitan PR
    #1226): the model routes on its live bias while the state dict -- and so every checkpoint --
    holds the buffer's zeros.  The load then restores zeros into the buffer and leaves the live bias
    at the load side's own values (``values``, silent, named by the first expert whose entry
    differs)."""

    name = "seeded-expert-bias-out-of-place"

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        model, _ = super().build(replace(spec, optimizer_steps=0), mesh, seed)
        for router in _routers(model):
            router.live_bias = router.expert_bias.clone()
            router.expert_bias.zero_()
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        for index in range(spec.optimizer_steps):
            self.step(model, optimizer, seed, index)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        import torch

        from conformance import synthetic_load
        from reference_impl.moe import moe_layers

        self._set_grads(model, seed, step)
        optimizer.step()
        for _, moe in moe_layers(model):
            if moe.router.has_expert_bias:
                load = synthetic_load(seed, step, moe.layer, moe.num_experts)
                moe.router.live_bias = (moe.router.live_bias + self.bias_rate
                                        * torch.sign(load.mean() - load))
        optimizer.zero_grad(set_to_none=True)

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[Any]:
        live = {id(r.expert_bias): r.live_bias for r in _routers(model)}
        for layer, expert, name, tensor in super().other_tensors(model, optimizer):
            yield layer, expert, name, live.get(id(tensor), tensor)


class ExpertBiasDroppedByEpWrapper(ReferenceAdapter):
    """At ep > 1 the EP wrapper replaces each router with one that has no expert bias (DeepSpeed PR
    #8369): a save there holds no bias (``checkpoint``: on-disk), a load there leaves the model
    without one (``missing``: silent), and a load at ep=1 of such a save asks for a bias the
    checkpoint lacks (refused)."""

    name = "seeded-expert-bias-dropped-by-ep-wrapper"

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        model, optimizer = super().build(spec, mesh, seed)
        if mesh is not None and spec.layout.ep > 1:
            for router in _routers(model):
                del router._buffers["expert_bias"], router._buffers["tokens_per_expert"]
                router.has_expert_bias = False
        return model, optimizer


class ExpertBiasSavedInBf16(ReferenceAdapter):
    """The save casts the fp32 expert bias to bf16 (a checkpoint written in the model's compute
    dtype, which transformers keeps the bias out of with ``_keep_in_fp32_modules_strict``): every
    layout saves it so, and a load gives back the bias rounded to bf16 (``values``, silent: rounded
    through bfloat16)."""

    name = "seeded-expert-bias-saved-in-bf16"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        routers = _routers(model)
        kept = [r.expert_bias for r in routers]
        for router in routers:
            router._buffers["expert_bias"] = router.expert_bias.to(torch.bfloat16)
        try:
            super().save(model, optimizer, path)
        finally:
            for router, bias in zip(routers, kept, strict=True):
                router._buffers["expert_bias"] = bias


class ExpertBiasNotLoaded(ReferenceAdapter):
    """A load that restores parameters only: every buffer keeps the load side's values (``values``,
    silent: still the pre-load values)."""

    name = "seeded-expert-bias-not-loaded"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        routers = _routers(model)
        kept = [r.expert_bias.clone() for r in routers]
        super().load(model, optimizer, path)
        for router, bias in zip(routers, kept, strict=True):
            router.expert_bias.copy_(bias)


class BuffersZeroedAfterLoad(ReferenceAdapter):
    """The framework's own load, then every persistent floating-point buffer set to zero: the plant
    a green default tier must not pass."""

    name = "seeded-buffers-zeroed-after-load"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        super().load(model, optimizer, path)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if (buffer is not None and buffer.is_floating_point()
                    and name not in module._non_persistent_buffers_set):
                    buffer.zero_()


class FusedShardCutAcrossHalves(ReferenceAdapter):
    """A load into an expert-TP-sharded fused gate/up weight that chunks the fused dim as one
    ``[2h]`` axis (transformers PR #48823: ``[A B C D] + [E F G H]`` loaded as ``[A B E F]``'
    reverse): etp rank 0 gets all of gate, rank 1 all of up, so each rank's up (or gate) rows hold
    the other half's (``values``, silent, naming the half)."""

    name = "seeded-fused-shard-cut-across-halves"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch
        from torch.distributed.tensor import DTensor

        from reference_impl.regions import local_region

        super().load(model, optimizer, path)
        with torch.no_grad():
            for moe in _fused(model):
                param = moe.gate_up_w
                if not isinstance(param, DTensor) or param.dim() != 4:
                    continue  # no expert TP: nothing chunks the fused dim
                full = param.full_tensor()  # [E, 2, h, dim] gate then up, every rank alike
                local, region = local_region(param)
                # [E, 2h, dim]: the fused dim as one axis
                joined = full.reshape(full.shape[0], -1, full.shape[-1])
                rows = local.shape[1] * local.shape[2]
                part = region[2].start // local.shape[2]
                naive = joined[region[0], part * rows:(part + 1) * rows]
                local.copy_(naive.reshape(local.shape))


class FusedHalvesSwapped(ReferenceAdapter):
    """A tensor-parallel swizzle that swaps a fused weight's gate and up halves on load (Megatron-LM
    #2769, PR #5714; Megatron-Bridge PR #1817): each half holds the other's values (``values``,
    silent)."""

    name = "seeded-fused-halves-swapped"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.model import HALF_AXIS, fused_frame
        from reference_impl.regions import local_region

        super().load(model, optimizer, path)
        with torch.no_grad():
            for moe in _fused(model):
                frame = fused_frame(local_region(moe.gate_up_w)[0], moe.fused_order)
                gate, up = frame.select(HALF_AXIS[moe.fused_order],
                                        0), frame.select(HALF_AXIS[moe.fused_order], 1)
                kept = gate.clone()
                gate.copy_(up)
                up.copy_(kept)


class InterleavedReadAsConcatenated(ReferenceAdapter):
    """A model whose fused weight interleaves gate and up rows (GPT-OSS), loaded by code that reads
    the file's rows as concatenated halves and writes them in as they are (slime #1840, verl PR
    #7243): ``values``, silent, naming the half and the misreading."""

    name = "seeded-interleaved-read-as-concatenated"
    fused_order = "interleaved"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.regions import local_region

        super().load(model, optimizer, path)
        with torch.no_grad():
            for moe in _fused(model):
                local = local_region(moe.gate_up_w)[0]
                if not local.numel():
                    continue  # a rank FSDP gave no expert rows of an uneven E
                # the rows as the model holds them
                rows = local.reshape(local.shape[0], -1, local.shape[-1])
                # the file's gate, then up, taken as they are
                read = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
                rows.copy_(read)


class MtpExpertsNotMappedBack(ReferenceAdapter):
    """The MTP layers' experts are saved under names of their own that the load does not map back
    (Megatron-Bridge #4329, PR #4819): after the load they keep the load side's values (``values``,
    silent, in the MTP layer, global layer ``num_layers``)."""

    name = "seeded-mtp-experts-not-mapped-back"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers
        from reference_impl.regions import local_region

        mtp = [moe for _, moe in moe_layers(model) if moe.layer >= model.num_layers]
        kept = [(local_region(p)[0], local_region(p)[0].clone()) for moe in mtp
                for p in moe.expert_parameters()]
        super().load(model, optimizer, path)
        with torch.no_grad():
            for local, before in kept:
                local.copy_(before)


class MtpLeftOutOfSave(ReferenceAdapter):
    """The save leaves the MTP layers out (ms-swift #6644) and the load does not ask for them: every
    checkpoint lacks them, the ep=1 one included (``checkpoint``: on-disk), and after a load they
    keep the load side's values (``values``, silent)."""

    name = "seeded-mtp-left-out-of-save"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        with _without_mtp():
            super().save(model, optimizer, path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        with _without_mtp():
            super().load(model, optimizer, path)


@contextlib.contextmanager
def _without_mtp() -> Iterator[None]:
    """reference_impl.checkpoint's DCP calls with every MTP key left out, weights and optimizer
    state alike."""
    import reference_impl.checkpoint as ck

    real = ck.dcp

    def strip(state: dict[str, Any]) -> dict[str, Any]:
        model = {k: v for k, v in state.get("model", {}).items() if not k.startswith("mtp.")}
        found = {**state, "model": model}
        if "optimizer" in state:
            optim = state["optimizer"]
            kept = {k: v for k, v in optim.get("state", {}).items() if not k.startswith("mtp.")}
            found["optimizer"] = {**optim, "state": kept}
        return found

    class _Shim:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def save(state: dict[str, Any], **kwargs: Any) -> Any:
            return real.save(strip(state), **kwargs)

        @staticmethod
        def load(state: dict[str, Any], **kwargs: Any) -> Any:
            stripped = strip(state)
            result = real.load(stripped, **kwargs)
            _copy_back(state, stripped, lambda k: k)
            return result

    ck.dcp = _Shim()
    try:
        yield
    finally:
        ck.dcp = real


class DownReadAsItsTranspose(ReferenceAdapter):
    """A load that reads each expert's ``[in, out]`` down weight into the model's ``[out, in]`` by
    reshaping, not transposing (Megatron-LM #909's GroupedMLP layout; slime #1840, hidden there
    because the two dims were equal): the reference's dims all differ, so no square shape hides it
    (``values``, silent: its transpose read in its own shape)."""

    name = "seeded-down-read-as-its-transpose"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        from reference_impl.moe import moe_layers
        from reference_impl.regions import local_region

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, moe in moe_layers(model):
                weights = ([e.down.weight for e in moe.experts] if moe.kind == "unpacked"
                           else [moe.down_w])
                for weight in weights:
                    local = local_region(weight)[0]
                    local.copy_(local.transpose(-1, -2).reshape(local.shape).clone())


class TokenCounterSaved(ReferenceAdapter):
    """The save writes each router's non-persistent token counter into the checkpoint (a buffer
    registered persistent, or a state dict built by hand): every checkpoint holds per-step state,
    the ep=1 one included (``checkpoint``: on-disk, naming the key and the buffer)."""

    name = "seeded-token-counter-saved"

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        import reference_impl.checkpoint as ck
        from reference_impl.moe import moe_layers

        real = ck.dcp
        counters = {f"{prefix}.router.tokens_per_expert": moe.router.tokens_per_expert.clone()
                    for prefix, moe in moe_layers(model) if moe.router.has_expert_bias}

        class _Shim:
            def __getattr__(self, attr: str) -> Any:
                return getattr(real, attr)

            @staticmethod
            def save(state: dict[str, Any], **kwargs: Any) -> Any:
                return real.save({**state, "model": {**state["model"], **counters}}, **kwargs)

        ck.dcp = _Shim()
        try:
            super().save(model, optimizer, path)
        finally:
            ck.dcp = real
