"""The ``nemo_automodel`` adapter's fine-tuning cells: NeMo Automodel 0.7.0's own LoRA on experts.

NeMo's own PEFT application, ``apply_lora_to_linear_modules`` (``components/_peft/lora.py``), with
rank ``spec.lora_rank`` and alpha ``spec.lora_alpha``, turns every routed ``GroupedExperts`` into a
``GroupedExpertsLoRA`` (``_peft/lora_experts.py``: packed ``lora_gate_and_up_A`` ``[E, dim, r]``,
``lora_gate_and_up_B`` ``[E, r, 2 * hidden]``, ``lora_down_A`` ``[E, hidden, r]``, ``lora_down_B``
``[E, r, dim]``, one A shared by gate and up) and each shared-expert linear into a ``LinearLoRA``
(``lora_A.weight`` ``[r, in]``, ``lora_B.weight`` ``[out, r]``), and freezes everything else.

PEFT starts B at zero, which would make every misfiled adapter read as right; so after NeMo's
application every adapter gets values from the cell's seed, by global expert id (the routed ones) or
by name (the shared expert's), on the whole unsplit model: every rank holding expert ``g`` holds the
same adapter whatever the layout.

Which adapters, which order: see :func:`apply_lora`.  ``lora+mxfp4`` and ``lora+fp8`` are not
declared: docs/frameworks/nemo_automodel.md, "LoRA experts".
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from conformance.adapter import Spec

#: the modules NeMo's matcher puts LoRA on: the routed experts (a ``GroupedExperts`` is matched by
#: name) and the shared expert's three linears -- not the router's ``Gate``, which holds its weight
#: as a bare Parameter and is no linear.
TARGETS = ("*.mlp.experts", "*.mlp.shared_experts.*_proj")
#: each packed adapter's canonical views, as NeMo's DeepSeek-V3 state-dict adapter writes them per
#: expert (``_convert_lora_expert_to_hf``): PEFT's ``lora_A.weight`` ``[r, in]`` and
#: ``lora_B.weight`` ``[out, r]``, i.e. NeMo's ``[E, in, r]`` / ``[E, r, out]`` rows transposed, the
#: fused B cut into its ``gate`` and ``up`` halves.  The one A of gate and up is one view (NeMo
#: writes it under both the ``gate_proj`` and the ``up_proj`` key).
LORA_VIEWS = {"lora_gate_and_up_A": ("gate_up.lora_A",),
              "lora_gate_and_up_B": ("gate.lora_B", "up.lora_B"),
              "lora_down_A": ("down.lora_A",), "lora_down_B": ("down.lora_B",)}
#: the first words of the error triton >= 3.4 raises at NeMo's ``_peft/lora_kernel.py:491``.
_TRITON_KEY_ERROR = "key contains names that are not kernel arguments"


@functools.cache
def peft_lora() -> Any:
    """NeMo's ``nemo_automodel.components._peft.lora``, imported with triton hidden if it has to be.

    Workaround (changes nothing that is checked): the module imports ``_peft/lora_kernel.py``, whose
    ``lora_db_kernel`` is decorated ``@triton.autotune(key=["S", "M", "K"])`` (line 491) with no
    argument ``S``; the triton this environment has (3.9.0, which ci/install_torchtitan.sh
    installs) rejects that key when the module is imported, so NeMo's whole LoRA module cannot be
    imported.  Without triton NeMo replaces it by a stub (``HAVE_TRITON = False``); the kernels are
    only for ``use_triton=True`` (CUDA), which these cells do not use.  The normal import is tried
    first, so an environment without the bug imports NeMo as it is.
    """
    name = "nemo_automodel.components._peft.lora"
    try:
        return importlib.import_module(name)
    except ValueError as exc:
        if _TRITON_KEY_ERROR not in str(exc):
            raise
    held = sys.modules.get("triton")
    sys.modules["triton"] = None  # type: ignore[assignment]  # import triton -> ImportError
    try:
        return importlib.import_module(name)
    finally:
        if held is None:
            del sys.modules["triton"]
        else:
            sys.modules["triton"] = held


def apply_lora(model: Any, spec: Spec) -> int:
    """NeMo's own LoRA on ``model`` (the whole ep=1 model, before any split); returns the number of
    modules NeMo patched.

    Order: PEFT first, then EP and FSDP -- NeMo's.  ``apply_model_infrastructure``
    (``_transformers/infrastructure.py``) calls ``_apply_peft_and_lower_precision`` (which calls
    ``apply_lora_to_linear_modules``) before ``_shard_ep_fsdp`` parallelizes, and the MoE
    parallelizer says so ("PEFT is applied before distributed sharding", ``moe/parallelizer.py``):
    ``GroupedExpertsLoRA`` makes its adapters ``[n_routed_experts, ...]`` from the config, so they
    must exist before ``ExpertParallel`` shards every parameter of the experts module on dim 0.

    Freezing: ``skip_freeze=False`` is NeMo's own freeze (every parameter, before the adapters are
    made); the recipe's later trainability rule (``_apply_trainability_policy``: trainable iff
    ``"lora_"`` in the name) selects the same parameters, which the build checks.  No MXFP4 storage
    (``expert_weight_format="unquantized"``), no triton kernels (``use_triton=False``, NeMo's
    default).
    """
    lora = peft_lora()
    config = lora.PeftConfig(target_modules=list(TARGETS), dim=spec.lora_rank,
                             alpha=spec.lora_alpha)
    patched = int(lora.apply_lora_to_linear_modules(model, config))
    wrong = [name for name, p in model.named_parameters()
             if p.requires_grad != ("lora_" in name)]
    if wrong:
        raise RuntimeError(f"NeMo's LoRA left these parameters' trainability other than its "
                           f"recipe's rule (trainable iff 'lora_' in the name): {wrong}")
    return patched
