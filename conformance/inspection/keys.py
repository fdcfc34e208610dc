"""Which checkpoint keys hold experts, and which layer and global expert each one is.

A key is classified by documented regular expressions, never by the substring "expert" alone:

* **per-expert** keys carry the global expert id in the name -- a pattern with a named group
  ``expert``: ``layers.0.moe.experts.3.up.weight`` (reference, both kinds), ``model.layers.0.mlp.
  experts.3.gate_proj.weight`` (Hugging Face), ``mlp.experts.local_experts.3.linear_fc1.weight``
  (Megatron SequentialMLP), ``deepspeed_moe.experts.deepspeed_experts.3.weight`` (DeepSpeed),
  ``mlp.experts.linear_fc1.weight3`` (Megatron TEGroupedMLP);
* **packed** keys hold all of a layer's experts with the expert axis first -- a pattern without that
  group: the reference's raw ``layers.N.moe.up_w``/``gate_w``/``down_w`` (its ``save_legacy`` and
  checkpoints older than its per-expert form), torchtitan's ``moe.experts.w1/w2/w3``
  (``moe.routed_experts.inner_experts.w1_EFD`` in recent versions), NeMo Automodel's
  ``experts.gate_and_up_projs``/``down_projs``, DeepSpeed AutoEP's and Hugging Face's
  ``experts.gate_up_proj``/``down_proj``, Megatron's distributed
  ``experts.experts.linear_fc1.weight``, and any parameter directly in a module named ``experts`` or
  ``..._experts``;
* **optimizer state** ``optimizer.state.<param>.<stat>`` (also ``optim.``, ``optimizers.``), and
  Megatron's ``[chained_N.]optimizer.state.<stat>.<param>``, is classified as its parameter
  ``<param>`` is, and mapped back to it;
* a **router** (``moe.router.weight``, ``mlp.gate.weight``, ``moe.router.gate.weight``,
  ``deepspeed_moe.gate.wg.weight``, ...) marks an MoE layer and its rows give the number of experts;
* ``shared_expert(s)`` are dense FFNs, never an expert axis.

The layer index comes from ``layers.N`` (also ``layer.N``, ``blocks.N``, ``h.N``).  User patterns
(``--expert-key``) are tried first; a pattern may name the layer's digits too (a group ``layer``),
as the patterns learned from a checkpoint's content do (:mod:`conformance.inspection.learn`).
Matching is done once per key *template* (every digit replaced by ``#``), so 180,000 keys cost a few
hundred regex searches; a pattern must therefore not single out particular digits (``w[12]`` and
``w3`` share the template ``w#``), unless it names the template whose keys it reads digit by digit
(``KeyPattern.template``: a learned positional optimizer id, ``^1$``, reads template ``#``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from conformance.inspection.model import paused_gc

__all__ = ["DEFAULT_PATTERNS", "Evidence", "KeyInfo", "KeyPattern", "Placed", "classify_keys",
           "field_of", "pattern"]


@dataclass(frozen=True)
class KeyPattern:
    """``regex`` is searched in the parameter name; ``kind`` is "per_expert" when it has a named
    group ``expert`` (the global id), else "packed" (expert axis first) -- or "flattened", a key the
    content shows to hold experts flattened into one axis, which is then read as a plain tensor;
    ``source`` says whose naming it is."""

    regex: re.Pattern[str]
    kind: str
    source: str = "user"
    #: for a pattern that keeps some digits literal (a learned positional id: ``^1$``), the template
    #: (each digit run as one ``#``) of the parameter names it reads: keys of that template are
    #: then matched one by one, not once.
    template: str = ""


def pattern(regex: str, source: str = "user") -> KeyPattern:
    """A :class:`KeyPattern` from a regex string; ValueError names a regex that does not compile."""
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise ValueError(f"expert key pattern {regex!r} is not a valid regular expression: "
                         f"{exc}") from None
    return KeyPattern(compiled, "per_expert" if "expert" in compiled.groupindex else "packed",
                      source)


DEFAULT_PATTERNS: tuple[KeyPattern, ...] = (
    pattern(r"(?:^|\.)\w*experts\.(?P<expert>\d+)(?:\.|$)",
            "reference, Hugging Face, Megatron local_experts, DeepSpeed deepspeed_experts"),
    pattern(r"(?:^|\.)experts\.linear_fc[12]\.(?:weight|bias)(?P<expert>\d+)$",
            "Megatron TEGroupedMLP"),
    pattern(r"(?:^|\.)moe\.(?:gate|up|down)_w$", "reference packed"),
    pattern(r"(?:^|\.)(?:inner_)?experts\.w[123](?:_[A-Z]{3})?$",
            "torchtitan (experts.w1, inner_experts.w1_EFD)"),
    pattern(r"(?:^|\.)experts\.(?:gate_and_up_projs|down_projs)$", "NeMo Automodel"),
    pattern(r"(?:^|\.)experts\.(?:gate_up_proj|down_proj)(?:_bias)?$",
            "DeepSpeed AutoEP, Hugging Face"),
    pattern(r"(?:^|\.)experts\.experts\.linear_fc[12]\.(?:weight|bias)$", "Megatron distributed"),
    pattern(r"(?:^|\.)experts\.mlp\.w[123]$", "OLMo-core (experts.mlp.w1: E * rows flattened)"),
    pattern(r"(?:^|\.)\w*experts\.[A-Za-z_]\w*$", "a parameter of an '...experts' module"),
)
SHARED = re.compile(r"(?:^|\.)shared_?experts?(?:\.|$)", re.IGNORECASE)
ROUTER = re.compile(
    r"(?:^|\.)(?:\w*moe|mlp|feed_forward)\.(?:router(?:\.gate)?|gate(?:\.wg)?)\.weight$")
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|h)\.(?P<layer>\d+)(?:\.|$)")
OPTIMIZER = re.compile(
    r"^(?:optimizer|optim|optimizers)(?:\.\d+)?\.state\.(?P<param>.+)\.(?P<stat>[A-Za-z_]\w*)$")
#: Megatron-Core's dist-checkpointing form names the state first:
#: ``[chained_N.]optimizer.state.<stat>.<param>`` (its distributed optimizer's ``fully_reshardable``
#: format calls the fp32 main parameter ``param``).
STAT_FIRST = re.compile(
    r"^(?:chained_\d+\.)?optimizer\.state\.(?P<stat>exp_avg_sq|exp_avg|step|fp32_param|param|"
    r"momentum_buffer|max_exp_avg_sq)\.(?P<param>.+)$")


class Placed(NamedTuple):
    """What the ep=1 truth's content shows one key to hold: ``kind`` "per_expert" (``expert`` its
    global id) or "packed" (the expert axis first), of ``layer``; ``name`` the model's name of the
    tensor (``experts.w_in.exp_avg``), which is the same tensor in every layer where the key's own
    name numbers no layer (a positional optimizer id)."""

    kind: str
    layer: int | None
    expert: int | None = None
    name: str = ""


class Evidence(tuple[KeyPattern, ...]):
    """The patterns a model's checkpoints are read with, and what the ep=1 truth's content showed of
    its keys -- which decides before any pattern does.

    ``experts``: the truth's keys shown to hold experts (by their values, or, for optimizer state,
    through the live optimizer's parameter); ``dense``: its keys shown to hold no expert (a dense
    tensor's value, a dense parameter's state), which no name, digit run or row count makes an
    expert key.  A key the content could not place (a fused or transposed form) and a key the truth
    does not hold are read by the patterns, which then only name things.  A tuple of the patterns,
    so that it travels wherever patterns do (the comparison, the load's explanations) unchanged."""

    experts: Mapping[str, Placed]
    dense: frozenset[str]

    def __new__(cls, patterns: Iterable[KeyPattern], experts: Mapping[str, Placed] | None = None,
                dense: Iterable[str] = ()) -> Evidence:
        self = super().__new__(cls, patterns)
        self.experts = dict(experts or {})
        self.dense = frozenset(dense)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Evidence, (tuple(self), self.experts, self.dense))


