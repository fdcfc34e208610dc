"""The pytest command that reruns a red cell: ``pytest --moe-ep-matrix --moe-ep-adapter=X -k ...``.

pytest's ``-k`` matches each identifier as a case-insensitive *substring* of an item's names (its
node name, its parents' names, its keywords and markers), so ``load_ep2`` also selects ``load_ep2c``
and ``load_ep2.etp2``, and ``-k`` cannot spell ``->``.  A cell's expression is therefore built and
checked here against every cell it could meet: the whole cross product of cells at the report's
world size and expert counts (:func:`conformance.matrix.full_product`), of which every tier's cells
are a subset -- so the expression selects exactly its cell in the report's tier, and in any other
tier that holds it.  The names matched are the ones pytest's ``KeywordMatcher`` collects for a
matrix item: the collector's (``moe-ep-matrix``), the cell's node name and its ``-k`` keywords
(:meth:`~conformance.matrix.Cell.keywords`). A functions cell's are its node name's among the
functions suite's cells.

Each expression is a conjunction: the cell's own words, most selective first, until no other cell
matches all of them, then ``not`` a word of the others' that the cell lacks, until none is left.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from conformance.outcome import is_expected, is_red

#: the collector every matrix item sits under, and so a name every cell's ``-k`` matches.
COLLECTOR = "moe-ep-matrix"
#: what ``-k`` reads as one identifier (pytest's ``_pytest.mark.expression``), and its reserved
#: words.
IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")
RESERVED = {"and", "or", "not"}
#: the options' defaults (conformance.plugin), left off a command.
DEFAULT_WORLD_SIZE, DEFAULT_EXPERTS = 4, (4, 5)


@dataclass(frozen=True)
class Universe:
    """Every cell a command could select, by node name: each one's ``-k`` names, lowercased."""

    names: Mapping[str, tuple[str, ...]]

    @cached_property
    def _joined(self) -> dict[str, str]:
        return {node: "\n".join(n.lower() for n in names) for node, names in self.names.items()}

    @cached_property
    def _matched(self) -> dict[str, frozenset[str]]:
        return {}

    def matching(self, word: str) -> frozenset[str]:
        """The cells ``word`` matches (a substring of one of their names, case ignored)."""
        word = word.lower()
        if word not in self._matched:
            self._matched[word] = frozenset(n for n, joined in self._joined.items()
                                            if word in joined)
        return self._matched[word]

    def matches(self, node: str, word: str) -> bool:
        return word.lower() in self._joined[node]


def checkpoint_universe(world_size: int, experts: Sequence[int]) -> Universe:
    """Every checkpoint cell at ``world_size`` ranks and ``experts`` (every tier's cells are among
    them)."""
    from conformance.matrix import full_product

    return Universe({c.node_name: (COLLECTOR, c.node_name, *sorted(c.keywords()))
                     for c in full_product(world_size, tuple(sorted(set(experts))))})


def functions_universe() -> Universe:
    """Every functions-suite cell (the suite's grid does not depend on the world size)."""
    from conformance.functions.cells import functions_cells

    return Universe({c.node_name: (COLLECTOR, c.node_name) for c in functions_cells()})


def _words(names: Iterable[str]) -> list[str]:
    """The identifiers ``-k`` can spell that match ``names``: each name's runs of identifier
    characters, and their ``::``-separated parts."""
    found: dict[str, None] = {}
    for name in names:
        for run in IDENT.findall(name):
            for word in (run, *run.split("::")):
                if word and word.lower() not in RESERVED and IDENT.fullmatch(word):
                    found[word] = None
    return list(found)


def k_expression(node: str, universe: Universe) -> str | None:
    """A ``-k`` expression that selects ``node`` and no other cell of ``universe`` (``None``: no
    such conjunction exists, or ``node`` is not one of its cells).  Of two that do, the one with
    fewer words: one that starts from what a reader looks for (the node id up to ``->``, then
    ``load_`` and the load layout), or one that takes the most selective word each time."""
    if node not in universe.names:
        return None
    readable: list[str] = []
    if "->" in node:
        save, load = node.split("->", 1)
        readable = [f"{save}-", f"load_{load}"]
    found: list[list[str]] = []
    for first in (readable, []):
        words = _narrowed(node, universe, first)
        if words is not None:
            found.append(words)
    if not found:
        return None
    shortest: list[str] = min(found, key=len)
    return " and ".join(shortest) or COLLECTOR


