"""Which checkpoint keys hold experts, and which layer and global expert each one is.

A key is classified by documented regular expressions, never by the substring "expert" alone:

* **per-expert** keys carry the global expert id in the name -- a pattern with a named group
  ``expert``: ``layers.0.moe.experts.3.up.weight`` (reference unpacked), ``model.layers.0.mlp.
  experts.3.gate_proj.weight`` (Hugging Face), ``mlp.experts.local_experts.3.linear_fc1.weight``
  (Megatron SequentialMLP), ``mlp.experts.linear_fc1.weight3`` (Megatron TEGroupedMLP);
* **packed** keys hold all of a layer's experts with the expert axis first -- a pattern without
  that group: the reference's ``layers.N.moe.up_w``/``gate_w``/``down_w``, torchtitan's
  ``moe.experts.w1/w2/w3``, NeMo Automodel's ``experts.gate_and_up_projs``/``down_projs``,
  DeepSpeed AutoEP's and Hugging Face's ``experts.gate_up_proj``/``down_proj``, Megatron's
  distributed ``experts.experts.linear_fc1.weight``, and any parameter directly in an ``experts``
  module;
* **optimizer state** ``optimizer.state.<param>.<stat>`` (also ``optim.``, ``optimizers.``) is
  classified as its parameter ``<param>`` is, and mapped back to it;
* a **router** (``moe.router.weight``, ``mlp.gate.weight``, ``moe.router.gate.weight``, ...)
  marks an MoE layer and its rows give the number of experts;
* ``shared_expert(s)`` are dense FFNs, never an expert axis.

The layer index comes from ``layers.N`` (also ``layer.N``, ``blocks.N``, ``h.N``).  User patterns
(``--expert-key``) are tried first.  Matching is done once per key *template* (each all-digit
dotted component replaced), so 150,000 keys cost a few hundred regex searches; a pattern must
therefore not single out particular layer or expert numbers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_PATTERNS", "KeyInfo", "KeyPattern", "classify_keys", "pattern"]


@dataclass(frozen=True)
class KeyPattern:
    """``regex`` is searched in the parameter name; ``kind`` is "per_expert" when it has a named
    group ``expert`` (the global id), else "packed" (expert axis first); ``source`` says whose
    naming it is."""

    regex: re.Pattern[str]
    kind: str
    source: str = "user"


def pattern(regex: str, source: str = "user") -> KeyPattern:
    """A :class:`KeyPattern` from a regex string; ValueError names a regex that does not compile."""
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise ValueError(f"expert key pattern {regex!r} is not a valid regular expression: {exc}") from None
    return KeyPattern(compiled, "per_expert" if "expert" in compiled.groupindex else "packed", source)


DEFAULT_PATTERNS: tuple[KeyPattern, ...] = (
    pattern(r"(?:^|\.)(?:local_)?experts\.(?P<expert>\d+)\.", "reference unpacked, Hugging Face, Megatron"),
    pattern(r"(?:^|\.)experts\.linear_fc[12]\.(?:weight|bias)(?P<expert>\d+)$", "Megatron TEGroupedMLP"),
    pattern(r"(?:^|\.)moe\.(?:gate|up|down)_w$", "reference packed"),
    pattern(r"(?:^|\.)experts\.w[123]$", "torchtitan"),
    pattern(r"(?:^|\.)experts\.(?:gate_and_up_projs|down_projs)$", "NeMo Automodel"),
    pattern(r"(?:^|\.)experts\.(?:gate_up_proj|down_proj)(?:_bias)?$", "DeepSpeed AutoEP, Hugging Face"),
    pattern(r"(?:^|\.)experts\.experts\.linear_fc[12]\.(?:weight|bias)$", "Megatron distributed"),
    pattern(r"(?:^|\.)experts\.[A-Za-z_]\w*$", "a parameter of an 'experts' module"),
)
SHARED = re.compile(r"(?:^|\.)shared_?experts?(?:\.|$)", re.IGNORECASE)
ROUTER = re.compile(r"(?:^|\.)(?:moe|mlp|block_sparse_moe|feed_forward)\.(?:router(?:\.gate)?|gate)\.weight$")
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(?P<layer>\d+)(?:\.|$)")
OPTIMIZER = re.compile(r"^(?:optimizer|optim|optimizers)(?:\.\d+)?\.state\.(?P<param>.+)\.(?P<stat>[A-Za-z_]\w*)$")
#: an all-digit dotted component: ``layers.12.`` -> ``layers.#.``
_NUMBER = re.compile(r"(?:^|(?<=\.))\d+(?=\.|$)")


@dataclass(frozen=True)
class KeyInfo:
    """What one key is.  ``role``: "expert", "router" or "dense".  For expert keys ``family`` is the
    key with the expert id replaced by ``*`` (a packed key is its own family) and ``cls`` the
    family with the layer number replaced by ``#`` too (the same tensor in every layer)."""

    key: str
    role: str
    kind: str | None = None  # "per_expert" | "packed"
    layer: int | None = None
    expert: int | None = None
    family: str = ""
    cls: str = ""
    param: str = ""  # the parameter's name: the key itself, or the optimizer state's parameter
    stat: str | None = None  # optimizer state name (exp_avg, step, ...); None for the weight itself