def field_of(key: str) -> tuple[str, str]:
    """``(top-level name, last component)`` of a dotted key: what a non-tensor field keeps when a
    framework re-keys its state with EP (an optimizer's settings per group at ep=1, per parameter at
    ep>1; one LR scheduler at ep=1, a dict of them at ep>1).  The one rule the checkpoint comparison
    and the scalars check read re-keying by."""
    parts = key.split(".")
    return parts[0], parts[-1]


def optimizer_parts(key: str) -> tuple[int, str, str] | None:
    """``(where the parameter's name starts, the parameter, the state name)`` of an optimizer-state
    key."""
    found = STAT_FIRST.match(key) or OPTIMIZER.match(key)
    return (found.start("param"), found["param"], found["stat"]) if found else None


class KeyInfo(NamedTuple):
    """What one key is.  ``role``: "expert", "router" or "dense".  For expert keys ``family`` is the
    key with the expert id replaced by ``*`` (a packed key is its own family) and ``cls`` the
    family with the layer number replaced by ``#`` too (the same tensor in every layer).  A named
    tuple rather than a dataclass: 180,000 of them are made in a tenth of the time."""

    key: str
    role: str
    kind: str | None = None  # "per_expert" | "packed"
    layer: int | None = None
    expert: int | None = None
    family: str = ""
    cls: str = ""
    param: str = ""  # the parameter's name: the key itself, or the optimizer state's parameter
    stat: str | None = None  # optimizer state name (exp_avg, step, ...); None for the weight itself


