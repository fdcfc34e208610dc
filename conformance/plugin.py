"""The conformance matrix's pytest face (``pytest11`` entry ``moe_ep_matrix``); never imports torch.

This module registers the matrix's options, ini values and hookspecs, and nothing else runs unless
the matrix is asked for: ``--moe-ep-matrix`` (checkpoint cells) or ``--moe-ep-functions`` (the
functions suite) registers a :class:`~conformance.session.MatrixSession` plugin for the session, as
pytest-xdist registers its ``DSession`` only in distribution mode.

The adapter comes from ``--moe-ep-adapter``, else the ``pytest_moe_ep_adapter`` hook (a framework's
conftest.py), else the ini value ``moe_ep_adapter``, else the built-in ``reference``.
"""

from __future__ import annotations

import pytest

from conformance import hooks
from pytest_moe_ep.settings import GROUP, ini_and_option


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(*GROUP)
    group.addoption(
        "--moe-ep-matrix", dest="moe_ep_matrix", nargs="?", const="default", default=None,
        metavar="TIER|EPS", help="run the conformance matrix: 'default' (a covering set of cells), "
        "'full' (every cell), or comma-separated EP degrees such as 1,2,4")
    ini_and_option(parser, "adapter",
                   "checkpoint adapter the matrix checks: a built-in name (reference, legacy, "
                   "...) or module:attr (default: the pytest_moe_ep_adapter hook, else reference)")
    ini_and_option(parser, "world_size",
                   "ranks in the world the conformance matrix runs on (default 4)", default="4")
    ini_and_option(parser, "experts",
                   "expert counts E of the matrix's cells, comma-separated (default 4,5: one even "
                   "count, and one uneven count that reaches every uneven class at ep=4: a partial "
                   "chunk, a rank with none, and the balanced split's miscount and silent "
                   "mislabel)", default="4,5")
    parser.addini("moe_ep_share_saves",
                  "one save feeds every cell that loads it (default true; false makes each "
                  "cell write its own, the benchmark's baseline)", type="bool", default=True)
    group.addoption("--moe-ep-functions", dest="moe_ep_functions", default=None, metavar="MODULE",
                    help="check a module exposing the nine expert-slice functions against the "
                    "reference (a built-in name such as nemo_automodel, or a dotted module path)")
    group.addoption("--moe-ep-expert-key", dest="moe_ep_expert_key", action="append", default=[],
                    metavar="REGEX", help="a regex naming checkpoint keys that hold experts (a "
                    "named group 'expert' for per-expert keys); rarely needed: the matrix learns "
                    "expert keys from the ep=1 checkpoint's content")
    group.addoption("--moe-ep-report", dest="moe_ep_report", default=None, metavar="DIR",
                    help="write moe-ep-conformance.json and .md into DIR")
    group.addoption("--moe-ep-keep-checkpoints", dest="moe_ep_keep_checkpoints", default=None,
                    metavar="DIR", help="keep each cell's checkpoints in DIR/<cell id>/: save "
                    "(what it loaded), ep1 (the ep=1 save it was compared with) and their Hugging "
                    "Face exports save-hf and ep1-hf, to check a verdict by hand (hard links where "
                    "the filesystem allows)")
    ini_and_option(parser, "expectations",
                   "an expectations file (TOML): per cell id or pattern, the finding a red cell is "
                   "expected to have (silent, on-disk, refused, error) or pass, and why; a cell "
                   "that matches is xfailed, one worse or better than expected fails "
                   "(docs/matrix.md#expectations)")
    group.addoption("--moe-ep-update-expectations", dest="moe_ep_update_expectations",
                    action="store_true", default=False, help="rewrite the --moe-ep-expectations "
                    "file from this run's outcomes (only the cells that ran; only when the run "
                    "finished), keeping the reasons and comments of unchanged entries")
    ini_and_option(parser, "tolerate",
                   "findings accepted everywhere without listing cells, comma-separated "
                   "(refused, error): such cells are xfailed, still reported")


#: options that only mean something in a matrix (or functions) session: given alone, they would do
#: nothing.
_MATRIX_ONLY = {"moe_ep_expectations": "--moe-ep-expectations", "moe_ep_update_expectations":
                "--moe-ep-update-expectations", "moe_ep_tolerate": "--moe-ep-tolerate"}


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("moe_ep_matrix",
                        None) is None and not config.getoption("moe_ep_functions", None):
        given = [flag for dest, flag in _MATRIX_ONLY.items() if config.getoption(dest, None)]
        if given:  # the command line's, not an ini value a project keeps for its matrix job
            raise pytest.UsageError(f"pytest-moe-ep: {', '.join(given)} holds the conformance "
                                    "matrix to a baseline; give --moe-ep-matrix (or "
                                    "--moe-ep-functions) too")
        return
    from conformance.session import MatrixSession

    config.pluginmanager.register(MatrixSession.from_config(config), MatrixSession.NAME)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """``--moe-ep-keep-checkpoints`` reaches the matrix's saves once the matrix session has made
    them."""
    keep = session.config.getoption("moe_ep_keep_checkpoints", None)
    if not keep:
        return
    from pathlib import Path

    from conformance.session import MatrixSession

    matrix = session.config.pluginmanager.get_plugin(MatrixSession.NAME)
    saves = getattr(getattr(matrix, "context", None), "saves", None)
    if saves is not None:
        saves.keep = Path(keep).resolve()
