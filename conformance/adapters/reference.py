"""The built-in ``reference`` adapter: ``reference_impl`` end to end.

The model is :class:`reference_impl.moe.MoEModel`, split with ``apply_expert_parallel``, sharded
with ``apply_fsdp`` in FSDP cells, stepped with AdamW on :func:`conformance.synthetic_grad`
gradients, and checkpointed through :mod:`reference_impl.checkpoint` (ExpertLayout + DCP).  Every
applicable cell of the matrix passes; the ``legacy`` adapter shows what happens without the layout.

It builds on any :class:`conformance.layout.ParallelLayout` mesh: EP groups strided or consecutive
(the EP rank is the ``ep`` coordinate), HSDP (``dp_replicate`` > 1 with FSDP) and expert tensor
parallelism (``etp`` > 1: each expert weight a DTensor sharded on its hidden axis).  Packed layers
save the packed form (``up_w`` ``[E, ...]``), unpacked ones the per-expert form
(``experts.G.up.weight``), and each form loads into either kind, so it declares ``cross_kind``: a
cross-kind cell checks a real translation between the forms. :class:`ReferencePerExpertAdapter`
(``reference-per-expert``) saves packed layers per expert too, so both forms of a packed layer stay
checked.

Canonical names are the same for both layer kinds (``up``, ``gate``, ``down`` and their Adam
moments ``up.exp_avg`` ...), so a packed row and the unpacked expert it equals compare equal.
Expert tensors are yielded as the checkpoint holds them: a whole per-expert tensor, or a DTensor
(FSDP shard, etp shard) that the harness compares through its local shard and region.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any, Literal, cast

from conformance.adapter import (
    ADAM_MOMENTS,
    FINETUNES,
    FORWARD_OUTPUT,
    Capabilities,
    ExpertBlock,
    HFModel,
    NotApplicable,
    Spec,
    TensorEntry,
    local_region,
    run_steps,
    torch_optimizer_scalars,
    with_moments,
    world_device,
)
from conformance.synthetic import synthetic_grad, synthetic_grad_rows, synthetic_load


class ReferenceAdapter:
    name = "reference"
    version = "0.1.0"
    #: cross_kind: either checkpoint form loads into either kind (reference_impl.expert_layout).
    capabilities = Capabilities(
        kinds=("packed", "unpacked", "fused"), optimizer=True, fsdp=True, uneven=True,
        max_ep=64, format="dcp", cross_kind=True, ep_orders=("strided", "consecutive"),
        hsdp=True, etp=True, pp=(1, 2, 3), mtp=True, finetune=FINETUNES)
    #: the row order of a fused layer's gate/up weight (reference_impl.model.FUSED_ORDERS).
    fused_order = "concatenated"
    #: the expert bias's step per optimizer step (DeepSeek-V3's update speed).
    bias_rate = 1e-3

    # -- building ----------------------------------------------------------------------------------
    def moe_config(self, spec: Spec) -> Any:
        """The :class:`~reference_impl.moe.MoEConfig` of ``spec``'s model."""
        import torch

        from reference_impl.moe import MoEConfig

        # Spec's kind and activation are plain str; MoEConfig.__post_init__ rejects a value outside
        # its Literal
        return MoEConfig(num_experts=spec.num_experts, dim=spec.dim, hidden=spec.hidden,
                         kind=cast(Literal["packed", "unpacked", "fused"], spec.kind),
                         activation=cast(Literal["swiglu", "gelu"], spec.activation),
                         top_k=min(spec.top_k, spec.num_experts),
                         shared_expert=spec.shared_expert, dtype=getattr(torch, spec.dtype),
                         fused_order=cast(Literal["concatenated", "interleaved"],
                                          self.fused_order),
                         expert_bias=True, mtp_layers=spec.mtp_layers)

    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        import torch

        from conformance.adapters.finetune import apply_finetune, trainable
        from reference_impl.meshes import sliced
        from reference_impl.moe import (
            apply_expert_parallel,
            apply_fsdp,
            apply_pipeline,
            build_model,
        )

        model = build_model(self.moe_config(spec), spec.num_layers, seed).to(world_device(mesh))
        if spec.finetune:  # on the whole model: its adapters drawn per global expert, as weights
            apply_finetune(model, spec, seed)
        if mesh is not None:
            # this rank's stage first: its layers keep their global names
            if "pp" in (mesh.mesh_dim_names or ()):
                pp_mesh: Any = sliced(mesh, ("pp",))
                apply_pipeline(model, pp_mesh.size(), pp_mesh.get_local_rank())
                model.pp_mesh = pp_mesh
            apply_expert_parallel(model, mesh)
            if spec.fsdp:
                apply_fsdp(model, mesh)
        if spec.optimizer_steps <= 0:
            return model, None
        optimizer = torch.optim.AdamW(trainable(model), lr=spec.lr, weight_decay=0.01)
        run_steps(lambda index: self.step(model, optimizer, seed, index), 0, spec.optimizer_steps)
        return model, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One AdamW step on :func:`conformance.synthetic_grad` gradients for step index ``step``,
        and one expert-bias step on :func:`conformance.synthetic_load` loads (DeepSeek-V3's
        rule)."""
        from reference_impl.moe import moe_layers, update_expert_bias

        self._set_grads(model, seed, step)
        for _, moe in moe_layers(model):
            if moe.router.has_expert_bias:
                moe.router.tokens_per_expert.copy_(
                    synthetic_load(seed, step, moe.layer, moe.num_experts))
        optimizer.step()
        update_expert_bias(model, self.bias_rate)
        optimizer.zero_grad(set_to_none=True)

    def scalars(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """Each param group's hyperparameters and the step counts of every parameter's state."""
        return torch_optimizer_scalars(optimizer)

    def forward(self, model: Any, batch: Any) -> Any:
        """The model's forward on ``batch``, without autograd, stage by stage under pipeline
        parallelism (every rank returns the last stage's output); FSDP2's parameters resharded after
        it."""
        import torch
        from torch.distributed.fsdp import FSDPModule

        from reference_impl.moe import pipeline_outputs

        batch = batch.to(next(model.parameters()).device)
        depths = model.config.mtp_layers
        with torch.no_grad():
            pp_mesh = getattr(model, "pp_mesh", None)
            if pp_mesh is None:
                outputs = model(batch, with_mtp=True)
            else:
                outputs = pipeline_outputs(lambda h: model(h, batch, with_mtp=True), batch,
                                           pp_mesh.get_group(), model.stage, 1 + depths)
        if isinstance(model, FSDPModule):
            model.reshard()
        if not depths:
            return outputs[0]
        return {FORWARD_OUTPUT: outputs[0],
                **{f"mtp.{i}": out for i, out in enumerate(outputs[1:])}}

    @staticmethod
    def _set_grads(model: Any, seed: int, step: int) -> None:
        """Gradients from synthetic_grad by global identity, cut to the region this rank holds."""
        from torch.distributed.tensor import DTensor

        from reference_impl.regions import global_regions

        layers = _layer_index(model)
        for piece in global_regions(model):
            if not piece.param.requires_grad:  # a fine-tuned model's frozen base
                continue
            layer, expert, name = _identify(piece.name, layers)
            # gate and up rows drawn as their packed weights', in its frame
            if piece.fused_order is not None:
                grad = _fused_grad(piece, seed, step, layer)
            # packed: one block per expert, as its unpacked weight gets, drawn
            elif piece.experts is not None:
                # for the rows held only
                rows, inner = piece.region[0], (slice(None), *piece.region[1:])
                grad = synthetic_grad_rows(seed, step, layer, range(rows.start, rows.stop),
                                           name[:-2], piece.global_shape[1:])[inner]
            else:
                grad = synthetic_grad(seed, step, layer, expert, name,
                                      piece.global_shape)[piece.region]
            # synthetic_grad(_rows) hands out a new tensor: copied again only to move, convert or
            # pack a cut of it
            grad = grad.to(device=piece.local.device, dtype=piece.param.dtype)
            grad = grad.reshape(local_region(piece.param)[0].shape).contiguous()
            p = piece.param
            if isinstance(p, DTensor):
                grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
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

        check_saved_experts(model, FileSystemReader(path).read_metadata().state_dict_metadata,
                            where=path)

    def save_legacy(self, model: Any, optimizer: Any, path: str) -> None:
        from reference_impl.checkpoint import save_legacy

        save_legacy(model, optimizer, path)

    # -- Hugging Face export (reference_impl.hf: Ernie4_5_MoeForCausalLM) --------------------------
    def hf_model(self, spec: Spec) -> HFModel:
        """The family whose forward is the reference's (:mod:`reference_impl.hf`)."""
        from reference_impl.hf import HF_CLASS, hf_config

        try:
            return HFModel(HF_CLASS, hf_config(self.moe_config(spec), spec.num_layers))
        except ValueError as exc:
            raise NotApplicable(str(exc)) from exc

    def export_hf(self, model: Any, path: str) -> None:
        """The model as the family's checkpoint; a fine-tuned one merged
        (:mod:`reference_impl.merged_export`)."""
        from reference_impl.hf import export_hf, hf_config

        try:  # a model the family cannot hold: refused on every rank alike, before any collective
            hf_config(model.config, model.num_layers)
        except ValueError as exc:
            raise NotApplicable(str(exc)) from exc
        export_hf(model, path)

    def import_hf(self, model: Any, path: str) -> None:
        from reference_impl.hf import import_hf
        from reference_impl.lora import has_tuning_state
        from reference_impl.moe import moe_layers

        if any(has_tuning_state(moe) for _, moe in moe_layers(model)):
            raise NotApplicable("a merged export holds no adapters and no quantized base: a "
                                "fine-tuning run starts from the base's release, not from it")
        import_hf(model, path)

    def hf_forward(self, hf_model: Any, batch: Any) -> Any:
        """The base model's last hidden state on ``inputs_embeds``: the reference's output (its
        attention adds nothing, reference_impl.hf)."""
        return hf_model.model(inputs_embeds=batch[None]).last_hidden_state[0]

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[TensorEntry | ExpertBlock]:
        """Each expert's weight and moments as the checkpoint holds them: whole tensors, or DTensors
        whose local shard and region the harness compares (FSDP's shards, expert tensor
        parallelism's shards); a packed weight and each moment as one
        :class:`~conformance.adapter.ExpertBlock` of its rows."""
        from conformance.adapters.finetune import tuned_expert_tensors
        from reference_impl.lora import has_tuning_state
        from reference_impl.moe import moe_layers

        state = optimizer.state if optimizer is not None else {}
        for _, moe in moe_layers(model):
            layer = moe.layer
            if has_tuning_state(moe):  # adapters, blocks and scales beside (or for) the weights
                yield from tuned_expert_tensors(moe, state)
                continue
            if moe.kind == "fused":  # its halves, placed as a packed layer's gate and up weights
                yield from _fused_blocks(moe, state)
            for linear in _linears(moe):
                if moe.kind == "unpacked":
                    for i, expert in enumerate(moe.experts):
                        weight = getattr(expert, linear).weight
                        g = moe.local_expert_start + i
                        yield from with_moments(layer, [(g, weight)], linear, state, weight,
                                                rows=partial(_one_row, g))
                # one block per packed weight and moment: its rows are experts local_expert_start on
                else:
                    weight = getattr(moe, f"{linear}_w")
                    yield ExpertBlock(layer, moe.local_expert_start, linear, weight)
                    for moment in ADAM_MOMENTS:
                        if moment in state.get(weight, {}):
                            yield ExpertBlock(layer, moe.local_expert_start, f"{linear}.{moment}",
                                              state[weight][moment])

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
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
        for _, moe in moe_layers(model):  # a persistent buffer is state like a weight
            if moe.router.has_expert_bias:
                yield moe.layer, None, "router.expert_bias", moe.router.expert_bias


class ReferencePerExpertAdapter(ReferenceAdapter):
    """The reference with packed layers saved in the per-expert form, as Hugging Face and Megatron
    checkpoints hold experts (one DCP item per expert, weight and moment): every applicable cell
    passes, as the reference's do."""

    name = "reference-per-expert"
    per_expert = True
    #: a fine-tuned layer saves only in its own kind's form (reference_impl.tuned_checkpoint: a
    #: fused layer's one A for gate and up has no per-expert twin): no fine-tuning cells here.
    capabilities = replace(ReferenceAdapter.capabilities, finetune=())


def _linears(moe: Any) -> tuple[str, ...]:
    """The packed or unpacked weights of ``moe`` (a fused layer's gate and up are
    :func:`_fused_blocks`')."""
    if moe.kind == "fused":
        return ("down",)
    return ("gate", "up", "down") if moe.activation == "swiglu" else ("up", "down")


def _fused_blocks(moe: Any, state: Any) -> Iterator[ExpertBlock]:
    """A fused layer's gate and up halves, and each moment's, as the blocks a packed layer's weights
    are."""
    from reference_impl.fused import fused_halves

    weight = moe.gate_up_w
    tensors = [("", weight)] + [(f".{m}", state[weight][m]) for m in ADAM_MOMENTS
                                if m in state.get(weight, {})]
    for suffix, tensor in tensors:
        gate, up = fused_halves(tensor, moe.fused_order,
                                where=f"layer {moe.layer}'s gate_up_w{suffix}")
        yield ExpertBlock(moe.layer, moe.local_expert_start, f"gate{suffix}", gate)
        yield ExpertBlock(moe.layer, moe.local_expert_start, f"up{suffix}", up)


def _fused_grad(piece: Any, seed: int, step: int, layer: int | None) -> Any:
    """A fused weight's gradient for the region this rank holds, in its frame: each expert's gate
    and up rows as its packed ``gate_w`` and ``up_w`` get them."""
    import torch

    from reference_impl.model import HALF_AXIS

    shape, region = piece.global_shape, piece.region
    half_axis = HALF_AXIS[piece.fused_order]
    row = tuple(n for i, n in enumerate(shape) if i not in (0, half_axis))
    rows = range(region[0].start, region[0].stop)
    halves = [synthetic_grad_rows(seed, step, layer, rows, name, row) for name in ("gate", "up")]
    framed = torch.stack(halves, dim=half_axis)
    cut = (slice(None), *region[1:])
    return framed[cut]


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
            if rest.startswith("experts."):  # experts.G.up.weight, experts.G.up.lora_A.weight
                _, g, *tensor = rest.split(".")
                return layer, int(g), ".".join(tensor[:-1])
            return layer, None, rest
    return None, None, name