def _narrowed(node: str, universe: Universe, first: list[str]) -> list[str] | None:
    """The words (``not w`` for an excluding one) that leave ``node`` alone: ``first`` where each
    narrows the cells left, then the cell's most selective words, then the others' words it
    lacks."""
    left = set(universe.names)
    chosen: list[str] = []
    own = _words(universe.names[node])
    for word in first:
        narrowed = left & universe.matching(word)
        if IDENT.fullmatch(word) and node in narrowed and len(narrowed) < len(left):
            chosen.append(word)
            left = narrowed
    while len(left) > 1:
        best = min(own, key=lambda w: (len(left & universe.matching(w)), -len(w)))
        narrowed = left & universe.matching(best)
        if len(narrowed) == len(left):
            break
        chosen.append(best)
        left = narrowed
    others = left - {node}
    while others:
        candidates = {w for other in others for w in _words(universe.names[other])
                      if not universe.matches(node, w)}
        if not candidates:
            return None
        best = max(candidates, key=lambda w: (len(others & universe.matching(w)), -len(w), w))
        chosen.append(f"not {best}")
        others -= universe.matching(best)
    return chosen


@dataclass(frozen=True)
class Options:
    """What a report's rerun commands say besides ``-k``: the suite's option, the adapter, the
    world."""

    #: ``--moe-ep-matrix[=TIER]`` and ``--moe-ep-adapter=X``, or ``--moe-ep-functions=MODULE``.
    suite: str
    world_size: int
    experts: tuple[int, ...]

    def command(self, expression: str) -> str:
        world = (f" --moe-ep-world-size={self.world_size}"
                 if self.world_size != DEFAULT_WORLD_SIZE else "")
        experts = (f" --moe-ep-experts={','.join(map(str, self.experts))}"
                   if self.experts and self.experts != DEFAULT_EXPERTS else "")
        return f'pytest {self.suite}{world}{experts} -k "{expression}"'


def matrix_option(tier: str | None) -> str:
    """``--moe-ep-matrix`` for the default tier, else ``--moe-ep-matrix=TIER``."""
    return "--moe-ep-matrix" if tier in (None, "", "default") else f"--moe-ep-matrix={tier}"


def adapter_option(name: str, given: str | None) -> str:
    """`` --moe-ep-adapter=...``: as the run was given it ("" for an adapter from a hook or the ini
    file, which a rerun in that project finds again); when not known, the built-in of that name, or
    the adapter's name itself (a run that loaded ``module:attr`` says so: see :func:`reruns`)."""
    from conformance.adapters import builtin_name, checkpoint_builtins

    if given is not None:
        return f" --moe-ep-adapter={given}" if given else ""
    builtin = builtin_name(name)
    return f" --moe-ep-adapter={builtin if builtin in checkpoint_builtins() else name}"


def node_of(record: Mapping[str, Any]) -> str:
    """The node name of the cell a record is of (a functions record's id ends with its function)."""
    node = str(record["id"]).removeprefix(f"{COLLECTOR}::")
    if record.get("suite") == "functions" and record.get("function", "*") != "*":
        node = node.rsplit("::", 1)[0]
    return node


@dataclass
class Reruns:
    """Each red cell's command, and one per suite for every red cell that was not expected."""

    commands: dict[str, str]
    unexpected: list[str]
    #: red cells no expression could single out (none for a matrix report; listed rather than
    #: hidden).
    missing: list[str]


def reruns(records: Sequence[Mapping[str, Any]], *, tier: str | None, world_size: int,
           experts: Sequence[int], adapter: str | None = None) -> Reruns:
    """The commands for ``records``' red cells (``adapter``: the ``--moe-ep-adapter`` value the run
    was given, ``None`` when unknown: the built-in of the records' adapter name)."""
    red = [r for r in records if is_red(r)]
    found: dict[str, str] = {}
    missing: list[str] = []
    expressions: dict[Options, list[str]] = {}
    universes: dict[str, Universe] = {}
    for r in red:
        functions = r.get("suite") == "functions"
        if functions:
            options = Options(f"--moe-ep-functions={r.get('adapter', '')}", DEFAULT_WORLD_SIZE, ())
            if "functions" not in universes:
                universes["functions"] = functions_universe()
            universe = universes["functions"]
        else:
            suite = matrix_option(tier) + adapter_option(str(r.get("adapter", "")), adapter)
            options = Options(suite, world_size, tuple(sorted(set(experts))))
            if "checkpoint" not in universes:
                universes["checkpoint"] = checkpoint_universe(world_size, experts)
            universe = universes["checkpoint"]
        expression = k_expression(node_of(r), universe)
        if expression is None:
            missing.append(str(r["id"]))
            continue
        found[str(r["id"])] = options.command(expression)
        if not is_expected(r) and expression not in expressions.setdefault(options, []):
            expressions[options].append(expression)
    unexpected = [options.command(" or ".join(f"({e})" for e in exprs) if len(exprs) > 1
                                  else exprs[0])
                  for options, exprs in expressions.items()]
    return Reruns(found, unexpected, missing)


__all__ = ["Options", "Reruns", "Universe", "checkpoint_universe", "functions_universe",
           "k_expression", "node_of", "reruns"]
