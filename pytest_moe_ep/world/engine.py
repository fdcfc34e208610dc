"""The interface both world engines implement, and what a call returns or raises.

Two engines run functions on every rank of a world: the
:class:`~pytest_moe_ep.world.supervisor.Supervisor` (local worlds it starts and supervises) and
:class:`~pytest_moe_ep.world.torchrun.TorchrunWorld` (pytest itself runs on every rank of a torchrun
launch).  Callers -- marked tests, the conformance matrix -- see only :class:`Engine`,
:class:`CallResult` and :class:`WorldError`, whose fields say what happened, so nobody parses an
English message.  Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from pytest_moe_ep.world.protocol import FunctionRef, RankError

__all__ = [
    "CHECKPOINT_PRELOAD",
    "CallResult",
    "Engine",
    "RankFailure",
    "RankOutput",
    "Section",
    "WorldError",
    "WorldStartError",
    "WorldTimeout",
    "collective_timeout_s",
]

#: the seconds ranks need, after their process group's timeout fires on a stuck rank, to raise,
#: record where they were and report before the call's deadline (a tenth of a long deadline, half a
#: very short one).
REPORT_MARGIN_S = 3.0


def collective_timeout_s(deadline_s: float) -> float:
    """The process group's timeout for calls with a deadline of ``deadline_s``: early enough that
    ranks waiting on a stuck rank raise and report in time, so the hang is diagnosed as one ("timed
    out in a collective waiting for a stuck rank", the stuck rank named).  With 0.9 x a 6 s deadline
    the margin was 0.6 s, and on a slow host the deadline cut the waiting ranks off mid-report."""
    return deadline_s - max(0.1 * deadline_s, min(REPORT_MARGIN_S, 0.5 * deadline_s))

#: what DCP and FSDP2 import on their first use, ``torch._dynamo`` above all (1-2 s in every rank):
#: a caller whose ranks checkpoint or shard hands these to :meth:`Engine.add_preload` before its
#: first world.
CHECKPOINT_PRELOAD = (
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
)


@dataclass
class RankOutput:
    stdout: str = ""
    stderr: str = ""


@dataclass
class CallResult:
    """Per-rank return values and the output each rank wrote during the call."""

    values: list[Any]
    outputs: list[RankOutput]


@dataclass(frozen=True)
class Section:
    """One titled block of :meth:`WorldError.report`, and the ranks it is about (none: the whole
    world's).

    It unpacks as ``(title, body)``, so code
    that reads the ranks finds them here instead of in the title.
    """

    title: str
    body: str
    ranks: tuple[int, ...] = ()

    def __iter__(self) -> Iterator[str]:
        return iter((self.title, self.body))


@dataclass
class WorldError(Exception):
    """A call failed.  The fields say how; :attr:`headline` and :meth:`report` say it in words.

    ``cause`` is the headline without the call's name and world ("failed on rank(s) 2: rank 2 raised
    ValueError: ..."), what a caller that names the call itself shows.  ``at_fault`` are the ranks
    to blame, most direct first; ``waiting`` the ranks that were only blocked in a collective by
    them; ``locations`` where a rank at fault was stuck (``file:line in function``) when the call
    hung; ``errors`` the exception each rank raised; ``states`` what each rank was doing (the value
    of a :class:`~pytest_moe_ep.world.diagnosis.RankStatus`); ``activity`` what each rank said it
    was doing (:mod:`~pytest_moe_ep.world.activity`: where a rank that raised was when it raised,
    where a hung or dead one last was); ``sections`` the report's titled blocks.
    """

    fn: str
    world_size: int
    backend: str
    cause: str
    at_fault: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    locations: dict[int, str] = field(default_factory=dict)
    errors: dict[int, RankError] = field(default_factory=dict)
    states: dict[int, str] = field(default_factory=dict)
    activity: dict[int, dict[str, str]] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)
    outputs: list[RankOutput] = field(default_factory=list)
    #: whether the world served on after the failure (``kept``; only when every rank raised and the
    #: ranks were still in step: :mod:`~pytest_moe_ep.world.health`), else why it was replaced.
    kept: bool = False
    replaced_because: str = ""
    #: "start", "failed", "hang" or "out-of-step"
    kind: ClassVar[str] = "failed"

    def __post_init__(self) -> None:
        super().__init__(self.headline)

    @property
    def headline(self) -> str:
        return f"{self.fn} on a {self.world_size}-rank {self.backend} world {self.cause}"

    @property
    def skipped_everywhere(self) -> str | None:
        """The reason when every rank called ``pytest.skip()`` (a skip, not a failure), else
        ``None``."""
        skips = [e for e in self.errors.values() if e.type_name == "Skipped"]
        if skips and len(skips) == len(self.errors) == self.world_size:
            return skips[0].message
        return None

    def report(self) -> str:
        parts = [self.headline]
        for title, body in self.sections:
            parts.append(f"{'-' * 8} {title} {'-' * 8}\n{body.rstrip()}")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.report()

    def __hash__(self) -> int:
        return id(self)


class WorldStartError(WorldError):
    """The ranks could not form a world."""

    kind = "start"


class RankFailure(WorldError):
    """One or more ranks raised or died."""

    kind = "failed"


class WorldTimeout(WorldError):
    """The call hung: it passed its deadline, or ranks timed out in a collective waiting for one
    stuck rank."""

    kind = "hang"


class OutOfStep(WorldError):
    """Ranks were about to run different calls (torchrun mode)."""

    kind = "out-of-step"


@runtime_checkable
class Engine(Protocol):
    """What runs functions on every rank of a world.  Both engines implement all of it."""

    #: this process's rank among the launch's ranks (0 for the supervisor, which alone writes
    #: reports).
    rank: int

    def describe(self) -> str:
        """One line for pytest's header: where worlds come from."""
        ...

    def call(self, fn: FunctionRef, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
             *, world_size: int, backend: str = "auto", timeout: float | None = None) -> CallResult:
        """Run ``fn`` on every rank; raise :class:`WorldError` (or ``BackendUnavailable``) when it
        cannot."""
        ...

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int, backend: str = "auto",
            timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """:meth:`call` for a plain function; the per-rank return values in rank order."""
        ...

    def shared_dir(self, nodeid: str) -> Path:
        """A new directory every rank of the next calls sees under the same path."""
        ...

    def add_preload(self, modules: Sequence[str]) -> None:
        """Modules ranks should have imported before their first call (a hint; may do nothing)."""
        ...

    def agree_on_exit(self, status: int) -> int:
        """The session's exit status every process of the launch ends with."""
        ...

    def shutdown(self) -> None:
        """Stop every world and remove what it left; idempotent, bounded in time."""
        ...
