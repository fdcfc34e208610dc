"""A checkpoint cut into *atoms* -- one matrix of one expert -- and digested, for comparing a
conversion by value (:mod:`conformance.inspection.conversion`).

An atom is a per-expert key, one row of a packed key's expert axis, or one of the shared expert's
projections; where the other side's shapes say it fuses what this side keeps apart, each half of a
fused matrix (concatenated or interleaved, along either axis) is an atom too.  Every atom is
digested in one orientation (fewer rows than columns), so a transposed copy digests alike.  The
names only say what an atom *should* be (layer, expert or shared expert, gate / up / down).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

from conformance.inspection.digests import Digest, _batches, digest
from conformance.inspection.keys import KeyInfo, KeyPattern, classify_keys
from conformance.inspection.model import CheckpointIndex

__all__ = ["DIGITS", "HALVES", "SHARED", "Atom", "Piece", "Side", "owner", "role_of"]

#: the shared expert's keys (dense by the expert patterns: one per layer, no expert axis).
SHARED = re.compile(r"(?:^|\.)(?:shared_experts?|shared_mlp|moe\.shared)\.")
#: a projection's role from the tokens of its name: fused first (``gate_up_proj``, ``w13``).
_FUSED = ("gate_up", "w13", "fc1")
_ROLES = (("gate", ("gate", "w1")), ("up", ("up", "w3")), ("down", ("down", "w2", "fc2")))
#: the halves of a fused gate/up matrix, in transformers' order (its forward's ``chunk(2)``).
HALVES = ("gate", "up")
#: a layer or expert number in a key: a whole dot-separated part (``layers.3.``), never the digits
#: of a name (``w1`` and ``w3``, ``linear_fc1`` stay apart in the mapping).
DIGITS = re.compile(r"(?<![^.])\d+(?![^.])")


class Piece(NamedTuple):
    """One expert matrix as a checkpoint files it: ``row`` of a packed key's expert axis (``None``
    for a whole key); ``expert`` ``None`` for the shared expert; ``role`` gate / up / down /
    gate_up, or ``None`` where the name does not say."""

    key: str
    row: int | None
    layer: int | None
    expert: int | None
    role: str | None


class Atom(NamedTuple):
    """One matrix of a piece: ``split`` "" (the whole piece) or how a fused piece was cut ("cat0":
    concatenated halves along axis 0, "il1": interleaved columns, ...), ``half`` 0 or 1;
    ``transposed``: stored with more rows than columns (the digest is of its transpose)."""

    piece: int
    split: str = ""
    half: int = 0
    transposed: bool = False


def role_of(key: str) -> str | None:
    """gate / up / down / gate_up from a key's last two named parts (``gate_w``, ``w1``,
    ``experts.3.gate_proj.weight``, ``gate_up_proj``, ``linear_fc1``), ``None`` where they do not
    say."""
    parts = [p for p in key.split(".") if not p.isdigit() and p not in ("weight", "bias")][-2:]
    text = "_".join(parts)
    tokens = set(re.split(r"[._]", text))
    if ("gate" in tokens and "up" in tokens) or any(f in tokens for f in ("w13", "fc1")):
        return "gate_up"
    for role, names in _ROLES:
        if tokens & set(names):
            return role
    return None


def _layer_of(key: str) -> int | None:
    m = re.search(r"(?:^|\.)layers?[._](\d+)\.", key)
    return int(m[1]) if m else None


def _pieces(index: CheckpointIndex, infos: dict[str, KeyInfo]) -> tuple[list[Piece], set[str]]:
    """Every expert matrix of ``index`` (optimizer state left out: an export holds none) and the
    keys they come from."""
    out: list[Piece] = []
    keys: set[str] = set()
    for key, info in infos.items():
        entry = index.entries[key]
        if not entry.is_tensor or not entry.shape or info.stat is not None:
            continue
        if info.role == "expert":
            keys.add(key)
            role = role_of(key)
            if info.kind == "packed":
                out += [Piece(key, r, info.layer, r, role) for r in range(entry.shape[0])]
            else:
                out.append(Piece(key, None, info.layer, info.expert, role))
        elif len(entry.shape) in (3, 4) and role_of(key) and not SHARED.search(key):
            # an expert axis no name pattern knows (the reference's fused ``moe.gate_up_w``
            # ``[E, 2, h, dim]``): a projection's name on a stack of matrices; the values then say
            # whose they are
            keys.add(key)
            out += [Piece(key, r, info.layer, r, role_of(key)) for r in range(entry.shape[0])]
        elif SHARED.search(key) and len(entry.shape) == 2:
            keys.add(key)
            out.append(Piece(key, None, info.layer if info.layer is not None else _layer_of(key),
                             None, role_of(key)))
    return out, keys


def _shape(index: CheckpointIndex, piece: Piece) -> tuple[int, ...]:
    shape = index.entries[piece.key].shape or ()
    shape = tuple(shape[1:]) if piece.row is not None else tuple(shape)
    # a fused piece kept as ``[2, h, dim]`` is its halves concatenated: ``[2h, dim]``
    return (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape


def _matrix(value: Any, piece: Piece) -> Any:
    x = value[piece.row] if piece.row is not None else value
    return x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x


def _canonical(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (min(shape), max(shape)) if len(shape) == 2 else shape


def _splits(shape: tuple[int, ...], other: set[tuple[int, ...]]) -> list[str]:
    """The cuts of a ``shape`` matrix into halves whose shape the other side's atoms have."""
    if len(shape) != 2:
        return []
    out = []
    for axis in (0, 1):
        if shape[axis] % 2 == 0:
            half = list(shape)
            half[axis] //= 2
            if _canonical(tuple(half)) in other:
                out += [f"cat{axis}", f"il{axis}"]
    return out


