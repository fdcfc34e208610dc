"""The reference MoE and its expert-parallel split under their original module name.

The model is :mod:`reference_impl.model` (its router :mod:`reference_impl.router`), its
parallelization (EP/ETP split, FSDP, pipeline stages) :mod:`reference_impl.parallelize`; adapters
and tests written against ``reference_impl.moe`` keep importing the same names from here.
"""

from __future__ import annotations

from reference_impl.model import (
    FUSED_ORDERS,
    FUSED_WEIGHT,
    PACKED_WEIGHTS,
    WRAPPER_PARTS,
    ExpertMLP,
    MoEBlock,
    MoEConfig,
    MoEMLP,
    MoEModel,
    MTPLayer,
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
    pipeline_outputs,
)
from reference_impl.router import Router, update_expert_bias

__all__ = [
    "FUSED_ORDERS",
    "FUSED_WEIGHT",
    "HIDDEN_AXIS",
    "PACKED_WEIGHTS",
    "WRAPPER_PARTS",
    "ExpertMLP",
    "MTPLayer",
    "MoEBlock",
    "MoEConfig",
    "MoEMLP",
    "MoEModel",
    "Router",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_pipeline",
    "build_model",
    "moe_layers",
    "named_modules",
    "named_parameters",
    "pipeline_forward",
    "pipeline_outputs",
    "stable_seed",
    "update_expert_bias",
]
