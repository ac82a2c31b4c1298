"""The suite's own configuration (tests/conftest.py): what makes `make test` fit its time."""

from __future__ import annotations

import os

from tests.conftest import _CACHE_DIR, FAST_COMPILE_FLAGS, FULL_OPT, _cpu_only


def test_test_files_keep_the_heavy_first_order_under_xdist(pytestconfig):
    """pytest-xdist reorders `--dist loadfile` work by tests per file unless told not to; the heavy
    files would then run last."""
    if pytestconfig.pluginmanager.hasplugin("xdist"):
        assert pytestconfig.getoption("loadscopereorder") is False


def test_the_suite_compiles_with_the_fast_cpu_codegen():
    """On CPU (and unless HKV_TEST_FULL_OPT=1) every test process and its children compile at -O0 with
    XLA's classic emitters; the accepted flag set is remembered next to the compilation cache."""
    if FULL_OPT or not _cpu_only():
        return
    flags = os.environ["XLA_FLAGS"].split()
    assert all(f in flags for f in FAST_COMPILE_FLAGS), flags
    assert any(name.startswith("xla-flags-accepted-") for name in os.listdir(_CACHE_DIR))


def test_every_heavy_first_name_is_a_test_file():
    """A renamed or deleted file left in HEAVY_FIRST would silently lose its place at the front."""
    from pathlib import Path

    from tests.conftest import HEAVY_FIRST

    names = {p.name for p in Path(__file__).resolve().parent.rglob("test_*.py")}
    assert sorted(set(HEAVY_FIRST) - names) == []
