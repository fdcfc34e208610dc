"""A seeded bug on NeMo Automodel: NeMo's own load, then each router's expert bias set to zero.

:class:`NemoExpertBiasZeroedAfterLoad` is the ``nemo_automodel`` adapter whose load leaves every
``mlp.gate.e_score_correction_bias`` zeroed (the held-out plant of the reference's
``seeded-buffers-zeroed-after-load``, here on NeMo's ``Gate`` and ``Checkpointer``): the negative
control that shows the bias is compared after a real NeMo load, not only carried.
"""

from __future__ import annotations

from typing import Any

from conformance.adapters.nemo_automodel import NemoAutomodelAdapter, _moe_layers


class NemoExpertBiasZeroedAfterLoad(NemoAutomodelAdapter):
    """NeMo's ``load_model`` / ``load_optimizer``, then every router's bias zeroed in place (a
    Replicate DTensor under FSDP2: each rank zeroes its whole copy)."""

    def load(self, model: Any, optimizer: Any, path: str) -> None:
        import torch

        super().load(model, optimizer, path)
        with torch.no_grad():
            for _, moe in _moe_layers(model):
                moe.gate.e_score_correction_bias.zero_()
