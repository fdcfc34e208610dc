"""The built-in ``reference`` adapter: ``reference_impl`` end to end.

The model is :class:`reference_impl.moe.MoEModel`, split with ``apply_expert_parallel``, sharded
with ``apply_fsdp`` in FSDP cells, stepped with AdamW on :func:`conformance.synthetic_grad`
gradients, and checkpointed through :mod:`reference_impl.checkpoint` (ExpertLayout + DCP).  Every
applicable cell of the matrix passes; the ``legacy`` adapter shows what happens without the layout.

It builds on any :class:`conformance.layout.ParallelLayout` mesh: EP groups strided or consecutive
(the EP rank is the ``ep`` coordinate), HSDP (``dp_replicate`` > 1 with FSDP) and expert tensor
parallelism (``etp`` > 1: each expert weight a DTensor sharded on its hidden axis).  Packed layers save the packed form
(``up_w`` ``[E, ...]``), unpacked ones the per-expert form (``experts.G.up.weight``), and each form loads into
either kind, so it declares ``cross_kind``: a cross-kind cell checks a real translation between the forms.
:class:`ReferencePerExpertAdapter` (``reference-per-expert``) saves packed layers per expert too, so both forms of
a packed layer stay checked.

Canonical names are the same for both layer kinds (``up``, ``gate``, ``down`` and their Adam
moments ``up.exp_avg`` ...), so a packed row and the unpacked expert it equals compare equal.
Expert tensors are yielded as the checkpoint holds them: a whole per-expert tensor, or a DTensor
(FSDP shard, etp shard) that the harness compares through its local shard and region.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any, Literal, cast

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    ExpertBlock,
    Spec,
    TensorEntry,
    run_steps,
    torch_optimizer_scalars,
    with_moments,
    world_device,
)
from conformance.synthetic import synthetic_grad, synthetic_grad_rows


class ReferenceAdapter:
    name = "reference"
    version = "0.1.0"
    #: cross_kind: either checkpoint form loads into either kind (reference_impl.expert_layout).
    capabilities = Capabilities(kinds=("packed", "unpacked"), optimizer=True, fsdp=True, uneven=True, max_ep=64,
                                format="dcp", cross_kind=True, ep_orders=("strided", "consecutive"), hsdp=True,
                                etp=True, pp=(1, 2, 3))

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        from reference_impl.meshes import sliced
        from reference_impl.moe import MoEConfig, apply_expert_parallel, apply_fsdp, apply_pipeline, build_model

        # Spec's kind and activation are plain str; MoEConfig.__post_init__ rejects a value outside its Literal
        config = MoEConfig(num_experts=spec.num_experts, dim=spec.dim, hidden=spec.hidden,
                           kind=cast(Literal["packed", "unpacked"], spec.kind),
                           activation=cast(Literal["swiglu", "gelu"], spec.activation),
                           top_k=min(spec.top_k, spec.num_experts),
                           shared_expert=spec.shared_expert, dtype=getattr(torch, spec.dtype))
        model = build_model(config, spec.num_layers, seed).to(world_device(mesh))
        if mesh is not None:
            if "pp" in (mesh.mesh_dim_names or ()):  # this rank's stage first: its layers keep their global names
                pp_mesh: Any = sliced(mesh, ("pp",))
                apply_pipeline(model, pp_mesh.size(), pp_mesh.get_local_rank())
                model.pp_mesh = pp_mesh
            apply_expert_parallel(model, mesh)
            if spec.fsdp:
                apply_fsdp(model, mesh)
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One AdamW step on :func:`conformance.synthetic_grad` gradients for step index ``step``."""
        self._set_grads(model, seed, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """Each param group's hyperparameters and the step counts of every parameter's state."""
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """The model's forward on ``batch``, without autograd, stage by stage under pipeline parallelism (every rank
        returns the last stage's output); FSDP2's parameters resharded after it."""
        import torch
        from torch.distributed.fsdp import FSDPModule

        from reference_impl.moe import pipeline_forward

        batch = batch.to(next(model.parameters()).device)
        with torch.no_grad():
            pp_mesh = getattr(model, "pp_mesh", None)
            out = model(batch) if pp_mesh is None else pipeline_forward(model, batch, pp_mesh.get_group(), model.stage)
        if isinstance(model, FSDPModule):
            model.reshard()
        return out

    @staticmethod
    def _set_grads(model: Any, seed: int, step: int) -> None:
        """Gradients from synthetic_grad by global identity, cut to the region this rank holds."""
        from torch.distributed.tensor import DTensor

        from reference_impl.regions import global_regions

        layers = _layer_index(model)
        for piece in global_regions(model):
            layer, expert, name = _identify(piece.name, layers)
            if piece.experts is not None:  # packed: one block per expert, as its unpacked weight gets, drawn for
                rows, inner = piece.region[0], (slice(None), *piece.region[1:])  # the rows this rank holds only
                grad = synthetic_grad_rows(seed, step, layer, range(rows.start, rows.stop), name[:-2],
                                           piece.global_shape[1:])[inner]
            else:
                grad = synthetic_grad(seed, step, layer, expert, name, piece.global_shape)[piece.region]
            # synthetic_grad(_rows) hands out a new tensor: copied again only to move, convert or pack a cut of it
            grad = grad.to(device=piece.local.device, dtype=piece.param.dtype).contiguous()
            p = piece.param
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
            p.grad = grad

    # -- checkpoint path ---------------------------------------------------------------------------
    #: whether packed layers save one tensor per expert instead of the packed form.
    per_expert = False

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import save

        save(model, optimizer, path, per_expert=self.per_expert)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import load

        load(model, optimizer, path)

    def check_saved(self, model: Any, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        from reference_impl.expert_layout import check_saved_experts

        check_saved_experts(model, FileSystemReader(path).read_metadata().state_dict_metadata, where=path)

    def save_legacy(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import save_legacy

        save_legacy(model, optimizer, path)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry | ExpertBlock]:
        """Each expert's weight and moments as the checkpoint holds them: whole tensors, or DTensors whose
        local shard and region the harness compares (FSDP's shards, expert tensor parallelism's shards); a packed
        weight and each moment as one :class:`~conformance.adapter.ExpertBlock` of its rows."""
        from reference_impl.moe import moe_layers

        state = optimizer.state if optimizer is not None else {}
        for _, moe in moe_layers(model):
            layer = moe.layer
            for linear in ("gate", "up", "down") if moe.activation == "swiglu" else ("up", "down"):
                if moe.kind == "unpacked":
                    for i, expert in enumerate(moe.experts):
                        weight = getattr(expert, linear).weight
                        g = moe.local_expert_start + i
                        yield from with_moments(layer, [(g, weight)], linear, state, weight,
                                                rows=partial(_one_row, g))
                else:  # one block per packed weight and moment: its rows are experts local_expert_start on
                    weight = getattr(moe, f"{linear}_w")
                    yield ExpertBlock(layer, moe.local_expert_start, linear, weight)
                    for moment in ADAM_MOMENTS:
                        if moment in state.get(weight, {}):
                            yield ExpertBlock(layer, moe.local_expert_start, f"{linear}.{moment}",
                                              state[weight][moment])

    def other_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        from reference_impl.moe import moe_layers, named_parameters

        expert_params = set()
        for _, moe in moe_layers(model):
            expert_params |= {id(p) for p in moe.expert_parameters()}
        layers = _layer_index(model)
        state = optimizer.state if optimizer is not None else {}
        for name, p in named_parameters(model):
            if id(p) in expert_params:
                continue
            layer = _identify(name, layers)[0]
            yield layer, None, name, p
            for moment in ADAM_MOMENTS:
                if moment in state.get(p, {}):
                    yield layer, None, f"{name}.{moment}", state[p][moment]


class ReferencePerExpertAdapter(ReferenceAdapter):
    """The reference with packed layers saved in the per-expert form, as Hugging Face and Megatron checkpoints hold
    experts (one DCP item per expert, weight and moment): every applicable cell passes, as the reference's do."""

    name = "reference-per-expert"
    per_expert = True


def _one_row(g: int, moment: Any) -> list[tuple[int, Any]]:
    """An unpacked expert's moment as its one row: ``(global expert id, moment)``."""
    return [(g, moment)]


def _layer_index(model: Any) -> dict[str, int]:
    from reference_impl.moe import moe_layers

    return {prefix: moe.layer for prefix, moe in moe_layers(model)}


def _identify(name: str, layers: dict[str, int]) -> tuple[int | None, int | None, str]:
    """``(layer, global expert, short name)`` of an ep=1 parameter name of the reference model."""
    for prefix, layer in layers.items():
        head = f"{prefix}." if prefix else ""
        if name.startswith(head):
            rest = name[len(head):]
            if rest.startswith("experts."):
                _, g, linear, _ = rest.split(".")
                return layer, int(g), linear
            return layer, None, rest
    return None, None, name