def _cut(x: Any, split: str, half: int) -> Any:
    axis, n = int(split[-1]), x.shape[int(split[-1])] // 2
    if split.startswith("cat"):
        return x.narrow(axis, half * n, n)
    return x[half::2] if axis == 0 else x[:, half::2]


def _oriented(x: Any) -> tuple[Any, bool]:
    if x.dim() == 2 and x.shape[0] > x.shape[1]:
        return x.t().contiguous(), True
    return x.contiguous(), False


class Side:
    """One checkpoint's atoms and their digests."""

    def __init__(self, index: CheckpointIndex, patterns: Sequence[KeyPattern]) -> None:
        self.index = index
        self.infos = classify_keys([k for k, e in index.entries.items() if e.is_tensor], patterns)
        self.pieces, self.expert_keys = _pieces(index, self.infos)
        self.atoms: list[Atom] = []
        self.digests: list[Digest] = []

    def shapes(self) -> set[tuple[int, ...]]:
        return {_canonical(_shape(self.index, p)) for p in self.pieces}

    def read(self, other_shapes: set[tuple[int, ...]], memory_bytes: int, cast: Any) -> None:
        """Digest every atom: each piece whole, and cut in halves where the other side's shapes
        ask for it."""
        by_key: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.pieces):
            by_key[p.key].append(i)
        for batch in _batches(self.index, sorted(by_key), memory_bytes):
            assert self.index.reader is not None, "the caller checked both indexes have readers"
            for key, value in self.index.reader(batch).items():
                if cast is not None and value.is_floating_point() and value.dtype != cast:
                    value = value.to(cast)
                for i in by_key[key]:
                    self._digest(i, value, other_shapes)

    def _digest(self, i: int, value: Any, other_shapes: set[tuple[int, ...]]) -> None:
        x = _matrix(value, self.pieces[i])
        oriented, flipped = _oriented(x)
        self.atoms.append(Atom(i, transposed=flipped))
        self.digests.append(digest(oriented))
        for split in _splits(tuple(x.shape), other_shapes):
            for half in (0, 1):
                part, flipped = _oriented(_cut(x, split, half))
                self.atoms.append(Atom(i, split, half, flipped))
                self.digests.append(digest(part))

    def value(self, atom: Atom, cast: Any) -> Any:
        """An atom's matrix, read again (the comparison within ulps), in its digest's
        orientation."""
        piece = self.pieces[atom.piece]
        assert self.index.reader is not None, "the caller checked both indexes have readers"
        value = self.index.reader([piece.key])[piece.key]
        if cast is not None and value.is_floating_point() and value.dtype != cast:
            value = value.to(cast)
        x = _matrix(value, piece)
        return _oriented(_cut(x, atom.split, atom.half) if atom.split else x)[0]

    def role(self, atom: Atom) -> str | None:
        """What an atom should hold by its name: a fused piece's halves are gate and up."""
        role = self.pieces[atom.piece].role
        if atom.split:
            return HALVES[atom.half] if role == "gate_up" else None
        return role

    def name(self, atom: Atom) -> str:
        """The projection an atom is, as this checkpoint names it (``down_proj``, ``gate_up_proj
        (its up half)``)."""
        piece = self.pieces[atom.piece]
        parts = [p for p in piece.key.split(".") if not p.isdigit() and p not in ("weight",)]
        name = parts[-1] if parts else piece.key
        if piece.expert is None:
            name = f"shared expert's {name}"
        if atom.split:
            how = "interleaved" if atom.split.startswith("il") else "concatenated"
            which = (f"its {HALVES[atom.half]} half" if piece.role == "gate_up"
                     else f"half {atom.half}")
            name += f" ({which}, {how})"
        return name


def owner(piece: Piece) -> str:
    """Whose matrix ``piece`` is, in a finding's words."""
    return "the shared expert" if piece.expert is None else f"expert {piece.expert}"