#: where a number sits in a key: (dotted part index, start, end) within that part.
Where = tuple[int, int, int]


@dataclass(frozen=True)
class _Recipe:
    """How to read every key of one template (its digits replaced by ``#``)."""

    role: str
    kind: str | None
    optimizer: bool
    expert: Where | None
    layer: Where | None


def _where(key: str, span: tuple[int, int] | None) -> Where | None:
    if span is None:
        return None
    start = 0
    for i, part in enumerate(key.split(".")):
        if start <= span[0] and span[1] <= start + len(part):
            return i, span[0] - start, span[1] - start
        start += len(part) + 1
    return None


def _recipe(key: str, patterns: Sequence[KeyPattern]) -> _Recipe:
    opt = optimizer_parts(key)
    start, param = (opt[0], opt[1]) if opt else (0, key)
    role, kind, expert_span, matched = "dense", None, None, None
    if not SHARED.search(param):
        for p in patterns:
            m = p.regex.search(param)
            # learned from content: experts flattened, no expert axis to read
            if m and p.kind == "flattened":
                break
            if m:
                role, kind, matched = "expert", p.kind, m
                if p.kind == "per_expert":
                    expert_span = (m.start("expert") + start, m.end("expert") + start)
                break
        else:
            if not opt and ROUTER.search(param):
                role = "router"
    layer = (matched if matched is not None and "layer" in matched.re.groupindex
             else LAYER.search(param))
    layer_span = (layer.start("layer") + start, layer.end("layer") + start) if layer else None
    return _Recipe(role, kind, opt is not None, _where(key, expert_span), _where(key, layer_span))


_DIGIT_RUN = re.compile(r"\d+")
_HASH_DIGITS = str.maketrans("0123456789", "##########")


def _put(parts: list[str], where: Where, text: str) -> None:
    i, a, b = where
    parts[i] = parts[i][:a] + text + parts[i][b:]


def classify_keys(keys: Iterable[str],
                  patterns: Sequence[KeyPattern] = DEFAULT_PATTERNS) -> dict[str, KeyInfo]:
    """:class:`KeyInfo` of every key, matching the patterns once per key template."""
    with paused_gc():
        return _classify(keys, patterns)