@dataclass(frozen=True)
class _Recipe:
    """How to read a key of one template: positions index the key's all-digit components."""

    role: str
    kind: str | None
    optimizer: bool
    expert_pos: int | None
    expert_fixed: int | None
    layer_pos: int | None
    layer_fixed: int | None
    #: the family template: a literal prefix/suffix around the expert id, for "fixed" ids.
    fixed_span: tuple[int, int] | None


def _span_index(spans: list[tuple[int, int]], span: tuple[int, int]) -> int | None:
    return spans.index(span) if span in spans else None


def _recipe(key: str, patterns: Sequence[KeyPattern]) -> _Recipe:
    spans = [m.span() for m in _NUMBER.finditer(key)]
    opt = OPTIMIZER.match(key)
    start = opt.start("param") if opt else 0
    param = opt["param"] if opt else key
    role, kind, expert_span = "dense", None, None
    if not SHARED.search(param):
        for p in patterns:
            m = p.regex.search(param)
            if m:
                role, kind = "expert", p.kind
                if p.kind == "per_expert":
                    expert_span = (m.start("expert") + start, m.end("expert") + start)
                break
        else:
            if not opt and ROUTER.search(param):
                role = "router"
    layer = LAYER.search(param)
    layer_span = (layer.start("layer") + start, layer.end("layer") + start) if layer else None
    e_pos = _span_index(spans, expert_span) if expert_span else None
    l_pos = _span_index(spans, layer_span) if layer_span else None
    return _Recipe(role, kind, opt is not None, e_pos,
                   int(key[slice(*expert_span)]) if expert_span and e_pos is None else None,
                   l_pos, int(key[slice(*layer_span)]) if layer_span and l_pos is None else None,
                   expert_span if expert_span and e_pos is None else None)


def classify_keys(keys: Iterable[str], patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS) -> dict[str, KeyInfo]:
    """:class:`KeyInfo` of every key, matching the patterns once per key template."""
    recipes: dict[str, _Recipe] = {}
    out: dict[str, KeyInfo] = {}
    sub, findall = _NUMBER.sub, _NUMBER.findall
    for key in keys:
        template = sub("#", key)
        r = recipes.get(template)
        if r is None:
            r = recipes[template] = _recipe(key, patterns)
        nums = findall(key) if r.layer_pos is not None or r.role == "expert" else ()
        layer = int(nums[r.layer_pos]) if r.layer_pos is not None else r.layer_fixed
        if r.role == "dense" and not r.optimizer:
            out[key] = KeyInfo(key, "dense", layer=layer, param=key)
            continue
        param, stat = key, None
        if r.optimizer:
            param, _, stat = key.partition(".state.")[2].rpartition(".")
        if r.role != "expert":
            out[key] = KeyInfo(key, r.role, layer=layer, param=param, stat=stat)
            continue
        if r.expert_pos is not None:
            expert = int(nums[r.expert_pos])
            parts = template.split("#")
            fam_nums = [*nums[:r.expert_pos], "*", *nums[r.expert_pos + 1:]]
        else:
            expert = r.expert_fixed if r.kind == "per_expert" else None
            parts = template.split("#")
            fam_nums = list(nums)
        family = parts[0] + "".join(n + p for n, p in zip(fam_nums, parts[1:], strict=True))
        if r.fixed_span is not None:  # the id is inside a component: "weight3" -> "weight*"
            a, b = r.fixed_span
            family = key[:a] + "*" + key[b:]
        cls_nums = ["#" if i == r.layer_pos else n for i, n in enumerate(fam_nums)]
        cls = parts[0] + "".join(n + p for n, p in zip(cls_nums, parts[1:], strict=True))
        if r.fixed_span is not None:
            cls = _replace_component(family, r.layer_pos) if r.layer_pos is not None else family
        out[key] = KeyInfo(key, "expert", r.kind, layer, expert, family, cls, param, stat)
    return out


def _replace_component(key: str, pos: int) -> str:
    """``key`` with its ``pos``-th all-digit component replaced by ``#``."""
    spans = [m.span() for m in _NUMBER.finditer(key)]
    a, b = spans[pos]
    return key[:a] + "#" + key[b:]
