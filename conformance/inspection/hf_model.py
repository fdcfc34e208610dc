"""A Hugging Face export on disk against the transformers model class it is for: keys and shapes.

``moe-ep-inspect DIR --hf-model CLASS`` reads the export's index and headers (no value) and the
keys and shapes the class has, built on the meta device from the export's ``config.json`` (or a
config given as JSON, for a framework that writes none): a missing expert, an unexpected key, a
transposed or locally sized expert tensor is named before anyone loads the export.

transformers 5 names a class's expert weights two ways: its modules' own (``mlp.experts.
gate_up_proj`` ``[E, 2h, dim]``) and the hub's, per expert (``mlp.experts.3.gate_proj.weight``),
which its loader converts.  An export may hold either; it is compared with the form it shares more
keys with, and keys the class itself ignores on load (``_keys_to_ignore_on_load_unexpected``: a
DeepSeek-V3 multi-token-prediction layer) are not unexpected.  transformers is imported only here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conformance.inspection.model import CheckpointError, CheckpointIndex, CheckpointProblem

__all__ = ["hf_model_problems", "hf_model_shapes"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _config(directory: str, given: str | None) -> Any:
    """The class's config: ``given`` (a JSON file of its fields, ``model_type`` among them), else
    the export's ``config.json``."""
    import transformers

    if given is None:
        if not (Path(directory) / "config.json").exists():
            raise CheckpointError(directory, "holds no config.json", "a config.json beside the "
                                  "export, or --hf-config FILE (the config's fields as JSON)")
        return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    try:
        fields = json.loads(Path(given).read_text())
        model_type = fields.pop("model_type")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(given, f"is not a config ({type(exc).__name__}: {exc})",
                              "a JSON object of the config's fields with its model_type") from None
    return transformers.AutoConfig.for_model(model_type, **fields)


def hf_model_shapes(cls_name: str, config: Any) -> tuple[dict[str, tuple[int, ...]],
                                                          dict[str, tuple[int, ...]],
                                                          tuple[str, ...]]:
    """``(module form, hub form, ignored patterns)`` of transformers' ``cls_name`` at ``config``:
    each key's shape, built on the meta device (no memory, no values)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no model class "
                         f"{cls_name!r}")
    expected = getattr(getattr(cls, "config_class", None), "model_type", None)
    if expected and getattr(config, "model_type", None) != expected:
        raise ValueError(f"the config is model_type {config.model_type!r}; {cls_name} takes "
                         f"{expected!r}")
    with torch.device("meta"):
        model = cls(config)
    own = model.state_dict()
    hub = revert_weight_conversion(model, dict(own))
    ignored = tuple(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ())
    return ({k: tuple(v.shape) for k, v in own.items()},
            {k: tuple(v.shape) for k, v in hub.items()}, ignored)


def hf_model_problems(index: CheckpointIndex, cls_name: str, directory: str,
                      config_file: str | None = None,
                      extra_keys: tuple[str, ...] = ()) -> list[CheckpointProblem]:
    """Where the export in ``index`` is not what ``cls_name`` loads: missing, unexpected and
    misshapen keys (``extra_keys``: regexes of keys the family carries beyond the class)."""
    own, hub, ignored = hf_model_shapes(cls_name, _config(directory, config_file))
    held = {k: e.shape for k, e in index.entries.items() if e.is_tensor}
    (form, name), (other, _) = sorted(
        ((own, "its modules' names"), (hub, "the hub's per-expert names")),
        key=lambda f: -len(held.keys() & f[0].keys()))
    skip = [re.compile(p) for p in (*ignored, *extra_keys)]
    return _differences(held, form, other, name, cls_name, skip)


def _layer_and_leaf(key: str) -> tuple[str | None, str]:
    """A key's layer and what it is within the layer: ``experts`` for any expert weight, else its
    last name that is not ``weight``."""
    layer = _LAYER.search(key)
    parts = [p for p in key.split(".") if p != "weight" and not p.isdigit()]
    return (layer[1] if layer else None), ("experts" if "experts" in parts else parts[-1])


def _problem(problem: str, key: str, message: str) -> CheckpointProblem:
    """A problem named by the layer and expert its key holds, where it holds one."""
    layer, expert = _LAYER.search(key), _EXPERT.search(key)
    return CheckpointProblem(problem, key, message, layer=int(layer[1]) if layer else None,
                             experts=(int(expert[1]),) if expert else ())


def _differences(held: Mapping[str, Any], form: Mapping[str, tuple[int, ...]],
                 other: Mapping[str, tuple[int, ...]], name: str, cls_name: str,
                 skip: list[re.Pattern[str]]) -> list[CheckpointProblem]:
    """Against ``form`` (the naming the export shares most keys with), a key held in the other
    naming standing in for its counterpart (the loader converts each key on its own: a fused
    export may carry its bias under the hub's name)."""
    found = []
    stand_ins = {_layer_and_leaf(k) for k in held.keys() & other.keys() - form.keys()}
    for key in sorted(form.keys() - held.keys()):
        if _layer_and_leaf(key) not in stand_ins:
            found.append(_problem("hf_missing", key, f"{cls_name} has this key ({name}, shape "
                                  f"{list(form[key])}); the export does not"))
    for key in sorted(held.keys() - form.keys() - other.keys()):
        if not any(p.search(key) for p in skip):
            found.append(_problem("hf_unexpected", key, f"{cls_name} has no such key in either "
                                  "naming and does not ignore it"))
    for key in sorted(held.keys() & (form.keys() | other.keys())):
        want = form.get(key, other.get(key))
        if tuple(held[key]) != want:
            found.append(_problem("hf_shape", key, f"shape {list(held[key])} in the export, "
                                  f"{list(want or ())} in {cls_name}"))
    return found
