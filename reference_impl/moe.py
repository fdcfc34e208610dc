"""The reference MoE and its expert-parallel split under their original module name.

The model is :mod:`reference_impl.model`, its parallelization (EP/ETP split, FSDP)
:mod:`reference_impl.parallelize`; adapters and tests written against ``reference_impl.moe`` keep
importing the same names from here.
"""

from __future__ import annotations

from reference_impl.model import (
    PACKED_WEIGHTS,
    WRAPPER_PARTS,
    ExpertMLP,
    MoEBlock,
    MoEConfig,
    MoEMLP,
    MoEModel,
    build_model,
    moe_layers,
    named_modules,
    named_parameters,
    stable_seed,
)
from reference_impl.parallelize import (
    HIDDEN_AXIS,
    apply_expert_parallel,
    apply_fsdp,
    apply_pipeline,
    pipeline_forward,
)

__all__ = [
    "HIDDEN_AXIS",
    "PACKED_WEIGHTS",
    "WRAPPER_PARTS",
    "ExpertMLP",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "MoEModel",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_pipeline",
    "build_model",
    "moe_layers",
    "named_modules",
    "named_parameters",
    "pipeline_forward",
    "stable_seed",
]
