# stage_adapter.py -- pytest --moe-ep-matrix --moe-ep-adapter=stage_adapter:Adapter
"""The adapter of tests/stage_trainer.py, written from docs/adapters.md on the torch-native base:
where its experts live, its model, its per-stage optimizer container, its LR scheduler (training
state the save is handed) and its own save and load.  The base finds the AdamW inside the
container's ``optimizers`` and reads the rest."""

from __future__ import annotations

from conformance.adapter import Capabilities
from conformance.adapters.torch_native import Param, TorchNativeAdapter


class Adapter(TorchNativeAdapter):
    name = "stage-trainer"
    version = "0.1"
    capabilities = Capabilities(kinds=("packed",), optimizer=True, fsdp=True, hsdp=True,
                                uneven=True, max_ep=8, format="dcp",
                                ep_orders=("strided", "consecutive"))
    #: the trainer's defect of the negative control: experts' moments misfiled at ep > 1
    misfile = False
    #: the trainer without its reported defect: the scheduler it is handed is saved
    keep_scheduler = False

    def build_model(self, spec, mesh):
        import stage_trainer as trainer

        model = trainer.Model(spec.num_layers, spec.dim, spec.hidden, spec.num_experts)
        if mesh is not None:  # mesh=None: the unsharded ep=1 ground truth
            trainer.parallelize(model, mesh, fsdp=spec.fsdp)
        return model

    def build_optimizer(self, spec, model):
        import stage_trainer as trainer

        return trainer.Stages(model, lr=spec.lr)

    def build_state(self, spec, model, optimizer):
        import stage_trainer as trainer

        return {"lr_scheduler": trainer.schedule(optimizer)}

    def identify(self, model, fqn, param):  # layers.0.experts.w_in, layers.0.shared.w1.weight
        _, layer, name = fqn.split(".", 2)
        if name.startswith("experts."):
            return Param(int(layer), name, experts="packed", num_experts=model.num_experts)
        return Param(int(layer), name)

    def save(self, model, optimizer, path, state=None):
        import stage_trainer as trainer

        trainer.save(path, model, optimizer, (state or {}).get("lr_scheduler"),
                     misfile=self.misfile, keep_scheduler=self.keep_scheduler)

    def load(self, model, optimizer, path, state=None):
        import stage_trainer as trainer

        trainer.load(path, model, optimizer, (state or {}).get("lr_scheduler"),
                     keep_scheduler=self.keep_scheduler)


class Misfiled(Adapter):
    """The same trainer saving each rank's experts' ``exp_avg`` rows in reverse order at ep > 1."""

    name = "stage-trainer-misfiled"
    misfile = True


class Correct(Adapter):
    """The same trainer saving the scheduler it is handed: every cell green."""

    name = "stage-trainer-correct"
    keep_scheduler = True
