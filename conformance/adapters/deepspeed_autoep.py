"""The ``deepspeed-autoep`` adapters: DeepSpeed 0.19.8's AutoEP under ZeRO-1/2 and its universal
checkpoint.

AutoEP is the path DeepSpeed documents for changing the EP degree; all of it is DeepSpeed's own
code. A Mixtral-shaped model (fused ``gate_up_proj`` / ``down_proj``, filled by *global* expert id)
goes through ``deepspeed.initialize`` with ``"expert_parallel": {"enabled": true, "autoep_size": ep,
"preset_model": "mixtral", "use_grouped_mm": false}`` (consecutive EP groups; ``Spec.layout``'s
``ep_order="strided"`` is ``use_data_before_expert_parallelism``), ZeRO-1 (``deepspeed-autoep``;
``deepspeed-autoep-noconvert`` loads without the conversion) or ZeRO-2 (``deepspeed-autoep-zero2``),
fp32, ``torch_adam`` AdamW; ``deepspeed-autoep-bf16`` / ``deepspeed-autoep-zero2-bf16`` are the same
under ``"bf16": {"enabled": true}`` (bf16 parameters, fp32 masters and moments;
:class:`DeepSpeedAutoEPBf16Adapter`), and ``deepspeed-autoep-bf16-fp32accum`` adds
``grad_accum_dtype: fp32`` (DeepSpeed's ``BF16_Optimizer`` at ZeRO-1).
``deepspeed-autoep-deepseek_v3`` hands transformers' own ``DeepseekV3ForCausalLM`` to the
``deepseek_v3`` preset instead (ZeRO-1, fp32), its router's expert bias ``e_score_correction_bias``
with synthetic values (:mod:`conformance.adapters._deepspeed_models`). ``engine.save_checkpoint``;
``engine.load_checkpoint`` at the saved EP degree, else ``ds_to_universal`` then
``"load_universal": true`` (``_deepspeed_universal``).  Experts, fp32 masters and moments are read
with ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``. The ground truth is AutoEP's
conversion at ep=1 without an engine, stepped by ``torch.optim.AdamW``.

Workarounds, none of which changes what is checked (CPU/gloo only, ``DS_ACCELERATOR=cpu``):

* Re-link of optimizer-state fragments (:func:`_relink_optimizer_states`):
  ``DeepSpeedZeroOptimizer._optimizer_step`` links them after the *first* param group's step and
  marks every group linked before AutoEP's expert group has any state, so
  ``safe_get_full_optimizer_state`` on an expert raises "exp_avg not found in optimizer state
  fragment".
* ``gradient_clipping: 0``: the default clip to a global norm of 1.0 sums over every rank's experts,
  whose rounding depends on the EP degree -- it would test the clip, not the checkpoint.
* A step is ``engine.backward`` of a loss whose gradient is the synthetic one, expert gradients
  times ep, which ZeRO's expert averaging divides out (:meth:`DeepSpeedAutoEPAdapter.step`).
* Persistent world: before each engine only that cell's expert groups stay visible, as a fresh job
  sees them (``_deepspeed_common.use_expert_groups``).
* ``ds_to_universal`` runs in-process on global rank 0 with one extract and one merge worker (rank
  processes may not fork a pool), under a file lock so concurrent loads convert a checkpoint once.
* DeepSpeed's and transformers' imports are preloaded into the rank fork server (``preload``).

What the matrix finds: docs/frameworks/deepspeed.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from conformance.adapter import (
    ADAM_MOMENTS,
    Capabilities,
    FrameworkRefusal,
    Spec,
    forward_with_layers,
)
from conformance.adapters._deepspeed_checkpoint import AUTOEP_EP_DEPENDENT, read_autoep
from conformance.adapters._deepspeed_common import deepspeed, installed_version, use_expert_groups
from conformance.adapters._deepspeed_models import (
    IN_LAYER,
    deepseek_v3_model,
    dense_params,
    mixtral_model,
)
from conformance.adapters._deepspeed_universal import convert_once, load_universal, saved_ep
from conformance.synthetic import synthetic_grad

EXPERT_WEIGHTS = ("w1", "w2", "w3")
WEIGHT_DECAY = 0.01


def _ep_order(spec: Spec) -> str:
    """The EP order a ``Spec.layout`` asks for (DeepSpeed's default, consecutive, without one).

    The expert-tensor-parallel degree must be 1: AutoEP's ETP is its AutoTP folding, not driven
    here. DeepSpeed's ZeRO partitions over every data-parallel rank, so ``dp_replicate`` and
    ``dp_shard`` are one data-parallel group to it."""
    layout = getattr(spec, "layout", None)
    if layout is None:
        return "consecutive"
    if getattr(layout, "etp", 1) != 1:
        raise ValueError("deepspeed-autoep drives AutoEP without expert tensor parallelism; got "
                         f"etp={layout.etp}")
    order = getattr(layout, "ep_order", "consecutive")
    if order not in ("strided", "consecutive"):
        raise ValueError(f"ep_order must be 'strided' or 'consecutive', got {order!r}")
    return order


def _autoep_section(ep: int, preset: str) -> dict[str, Any]:
    return {"enabled": True, "autoep_size": ep, "preset_model": preset, "use_grouped_mm": False}


def _module(model: Any) -> Any:
    return getattr(model, "module", model)  # a DeepSpeedEngine, or the plain model (ground truth)


def _moe_layers(model: Any) -> list[Any]:
    return [block.mlp for block in _module(model).model.layers]


def _expert_ids(moe: Any) -> list[int]:
    """The global ids of ``moe``'s local experts, in local order: AutoEP's own placement."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(moe.expert_placement_descriptor, moe.ep_rank))


def _gradients(model: Any, seed: int, step: int,
               expert_scale: int = 1) -> Iterator[tuple[Any, Any]]:
    """``(parameter, its synthetic gradient)`` for every parameter, experts by global id, expert
    gradients times ``expert_scale`` (see :meth:`DeepSpeedAutoEPAdapter.step`)."""
    import torch

    for layer, moe in enumerate(_moe_layers(model)):
        ids = _expert_ids(moe)
        for name in EXPERT_WEIGHTS:
            p = getattr(moe.experts, name)
            grads = torch.stack([synthetic_grad(seed, step, layer, g, name, p.shape[1:])
                                 for g in ids])
            yield p, grads * expert_scale if expert_scale != 1 else grads
    for where, name, p in dense_params(_module(model)):
        yield p, synthetic_grad(seed, step, where, None, name, p.shape)


def _truth(adapter: Any, spec: Spec, seed: int) -> tuple[Any, Any]:
    """AutoEP at ep=1 on this rank alone, stepped by the optimizer the engine would make.

    With ``bf16`` the model's parameters are the engine's fp32 *masters*, rounded where DeepSpeed
    rounds: they start at ``bf16(w0)`` (the engine casts the module to bf16 before it makes its fp32
    partitions from it) and are stepped with gradients rounded to bf16 (autograd's gradient of a
    bf16 parameter); the bf16 parameter is then ``bf16(master)`` (:func:`_views`), as
    ``DeepSpeedZeroOptimizer.step`` copies it."""
    import torch
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.moe.utils import configure_moe_param_groups

    model = adapter.source_model(spec, seed)
    auto_ep = AutoEP(model, parse_autoep_config(_autoep_section(1, adapter.preset)))
    auto_ep.replace_moe_layers(auto_ep.ep_parser(), ep_size=1, ep_rank=0)
    if adapter.bf16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    if spec.optimizer_steps <= 0:
        return model, None
    optimizer = torch.optim.AdamW(configure_moe_param_groups(list(model.parameters())), lr=spec.lr,
                                  weight_decay=WEIGHT_DECAY)
    for step in range(spec.optimizer_steps):
        _truth_step(model, optimizer, seed, step, adapter.bf16)
    return model, optimizer


def _truth_step(model: Any, optimizer: Any, seed: int, step: int, bf16: bool) -> None:
    """One ``torch.optim.AdamW`` step of the ground truth (gradients rounded to bf16 under
    ``bf16``)."""
    for p, grad in _gradients(model, seed, step):
        p.grad = grad.bfloat16().float() if bf16 else grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _relink_optimizer_states(optimizer: Any) -> None:
    """The workaround for ``DeepSpeedZeroOptimizer._optimizer_step`` linking optimizer-state
    fragments after the first param group's step only (see the module docstring)."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


class DeepSpeedAutoEPAdapter:
    """AutoEP under ZeRO stage 1; :class:`DeepSpeedAutoEPZero2Adapter` is the same under stage 2."""

    name = "deepspeed-autoep"
    zero_stage = 1
    #: ``"bf16": {"enabled": true}``: bf16 parameters, fp32 masters
    #: (:class:`DeepSpeedAutoEPBf16Adapter`).
    bf16 = False
    #: ``"data_types": {"grad_accum_dtype": ...}`` when set
    #: (:class:`DeepSpeedAutoEPBf16Fp32AccumAdapter`).
    grad_accum_dtype: str | None = None
    #: AutoEP's preset for the model family :meth:`source_model` builds.
    preset = "mixtral"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=False, uneven=False,
                                max_ep=64, format="deepspeed", ep_orders=("consecutive", "strided"))
    #: imported once by the rank fork server (after this module, which sets DS_ACCELERATOR), not in
    #: each world's first engine: measured, these imports are 13 of the first engine's 15 s on 2
    #: cores (ZeRO's optimizer check imports the Muon optimizer, which imports torch._dynamo;
    #: AutoEP's conversion imports transformers when installed, to retarget its router-logit
    #: recorders).  A module that is not installed is skipped by the fork server.
    preload: tuple[str, ...] = ("deepspeed", "deepspeed.module_inject.auto_ep",
                                "deepspeed.runtime.zero.stage_1_and_2",
               "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.checkpoint.ds_to_universal",
               "transformers")
    #: see :data:`conformance.adapters._deepspeed_checkpoint.AUTOEP_EP_DEPENDENT`.
    ep_dependent_keys = AUTOEP_EP_DEPENDENT

    @property
    def version(self) -> str:
        return installed_version()

    # -- the model family --------------------------------------------------------------------------
    def source_model(self, spec: Spec, seed: int) -> Any:
        """The global model AutoEP converts (:mod:`conformance.adapters._deepspeed_models`)."""
        return mixtral_model(spec, seed)

    def output(self, model: Any, batch: Any) -> Any:
        """The model's output on ``batch`` (``[tokens, dim]``) as one sequence."""
        return model(batch.unsqueeze(0)).squeeze(0)

    # -- building ----------------------------------------------------------------------------------
    def build(self, spec: Spec, mesh: Any, seed: int) -> tuple[Any, Any]:
        if (spec.kind != "packed" or spec.fsdp or spec.dtype != "float32"
            or spec.activation != "swiglu"):
            raise ValueError(f"this adapter drives DeepSpeed AutoEP's {self.preset} preset (packed "
                             f"SwiGLU experts), "
                             f"{'bf16 with fp32 masters (dtype float32)' if self.bf16 else 'fp32'}"
                             f", ZeRO-{self.zero_stage}; got kind={spec.kind!r}, fsdp={spec.fsdp}, "
                             f"dtype={spec.dtype!r}, activation={spec.activation!r}")
        if mesh is None:
            return _truth(self, spec, seed)
        if mesh.device_type != "cpu":
            raise ValueError("deepspeed-autoep runs DeepSpeed's CPU accelerator "
                             "(DS_ACCELERATOR=cpu) on a gloo world; this world's mesh is on "
                             f"{mesh.device_type!r} (run with --moe-ep-backend=gloo)")
        ep = mesh["ep"].size()
        strided = _ep_order(spec) == "strided"
        use_expert_groups(ep, variant="strided" if strided else "")
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.zero_stage},
            "expert_parallel": _autoep_section(ep, self.preset),
            # DeepSpeed's own names for the two EP orders: its default puts ``ep`` consecutive ranks
            # in an EP group; "data before expert parallel" strides them (ranks r, r + world/ep,
            # ...).
            "use_data_before_expert_parallelism": strided,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": spec.lr, "weight_decay": WEIGHT_DECAY,
                                     "torch_adam": True}},
            # the default clip to 1.0 sums a norm over every rank's experts: rounding depends on the
            # EP degree.
            "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30,
        }
        # DeepSpeed's default bf16 path: grad-accum dtype bf16, so DeepSpeedZeroOptimizer at stage 1
        # too
        if self.bf16:
            config["bf16"] = {"enabled": True}
        if self.grad_accum_dtype is not None:
            config["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}
        source = self.source_model(spec, seed)
        engine, optimizer, _, _ = deepspeed().initialize(model=source, config=config)
        for step in range(spec.optimizer_steps):
            self.step(engine, optimizer, seed, step)
        return engine, optimizer

    def step(self, model: Any, optimizer: Any, seed: int, step: int) -> None:
        """One optimizer step with synthetic gradients: ``backward`` of ``sum(p * grad)`` has
        exactly ``grad`` as the gradient of ``p``, and runs ZeRO's own gradient hooks and reduction.

        ZeRO divides every gradient by the data-parallel size (the world) and sums an expert's over
        its expert-data-parallel group (world / ep ranks): the expert ends up with its local
        gradient divided by ep -- right for real training, where an expert's local gradient holds
        the tokens of all its EP peers.  So each rank's expert gradient is ``synthetic_grad * ep``,
        and every expert is stepped with ``synthetic_grad`` itself at every EP degree (exactly, for
        powers of two).
        """
        import torch

        if not hasattr(model, "backward"):  # the ground truth's plain model
            _truth_step(model, optimizer, seed, step, self.bf16)
            return
        loss = torch.zeros((), dtype=torch.float32)
        for p, grad in _gradients(model, seed, step, expert_scale=_moe_layers(model)[0].ep_size):
            loss = loss + (p * grad.to(p.device)).sum()
        model.backward(loss)
        model.step()

    def forward(self, model: Any, batch: Any) -> Any:
        """The engine's (or the truth's converted model's) forward on ``batch`` as one sequence of
        tokens: AutoEP's router, its ``_AllToAllV`` dispatch over the EP group at ep > 1, its
        experts and combine.

        In the named form, each AutoEP layer's own output too: behind the residual stream a layer's
        part is below the stream's rounding (as on the native adapter's model).

        Under bf16 the batch is cast to the parameters' dtype (DeepSpeed does not autocast: an fp32
        batch meets bf16 LayerNorm weights and torch raises "mixed dtype"); the truth, whose
        parameters are the fp32 masters, runs with them cast to bf16 for the forward (params only,
        as the engine casts them) and restored after it."""
        import torch

        layers = {f"model.layers.{i}.mlp": moe for i, moe in enumerate(_moe_layers(model))}
        truth_bf16 = self.bf16 and not hasattr(model, "module")
        params = list(_module(model).parameters())
        masters = [p.data for p in params] if truth_bf16 else []
        try:
            if truth_bf16:
                for p in params:
                    p.data = p.data.bfloat16()
            batch = batch.to(params[0].dtype)
            with torch.no_grad():
                return forward_with_layers(lambda: self.output(model, batch), layers)
        finally:
            # masters is empty unless truth_bf16
            for p, master in zip(params, masters, strict=False):
                p.data = master

    # -- checkpoint path ---------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, path: str) -> None:
        model.save_checkpoint(path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        ep = _moe_layers(model)[0].ep_size
        try:
            saved = saved_ep(path)
        except (OSError, KeyError) as exc:
            raise RuntimeError(f"{path} holds no DeepSpeed AutoEP checkpoint to load at ep={ep}: "
                               "expected 'latest' naming a tag whose mp_rank_00_model_states.pt "
                               f"records expert_parallel.autoep_size ({type(exc).__name__}: "
                               f"{exc})") from exc
        universal = saved != ep
        story = (f"saved at ep={saved}, loading at "
                 f"ep={ep}{' through a universal checkpoint' if universal else ''}")
        try:
            if universal:
                convert_once(path)
            with load_universal(model, universal):
                loaded, _ = model.load_checkpoint(path, load_optimizer_states=optimizer is not None,
                                                  load_lr_scheduler_states=False)
        # DeepSpeed's own error, prefixed with the EP degrees it happened between
        except Exception as exc:
            message = " ".join(str(exc).split()).replace(os.fspath(path), "<checkpoint>")
            raise RuntimeError(f"load ({story}) raised {type(exc).__name__}: {message}") from exc
        if loaded is None:
            raise FrameworkRefusal("DeepSpeed engine.load_checkpoint found no checkpoint in "
                                   f"{path} ({story})")

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        """The engine checkpoint and its universal conversion in global form (converted here once; a
        later load at another EP reuses it):
        :func:`conformance.adapters._deepspeed_checkpoint.read_autoep`."""
        return read_autoep(path)

    # -- canonical views ---------------------------------------------------------------------------
    def expert_tensors(self, model: Any, optimizer: Any) -> Iterator[tuple[int, int, str, Any]]:
        engine = hasattr(model, "module")
        if engine and optimizer is not None:
            _relink_optimizer_states(optimizer)
        for layer, moe in enumerate(_moe_layers(model)):
            ids = _expert_ids(moe)
            for name in EXPERT_WEIGHTS:
                p = getattr(moe.experts, name)
                for short, full in _views(name, p, optimizer, engine, self.bf16):
                    for i, g in enumerate(ids):
                        yield layer, g, short, full[i]

    def other_tensors(self, model: Any,
                      optimizer: Any) -> Iterator[tuple[int | None, None, str, Any]]:
        engine = hasattr(model, "module")
        for layer, name, p in dense_params(_module(model)):
            for short, full in _views(name, p, optimizer, engine, self.bf16):
                yield layer, None, short, full
        for layer, name, buffer in _buffers(model):
            yield layer, None, name, buffer
        for kind, value in _steps(optimizer).items():
            yield None, None, f"optimizer.step[{kind}]", value

    def scalars(self, model: Any, optimizer: Any) -> dict[str, object]:
        """Step counts and hyperparameters of the dense and the expert param group."""
        out: dict[str, object] = {f"step[{kind}]": int(value.item())
                                  for kind, value in _steps(optimizer).items()}
        for kind, group in _groups(optimizer).items():
            for key in ("lr", "betas", "weight_decay", "eps"):
                value = group[key]
                out[f"{key}[{kind}]"] = tuple(float(v)
                                              for v in value) if key == "betas" else float(value)
        return out


class DeepSpeedAutoEPZero2Adapter(DeepSpeedAutoEPAdapter):
    """AutoEP under ZeRO stage 2 (gradients partitioned too)."""

    name = "deepspeed-autoep-zero2"
    zero_stage = 2


class DeepSpeedAutoEPBf16Adapter(DeepSpeedAutoEPAdapter):
    """AutoEP under ZeRO stage 1 in bf16: ``"bf16": {"enabled": true}``, DeepSpeed's default bf16
    path.

    The bf16 parameters are this adapter's production precision: the engine casts the module's
    parameters to bf16 (``DeepSpeedEngine._configure_distributed_model``) and
    ``DeepSpeedZeroOptimizer`` keeps fp32 partitions of them (its masters,
    ``single_partition_of_fp32_groups``) with fp32 Adam moments; each step copies the stepped fp32
    partition back into the bf16 one.  ``spec.dtype == "float32"`` keeps naming the fp32 masters (as
    on ``megatron-distopt``).  The canonical views hold the bf16 weight under the weight's name, the
    fp32 master as ``<name>.master`` and the fp32 moments.  The grad-accum dtype is left at its
    default (the model's, bf16), which gives ``DeepSpeedZeroOptimizer`` at stage 1 too;
    ``"data_types": {"grad_accum_dtype": "fp32"}`` would give ``BF16_Optimizer`` instead
    (docs/frameworks/deepspeed.md).

    The ground truth is the same computation at ep=1 without an engine: fp32 masters from
    ``bf16(w0)``, gradients rounded to bf16, ``torch.optim.AdamW`` in fp32, bf16 weights cast from
    the masters (:func:`_truth`).  The forward casts the batch to bf16
    (:meth:`DeepSpeedAutoEPAdapter.forward`)."""

    name = "deepspeed-autoep-bf16"
    bf16 = True


class DeepSpeedAutoEPZero2Bf16Adapter(DeepSpeedAutoEPBf16Adapter):
    """:class:`DeepSpeedAutoEPBf16Adapter` under ZeRO stage 2 (``DeepSpeedZeroOptimizer`` with
    gradients partitioned too)."""

    name = "deepspeed-autoep-zero2-bf16"
    zero_stage = 2


class DeepSpeedAutoEPBf16Fp32AccumAdapter(DeepSpeedAutoEPBf16Adapter):
    """:class:`DeepSpeedAutoEPBf16Adapter` with ``"data_types": {"grad_accum_dtype": "fp32"}``: at
    ZeRO stage 1 DeepSpeed then wraps the optimizer in ``BF16_Optimizer``
    (``runtime/bf16_optimizer.py``; fp32 gradient accumulation, fp32 masters in
    ``fp32_groups_flat_partition``) instead of ``DeepSpeedZeroOptimizer``
    (``DeepSpeedEngine._do_optimizer_sanity_check``).  Same views, truth and steps as the bf16
    adapter: the gradients are still bf16 when autograd makes them, so fp32 accumulation of one
    micro-batch changes no value."""

    name = "deepspeed-autoep-bf16-fp32accum"
    grad_accum_dtype = "fp32"
    preload = (*DeepSpeedAutoEPAdapter.preload, "deepspeed.runtime.bf16_optimizer")


class DeepSpeedAutoEPNoConversionAdapter(DeepSpeedAutoEPAdapter):
    """AutoEP under ZeRO-1 loaded the way a user who skips the conversion does: ``load_checkpoint``
    at every EP degree.  DeepSpeed 0.19.8 neither refuses nor converts: at another degree the
    module's expert weights come back right (from the per-global-expert files) while the experts'
    fp32 masters and Adam moments come from ZeRO partitions of the saved layout -- other values,
    silently, and the next step writes the wrong masters into the model.  The matrix's negative
    control on this path."""

    name = "deepspeed-autoep-noconvert"

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        loaded, _ = model.load_checkpoint(path, load_optimizer_states=optimizer is not None,
                                          load_lr_scheduler_states=False)
        if loaded is None:
            raise FrameworkRefusal("DeepSpeed engine.load_checkpoint found no checkpoint in "
                                   f"{path}")


class DeepSpeedAutoEPDeepseekV3Adapter(DeepSpeedAutoEPAdapter):
    """AutoEP's ``deepseek_v3`` preset under ZeRO-1 on transformers' own ``DeepseekV3ForCausalLM``
    (:func:`~conformance.adapters._deepspeed_models.deepseek_v3_model`), as its users run it:
    AutoEP moves ``mlp.gate.e_score_correction_bias`` onto its router
    (``mlp.router.e_score_correction_bias``, a persistent fp32 buffer, whole on every rank; AutoEP's
    own bias update is off in this build), keeps the shared expert, and the forward is
    transformers' (``inputs_embeds``, logits) with AutoEP's layers in it.  The bias has synthetic
    values from the build on, so a load that leaves the load side's is red."""

    name = "deepspeed-autoep-deepseek_v3"
    preset = "deepseek_v3"
    preload = (*DeepSpeedAutoEPAdapter.preload,
               "transformers.models.deepseek_v3.modeling_deepseek_v3")

    def source_model(self, spec: Spec, seed: int) -> Any:
        return deepseek_v3_model(spec, seed)

    def output(self, model: Any, batch: Any) -> Any:
        return model(inputs_embeds=batch.unsqueeze(0)).logits[0]


# -- helpers of the canonical views ----------------------------------------------------------------
def _views(name: str, p: Any, optimizer: Any, engine: bool,
           bf16: bool = False) -> Iterator[tuple[str, Any]]:
    """``(canonical name, tensor)``: the module parameter, its fp32 master and its moments.  The
    ground truth's parameter is the master; under ``bf16`` its module parameter is the master cast
    to bf16 (what ``DeepSpeedZeroOptimizer.step`` copies into the engine's bf16 partition)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    yield name, p.detach().bfloat16() if bf16 and not engine else p.detach()
    yield f"{name}.master", safe_get_full_fp32_param(p) if engine else p.detach()
    if optimizer is None:
        return
    for moment in ADAM_MOMENTS:
        if engine:
            yield f"{name}.{moment}", safe_get_full_optimizer_state(p, moment)
        elif moment in optimizer.state.get(p, {}):
            yield f"{name}.{moment}", optimizer.state[p][moment]


def _inner(optimizer: Any) -> Any:
    """The torch optimizer: ZeRO's wrapped one, or the ground truth's."""
    return getattr(optimizer, "optimizer", optimizer)


def _groups(optimizer: Any) -> dict[str, dict[str, Any]]:
    """The dense and the expert param group of the torch optimizer, by kind."""
    if optimizer is None:
        return {}
    return {("expert" if group.get("moe") else "dense"): group
            for group in _inner(optimizer).param_groups}


def _steps(optimizer: Any) -> dict[str, Any]:
    """Each param group's AdamW step count (a tensor), by kind."""
    out: dict[str, Any] = {}
    inner = _inner(optimizer)
    for kind, group in _groups(optimizer).items():
        state = inner.state.get(group["params"][0], {})
        if "step" in state:
            out[kind] = state["step"]
    return out


def _buffers(model: Any) -> Iterator[tuple[int | None, str, Any]]:
    """``(layer, name within the layer, buffer)`` for every persistent floating-point buffer (an
    expert bias: whole on every rank, never in ZeRO's partitions), named as ``dense_params`` names
    parameters; outside the layers by its full name."""
    from conformance.adapters.torch_native import persistent_buffers

    for fqn, buffer in persistent_buffers(_module(model)):
        if buffer.is_floating_point():
            match = IN_LAYER.match(fqn)
            yield (int(match.group(1)), match.group(2), buffer) if match else (None, fqn, buffer)
