"""The narrow protocol between the supervisor (controller side) and its ranks (worker side).

Everything that crosses a rank's pipe is one of these small dataclasses, pickled by
``multiprocessing``.  The supervisor sends :class:`Call` and :class:`Stop`; a rank answers
:class:`Ready` once after start-up and one :class:`Result` per call.  Functions travel by
reference (module and qualified name), never by value, so a rank runs exactly the code the
controller names and a function that a rank cannot import is refused before any process starts.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any

from pytest_moe_ep.text import first_line

__all__ = [
    "Call",
    "FunctionRef",
    "RankError",
    "Ready",
    "Result",
    "Stop",
    "StructuredError",
    "error_fields",
    "function_ref",
]

#: the attribute of an exception whose dict of plain data crosses the pipe as
#: :attr:`RankError.fields`.
FIELDS_ATTR = "structured_fields"


class StructuredError(Exception):
    """An exception whose :attr:`structured_fields` (plain data: str, int, float, bool, lists,
    dicts) reach the controller as :attr:`RankError.fields`, so a caller reads what happened without
    parsing the message.  Any exception may carry the attribute; this class only declares it."""

    structured_fields: dict[str, Any]

    def __init__(self, *args: Any, fields: dict[str, Any] | None = None) -> None:
        super().__init__(*args)
        self.structured_fields = dict(fields or {})


def error_fields(exc: BaseException) -> dict[str, Any]:
    """What ``exc`` carries under :data:`FIELDS_ATTR` (a copy; ``{}`` when it carries nothing
    usable)."""
    found = getattr(exc, FIELDS_ATTR, None)
    return dict(found) if isinstance(found, dict) else {}


@dataclass(frozen=True)
class FunctionRef:
    """An importable function: ``module`` plus dotted ``qualname`` (``Class.method`` allowed)."""

    module: str
    qualname: str
    #: the module's file, so a rank can import a test module with pytest's assertion rewriting.
    path: str | None = None
    rewrite_asserts: bool = False

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"

    def resolve(self) -> Any:
        """Import the module and walk the qualname; a class on the way is instantiated."""
        obj: Any = sys.modules.get(self.module) or importlib.import_module(self.module)
        parts = self.qualname.split(".")
        for i, part in enumerate(parts):
            obj = getattr(obj, part)
            if isinstance(obj, type) and i < len(parts) - 1:
                obj = obj()
        return obj


def function_ref(fn: Any) -> FunctionRef:
    """The reference a rank uses to find ``fn``; ``TypeError`` when a rank could not import it."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or module is None or qualname is None:
        raise TypeError(f"{fn!r} is not a module-level function: ranks find functions by module "
                        "and name")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"{module}:{qualname} cannot run on ranks: lambdas, closures and functions defined "
            "inside other functions cannot be imported by a rank process; define it at module level"
        )
    if module == "__main__":
        raise TypeError(
            f"__main__:{qualname} cannot run on ranks: the rank processes do not run your script; "
            "move the function into an importable module"
        )
    ref = FunctionRef(module, qualname, getattr(sys.modules.get(module), "__file__", None))
    try:
        found = ref.resolve()
    except Exception as exc:
        raise TypeError(f"{ref} cannot run on ranks: importing it here fails with {exc!r}") from exc
    if getattr(found, "__func__", found) is not getattr(fn, "__func__", fn):
        raise TypeError(f"{ref} cannot run on ranks: that name does not refer to {fn!r}")
    return ref


@dataclass(frozen=True)
class Call:
    call_id: int
    fn: FunctionRef
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: the controller's sys.path, so modules it imported (test modules among them) import in ranks.
    sys_path: tuple[str, ...] = ()
    #: whether the ranks first agree on the call id in a collective; a probe of whether the ranks'
    #: collectives are still in step (:mod:`.health`) must not run one before it knows.
    agree: bool = True


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class RankError:
    """An exception raised on one rank, flattened so it pickles whatever its type."""

    rank: int
    type_name: str
    message: str
    traceback: str
    #: the exception's :data:`FIELDS_ATTR` dict (see :class:`StructuredError`): what the caller
    #: reads.
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    #: what the rank said it was doing where the exception left it
    #: (:func:`pytest_moe_ep.world.activity.activity`).
    activity: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def headline(self) -> str:
        return f"rank {self.rank} raised {self.type_name}: {first_line(self.message)}".rstrip(": ")


@dataclass(frozen=True)
class Result:
    call_id: int
    rank: int
    value: Any = None
    error: RankError | None = None
