"""Fixtures of the reliability suite (the repository's tests/conftest.py still applies: offline hub).

`rel`: the mode (fast subset or full: SPECOPS_RELIABILITY_FULL=1 or `-m reliability_full`) and the
seed of every random choice. `figures(item, name)`: the Figures object of one reliability item;
its JSON line goes to $SPECOPS_RELIABILITY_OUT after the test, with the test's outcome.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from .helpers import DEFAULT_SEED, FULL_ENV, SEED_ENV, Figures


@dataclass(frozen=True)
class Mode:
    full: bool
    seed: int

    def pick(self, fast: int, full: int) -> int:
        """A trial count: `fast` in the default suite, `full` under scripts/reliability.sh."""
        return full if self.full else fast


@pytest.fixture(scope="session")
def rel(pytestconfig) -> Mode:
    full = os.environ.get(FULL_ENV) == "1" or "reliability_full" in (pytestconfig.option.markexpr or "")
    return Mode(full=full, seed=int(os.environ.get(SEED_ENV, DEFAULT_SEED)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"_rel_rep_{rep.when}", rep)


def _outcome(node) -> str:
    for when in ("call", "setup"):
        rep = getattr(node, f"_rel_rep_{when}", None)
        if rep is None:
            continue
        if hasattr(rep, "wasxfail"):
            return "xfailed"
        if rep.failed or when == "call":
            return rep.outcome
    return "unknown"


@pytest.fixture
def figures(request, rel):
    made: list[Figures] = []

    def make(item: str, name: str) -> Figures:
        f = Figures(item=item, name=name, nodeid=request.node.nodeid, full=rel.full, seed=rel.seed)
        made.append(f)
        return f

    yield make
    for f in made:
        f.write(_outcome(request.node))