def _param_template(key: str) -> str:
    """The parameter's template as a learned pattern names it (each digit run one ``#``: ids 1 and
    12 are one template), so every key of it is read one by one."""
    opt = optimizer_parts(key)
    return _DIGIT_RUN.sub("#", opt[1] if opt else key)


def _classify(keys: Iterable[str], patterns: Sequence[KeyPattern]) -> dict[str, KeyInfo]:
    recipes: dict[str, _Recipe] = {}
    out: dict[str, KeyInfo] = {}
    exact = {p.template for p in patterns if p.template}  # parameter templates read digit by digit
    one_by_one: dict[str, bool] = {}
    evidence = patterns if isinstance(patterns, Evidence) else None
    for key in keys:
        template = key.translate(_HASH_DIGITS)
        if exact:
            alone = one_by_one.get(template)
            if alone is None:
                alone = one_by_one[template] = _param_template(key) in exact
            template = key if alone else template
        r = recipes.get(template)
        if r is None:
            r = recipes[template] = _recipe(key, patterns)
        if evidence is not None:
            placed = evidence.experts.get(key)
            if placed is not None:
                out[key] = _placed(key, placed, _read(key, r))
                continue
            if key in evidence.dense and r.role == "expert":
                out[key] = _read(key, _recipe(key, ()))
                continue
        out[key] = _read(key, r)
    return out


def _read(key: str, r: _Recipe) -> KeyInfo:
    """One key read by its template's recipe."""
    parts = key.split(".") if r.layer is not None or r.expert is not None else []
    layer = int(parts[r.layer[0]][r.layer[1]:r.layer[2]]) if r.layer is not None else None
    if r.role == "dense" and not r.optimizer:
        return KeyInfo(key, "dense", None, layer, None, "", "", key)
    param, stat = key, None
    if r.optimizer:
        _, param, stat = optimizer_parts(key) or (0, key, None)
    if r.role != "expert":
        return KeyInfo(key, r.role, None, layer, None, "", "", param, stat)
    family = key
    expert = None
    if r.expert is not None:
        expert = int(parts[r.expert[0]][r.expert[1]:r.expert[2]])
        _put(parts, r.expert, "*")
        family = ".".join(parts)
    cls = family
    if r.layer is not None:
        _put(parts, r.layer, "#")
        cls = ".".join(parts)
    return KeyInfo(key, "expert", r.kind, layer, expert, family, cls, param, stat)


def _placed(key: str, placed: Placed, named: KeyInfo) -> KeyInfo:
    """A key the truth's content shows to hold experts.  Where its name reads experts of the same
    kind, as the name reads it (its families and layers then group as they always did; a name
    whose id the value denies is a misfiled expert the attribution names); else its layer and
    expert as the content says, a per-expert key's family is the model's name of its tensor
    (``layers.0.experts.w_in.exp_avg [expert *]``: a positional optimizer id numbers no expert),
    and the class the family with its layer as ``#`` -- or, where the key numbers no layer, the
    model's name of the tensor in ``layers.#``."""
    if named.role == "expert" and named.kind == placed.kind:
        return named  # an id the name claims and the value denies: the attribution names it
    opt = optimizer_parts(key)
    param, stat = (opt[1], opt[2]) if opt else (key, None)
    family = key
    if placed.kind == "per_expert" and placed.name:
        # one family per tensor of the model, whatever digits the keys carry
        family = f"{placed.name} [expert *]"
        family = f"layers.{placed.layer}.{family}" if placed.layer is not None else family
    layer = LAYER.search(family)
    if layer is not None and placed.layer is not None and int(layer["layer"]) == placed.layer:
        cls = family[:layer.start("layer")] + "#" + family[layer.end("layer"):]
    elif placed.name and placed.layer is not None:
        cls = f"layers.#.{placed.name}"
    else:
        cls = family
    return KeyInfo(key, "expert", placed.kind, placed.layer, placed.expert, family, cls, param,
                   stat)
