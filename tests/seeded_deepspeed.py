"""Seeded bugs on DeepSpeed's own checkpoint and forward: the negative controls of ``checkpoint``
and ``forward``.

:class:`SeededDeepSpeed` drives DeepSpeed's native MoE for unpacked cells and AutoEP for packed ones
(one pytester session, one fork server, for both adapters), each with two bugs planted where
DeepSpeed would have them:

* at ep=2, after ``engine.save_checkpoint``, layer 0's file of global expert 0 is overwritten with
  expert 1's (keys renamed to expert 0's): the load gives expert 0 expert 1's weights, and the
  ``checkpoint`` check must name the key against the ep=1 save;
* at ep=4, after ``engine.load_checkpoint``, rows 0 and 1 of layer 0's router are swapped while the
  forward runs (``seeded_forward``'s pattern): tokens go to each other's experts while the stored
  tensors stay right, so only the ``forward`` check can see it -- through the MoE layers' own
  outputs (the adapters' named form), since the residual stream's rounding hides the swap in the
  model's output.
"""

from __future__ import annotations

import os
import re
from typing import Any

from seeded_forward import rows_swapped

from conformance.adapter import Capabilities
from conformance.adapters.deepspeed import DeepSpeedAdapter, _moe_layers
from conformance.adapters.deepspeed_autoep import DeepSpeedAutoEPAdapter
from conformance.adapters.deepspeed_autoep import _moe_layers as _autoep_layers

#: a global expert id 1 in a native (``deepspeed_experts.1.up.weight``) or AutoEP (``experts.w1.1``)
#: key.
_EXPERT_ONE = re.compile(r"(deepspeed_experts\.)1(\.)|(experts\.w[123]\.)1$")


def _overwrite_expert_file(path: str) -> None:
    """Layer 0's file of expert 0 gets expert 1's tensors under expert 0's keys (global rank 0,
    after the save)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest")) as fd:
            tag = os.path.join(path, fd.read().strip())
        one = torch.load(os.path.join(tag, "layer_0_expert_1_mp_rank_00_model_states.pt"),
                         weights_only=False)
        renamed = {_EXPERT_ONE.sub(lambda m: f"{m[1]}0{m[2]}" if m[1] else f"{m[3]}0", k): v
                   for k, v in one.items()}
        torch.save(renamed, os.path.join(tag, "layer_0_expert_0_mp_rank_00_model_states.pt"))
    dist.barrier()


_LOADED = "_seeded_loaded"


class SeededDeepSpeed:
    name = "seeded-deepspeed"
    capabilities = Capabilities(kinds=("packed", "unpacked"), optimizer=True, fsdp=False,
                                uneven=False, max_ep=64,
                                format="deepspeed", ep_orders=("consecutive",))
    preload = DeepSpeedAdapter.preload + DeepSpeedAutoEPAdapter.preload

    def __init__(self) -> None:
        self.native, self.autoep = DeepSpeedAdapter(), DeepSpeedAutoEPAdapter()

    @property
    def version(self) -> str:
        return self.native.version

    def _of(self, model: Any) -> Any:
        return self.autoep if hasattr(getattr(model, "module", model), "model") else self.native

    def build(self, spec: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
        return (self.autoep if spec.kind == "packed" else self.native).build(spec, mesh, seed)

    def save(self, model: Any, optimizer: Any, path: str) -> None:
        adapter = self._of(model)
        adapter.save(model, optimizer, path)
        if self._ep(model) == 2:
            _overwrite_expert_file(path)

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        adapter = self._of(model)
        adapter.load(model, optimizer, path)
        if self._ep(model) == 4:
            object.__setattr__(model, _LOADED, True)

    def _ep(self, model: Any) -> int:
        return (_moe_layers(model) if self._of(model) is self.native
                else _autoep_layers(model))[0].ep_size

    def forward(self, model: Any, batch: Any) -> Any:
        adapter = self._of(model)
        if not getattr(model, _LOADED, False):
            return adapter.forward(model, batch)
        moe = _moe_layers(model)[0] if adapter is self.native else _autoep_layers(model)[0]
        with rows_swapped([moe.deepspeed_moe.gate.wg.weight if adapter is self.native
                           else moe.router.gate.weight]):
            return adapter.forward(model, batch)

    def read_checkpoint(self, path: str) -> dict[str, Any]:
        # ZeRO >= 1 writes it; native ZeRO-0 does not
        autoep = os.path.exists(os.path.join(path, "zero_to_fp32.py"))
        return (self.autoep if autoep else self.native).read_checkpoint(path)

    @property
    def ep_dependent_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.native.ep_dependent_keys + self.autoep.ep_dependent_keys))

    def expert_tensors(self, model: Any, optimizer: Any) -> Any:
        return self._of(model).expert_tensors(model, optimizer)

    def other_tensors(self, model: Any, optimizer: Any) -> Any:
        return self._of(model).other_tensors(model, optimizer)
