"""cProfile in every rank of a matrix run, for finding where a cell's seconds go.

Put this directory first on PYTHONPATH and name an output directory; every process forked after
start-up (the ranks, forked by the fork server) profiles itself and writes
``rank-<RANK>-<pid>.prof`` there just before its ``os._exit``::

    I24_PROFILE_DIR=/tmp/prof PYTHONPATH=benchmarks/rank_profile:. \\
        python -m pytest --moe-ep-matrix=default --moe-ep-experts=64 -k "ep4 and not legacy"
    python -c "import pstats; s = pstats.Stats('/tmp/prof/rank-0-<pid>.prof'); \\
        s.sort_stats('cumulative').print_stats(60)"

``I24_PROFILE_CPU=1`` times each function by the process's CPU time instead of the wall clock: with
more ranks than cores a rank's wall time includes the time it waited for a core, which hides where
the CPU went.
"""

import os

_DIR = os.environ.get("I24_PROFILE_DIR")
if _DIR:
    def _child() -> None:
        import cProfile
        import time

        prof = (cProfile.Profile(time.process_time) if os.environ.get("I24_PROFILE_CPU")
                else cProfile.Profile())
        real_exit = os._exit

        def _exit(code: int) -> None:
            prof.disable()
            prof.dump_stats(os.path.join(_DIR,
                                         f"rank-{os.environ.get('RANK', 'x')}-{os.getpid()}.prof"))
            real_exit(code)

        os._exit = _exit  # type: ignore[assignment]
        prof.enable()

    os.register_at_fork(after_in_child=_child)
