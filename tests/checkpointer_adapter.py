# checkpointer_adapter.py -- pytest --moe-ep-matrix --moe-ep-adapter=checkpointer_adapter:Adapter
"""The adapter of tests/checkpointer_trainer.py, written from docs/adapters.md on the torch-native
base: where its experts live, its model, its optimizer container and its training state, its own
checkpointer.  Nothing else: the base steps the container, finds its AdamW among its attributes and
reads the rest."""

from __future__ import annotations

import re

from conformance.adapter import Capabilities
from conformance.adapters.torch_native import Param, TorchNativeAdapter

EXPERT = re.compile(r"experts\.(?:(?P<expert>\d+)\.)?(?P<name>w_in|w_out)")


class Adapter(TorchNativeAdapter):
    name = "checkpointer-trainer"
    version = "0.1"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, hsdp=True,
                                uneven=True, max_ep=8, format="dcp",
                                ep_orders=("strided", "consecutive"))

    def build_model(self, spec, mesh):
        import checkpointer_trainer as trainer

        model = trainer.Model(spec.num_layers, spec.dim, spec.hidden, spec.num_experts,
                              packed=spec.kind == "packed")
        if mesh is not None:  # mesh=None: the unsharded ep=1 ground truth
            trainer.parallelize(model, mesh, fsdp=spec.fsdp)
        return model

    def build_optimizer(self, spec, model):
        import checkpointer_trainer as trainer

        return trainer.Optimizer(model, lr=spec.lr)

    def build_state(self, spec, model, optimizer):
        return {"schedule": optimizer.schedule, "progress": optimizer.progress}

    def identify(self, model, fqn, param):  # layers.0.experts.w_in, layers.0.experts.3.w_in, ...
        _, layer, name = fqn.split(".", 2)
        found = EXPERT.fullmatch(name)
        if found and found["expert"] is not None:
            return Param(int(layer), f"experts.{found['name']}", experts="one",
                         expert=int(found["expert"]))
        if found:
            return Param(int(layer), name, experts="packed", num_experts=model.num_experts)
        return Param(int(layer), name)

    def save(self, model, optimizer, path, state=None):  # path: the run's checkpoint root
        import checkpointer_trainer as trainer

        trainer.Checkpointer(path).save(model, optimizer)

    def load(self, model, optimizer, path, state=None):
        import checkpointer_trainer as trainer

        trainer.Checkpointer(path).load(model, optimizer)


class Unpacked(Adapter):
    """The same trainer with one module per expert: each rank's optimizer numbers only its own
    experts, so the positional ids of ``Optimizer.state_dict()`` move with EP."""

    name = "checkpointer-trainer-unpacked"
    capabilities = Capabilities(kinds=("unpacked",), optimizer=True, fsdp=True, hsdp=True,
                                uneven=True, max_ep=8, format="dcp",
                                ep_orders=("strided", "consecutive"))
