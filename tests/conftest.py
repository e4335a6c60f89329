import os

import interpreted_triton
import pytest

# The Triton kernels run on CPU tensors through the interpreter; it is chosen when a kernel is
# decorated, so it must be set before anything imports dgpo_ops.kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ["TRITON_INTERPRET"] == "1":
    interpreted_triton.patch_the_language_once_per_launch()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A run of the suite spreads its tests over one pytest-xdist worker per core unless ``-n`` is given
    (``-n 0``: one process). ``--dist loadgroup``: a test goes to whichever worker is free, except that the
    tests of one ``xdist_group`` run on one worker, in file order: a file whose module fixture starts
    processes, compiles a report or saves models once marks its tests so, and so does test_rewards.py, which
    relies on its order.

    The work goes out in the order of the collection as pytest_collection_modifyitems leaves it (the ``early`` tests
    first), not sorted by the number of tests in a group as xdist would: that put every group of two tests or more
    before the long single tests, which then ran alone at the end of the run.

    Set here, not in pyproject's addopts, because addopts would reach ``pytest bench/`` too, where
    pytest-benchmark turns itself off under xdist; and the framework venvs of .ci/ run their file with
    ``-p no:xdist``, where this leaves the run alone."""
    if hasattr(config, "workerinput"):
        # A worker runs its share and starts no workers. It reads --dist from the command line, not from here:
        # told by pytest_configure_node below, it names its tests by group as --dist loadgroup would.
        config.option.loadgroup = config.option.loadgroup or config.workerinput.get("loadgroup", False)
        return
    if not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None:
        return
    config.option.numprocesses = "auto"
    if config.option.dist == "no":
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's hook, before a worker starts: tell it whether this run distributes by group."""
    node.workerinput["loadgroup"] = node.config.option.dist == "loadgroup"


def pytest_configure(config):
    """In an xdist worker, torch's intra-op threads share the cores with the other workers (one each on two
    cores) instead of each worker starting a thread per core."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))


def pytest_collection_modifyitems(config, items):
    """The tests marked ``early`` (each a minute or so of processes or models, or a module of tests sharing such a
    fixture) run first, the others after them; each keeps its place among its kind. With two workers, a long test
    that started last ran alone while the other worker had nothing left to do."""
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("early") is None)


@pytest.fixture
def no_pending_checks():
    """No deferred input check is left over from another test, and none of this test's is left for the
    next."""
    import dgpo_ops

    dgpo_ops.raise_deferred_errors()
    yield
    try:
        dgpo_ops.raise_deferred_errors()
    except ValueError:
        pass
