"""Built-in adapters: one registry of the names ``--moe-ep-adapter`` and ``--moe-ep-functions``
accept.

A name may offer a checkpoint adapter (``module:attr``, checked by the matrix), a functions module
(the nine expert-slice helpers, checked by the functions suite), or both.  Framework modules are
imported only when their adapter is used.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTINS", "Builtin", "builtin_name", "checkpoint_builtins", "functions_builtins",
           "installed", "name_key"]


@dataclass(frozen=True)
class Builtin:
    #: ``module:attr`` of the checkpoint adapter, if the name offers one.
    checkpoint: str | None = None
    #: the module exposing the nine expert-slice functions, if the name offers one.
    functions: str | None = None
    #: a module whose presence means the framework is installed (None: always; ci/conformance.sh
    #: asks).
    requires: str | None = None


BUILTINS: dict[str, Builtin] = {
    "reference": Builtin("conformance.adapters.reference:ReferenceAdapter",
                         "reference_impl.state_dict_utils"),
    "reference-per-expert": Builtin("conformance.adapters.reference:ReferencePerExpertAdapter"),
    "legacy": Builtin("conformance.adapters.legacy:LegacyAdapter"),
    "balanced": Builtin(functions="conformance.adapters.balanced_functions"),
    "nemo_automodel": Builtin("conformance.adapters.nemo_automodel:NemoAutomodelAdapter",
                              "nemo_automodel.components.moe.state_dict_utils", "nemo_automodel"),
    "torchtitan": Builtin("conformance.adapters.torchtitan:TorchtitanAdapter",
                          requires="torchtitan"),
    "torchtitan-local": Builtin("conformance.adapters.torchtitan:TorchtitanLocalAdapter",
                                requires="torchtitan"),
    "torchtitan-deepseek": Builtin(
        "conformance.adapters.torchtitan_deepseek:TorchtitanDeepSeekAdapter",
        requires="torchtitan"),
    "deepspeed": Builtin("conformance.adapters.deepspeed:DeepSpeedAdapter", requires="deepspeed"),
    "deepspeed-autoep": Builtin("conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPAdapter",
                                requires="deepspeed"),
    "deepspeed-autoep-zero2": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPZero2Adapter", requires="deepspeed"),
    "deepspeed-autoep-bf16": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPBf16Adapter", requires="deepspeed"),
    "deepspeed-autoep-zero2-bf16": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPZero2Bf16Adapter",
        requires="deepspeed"),
    "deepspeed-autoep-bf16-fp32accum": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPBf16Fp32AccumAdapter",
        requires="deepspeed"),
    "megatron": Builtin("conformance.adapters.megatron:MegatronAdapter", requires="megatron.core"),
    "megatron-distopt": Builtin("conformance.adapters.megatron_distopt:MegatronDistOptAdapter",
                                requires="megatron.core"),
    "megatron-distopt-fully_reshardable": Builtin(
        "conformance.adapters.megatron_distopt:MegatronDistOptFullyReshardableAdapter",
        requires="megatron.core"),
    "megatron-distopt-fully_sharded_model_space": Builtin(
        "conformance.adapters.megatron_distopt:MegatronDistOptFullyShardedModelSpaceAdapter",
        requires="megatron.core"),
    "megatron-distopt-dp_zero_gather_scatter": Builtin(
        "conformance.adapters.megatron_distopt:MegatronDistOptDpZeroAdapter",
        requires="megatron.core"),
    "transformers": Builtin("conformance.adapters.transformers_ep:TransformersAdapter",
                            requires="transformers.distributed.expert_parallel"),
    "transformers-deepseek_v3": Builtin(
        "conformance.adapters.transformers_deepseek:TransformersDeepseekV3Adapter",
        requires="transformers.distributed.expert_parallel"),
    "olmo_core": Builtin("conformance.adapters.olmo_core:OlmoCoreAdapter", requires="olmo_core"),
    "olmo_core-dropless": Builtin("conformance.adapters.olmo_core:OlmoCoreDroplessAdapter",
                                  requires="olmo_core"),
    "deepspeed-autoep-noconvert": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPNoConversionAdapter",
        requires="deepspeed"),
    "deepspeed-autoep-deepseek_v3": Builtin(
        "conformance.adapters.deepspeed_autoep:DeepSpeedAutoEPDeepseekV3Adapter",
        requires="deepspeed"),
}


def name_key(name: str) -> str:
    """An adapter name as names compare: as pip compares package names, ``-`` and ``_`` alike, case
    ignored."""
    return name.replace("_", "-").lower()


def builtin_name(given: str) -> str:
    """The built-in name ``given`` means (``olmo-core`` is ``olmo_core``: :func:`name_key`);
    ``given`` itself when no built-in matches (a ``module:attr``, a dotted module)."""
    return next((name for name in BUILTINS if name_key(name) == name_key(given)), given)


def checkpoint_builtins() -> dict[str, str]:
    return {name: b.checkpoint for name, b in BUILTINS.items() if b.checkpoint}


def functions_builtins() -> dict[str, str]:
    return {name: b.functions for name, b in BUILTINS.items() if b.functions}


def installed(name: str) -> bool:
    """Whether the framework of built-in ``name`` is importable here (its ``requires`` module is
    found)."""
    import importlib.util

    required = BUILTINS[name].requires
    if required is None:
        return True
    try:
        return importlib.util.find_spec(required) is not None
    except (ImportError, ValueError):
        return False


def main() -> None:
    """``python -m conformance.adapters``: one line per built-in whose framework is installed,
    ``NAME KIND`` (``checkpoint``, or ``functions`` for a framework's own), for ci/conformance.sh to
    walk."""
    for name, builtin in BUILTINS.items():
        if not installed(name):
            continue
        if builtin.checkpoint:
            print(name, "checkpoint")
        if builtin.functions and builtin.requires:  # a framework's own functions module
            print(name, "functions")
