"""Built-in adapters: one registry of the names ``--moe-ep-adapter`` and ``--moe-ep-functions`` accept.

A name may offer a checkpoint adapter (``module:attr``, checked by the matrix), a functions module
(the nine expert-slice helpers, checked by the functions suite), or both.  Framework modules are
imported only when their adapter is used.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTINS", "Builtin", "checkpoint_builtins", "functions_builtins"]


@dataclass(frozen=True)
class Builtin:
    #: ``module:attr`` of the checkpoint adapter, if the name offers one.
    checkpoint: str | None = None
    #: the module exposing the nine expert-slice functions, if the name offers one.
    functions: str | None = None


BUILTINS: dict[str, Builtin] = {
    "reference": Builtin("conformance.adapters.reference:ReferenceAdapter", "reference_impl.state_dict_utils"),
    "legacy": Builtin("conformance.adapters.legacy:LegacyAdapter"),
    "balanced": Builtin(functions="conformance.adapters.balanced_functions"),
    "nemo_automodel": Builtin("conformance.adapters.nemo_automodel:NemoAutomodelAdapter",
                              "nemo_automodel.components.moe.state_dict_utils"),
    "torchtitan": Builtin("conformance.adapters.torchtitan:TorchtitanAdapter"),
    "torchtitan-local": Builtin("conformance.adapters.torchtitan:TorchtitanLocalAdapter"),
    "deepspeed": Builtin("conformance.adapters.deepspeed:DeepSpeedAdapter"),
    "deepspeed-autoep": Builtin("conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPAdapter"),
    "deepspeed-autoep-zero2": Builtin("conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPZero2Adapter"),
    "megatron": Builtin("conformance.adapters.megatron:MegatronAdapter"),
    "transformers": Builtin("conformance.adapters.transformers_ep:TransformersAdapter"),
    "olmo_core": Builtin("conformance.adapters.olmo_core:OlmoCoreAdapter"),
    "olmo_core-dropless": Builtin("conformance.adapters.olmo_core:OlmoCoreDroplessAdapter"),
    "deepspeed-autoep-noconvert": Builtin("conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPNoConversionAdapter"),
}


def checkpoint_builtins() -> dict[str, str]:
    return {name: b.checkpoint for name, b in BUILTINS.items() if b.checkpoint}


def functions_builtins() -> dict[str, str]:
    return {name: b.functions for name, b in BUILTINS.items() if b.functions}
