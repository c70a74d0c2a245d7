"""Shared fixtures and markers.

* Every test starts with no DMLC_*, PSKV_* or MXNET_* variables set (``clean_environ``).
* Markers follow folders: every test under tests/dist is marked ``dist``, every test under
  tests/mxnet ``mxnet``, and every test under tests/gpu ``gpu`` and ``dist``. The few tests in tests/unit that open a socket or start a process
  are listed in ``DIST_IN_UNIT`` (docstring examples in ``DIST_DOCTESTS``) and marked
  ``dist`` too, so ``pytest -m "not dist"`` is the fast, in-process suite.
* A test in tests/unit that is not marked ``dist`` may not open a socket: it fails, saying to
  list it in ``DIST_IN_UNIT`` (or to move it to tests/dist).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

_PREFIXES = ("DMLC_", "PSKV_", "MXNET_")
# the differential tests read these; they name an interpreter and a source checkout,
# not pskv behaviour
_KEEP = {"PSKV_MXNET_PYTHON", "PSKV_MXNET_SRC"}

TESTS = Path(__file__).resolve().parent

#: folder under tests/ -> the markers each of its tests gets
FOLDER_MARKERS = {"dist": ("dist",), "mxnet": ("mxnet",), "multihost": ("multihost", "dist"),
                  "adversarial": ("adversarial", "dist"),
                  "durability": ("dist",), "gpu": ("gpu", "dist")}

#: tests in tests/unit that open a socket or start a process ("file::test", without
#: parameters); they are marked ``dist``
DIST_IN_UNIT = frozenset({
    # bench_embeddings --quick --dist in a child python: a local case and one pskv job
    "test_bench_embeddings.py::test_quick_run_writes_the_partial_results",
    "test_device_io.py::test_dist_store_refuses_on_every_call",  # an inproc cluster
    "test_device_io_simulated.py::test_dist_scenario_matches_the_host_path",  # likewise
    "test_durability_units.py::test_supervisor_restarts_a_dead_worker_with_its_rank",
    "test_launch_argv.py::test_build_processes_local_shares_port_and_secret",  # free port
    "test_launch_argv.py::test_free_port_is_bindable",
    "test_launch_argv.py::test_free_port_avoids_the_ephemeral_range",
    "test_launch_argv.py::test_guess_host_ip_is_not_loopback",  # a UDP socket, no traffic
    "test_launch_flags.py::test_missing_hostfile_is_a_usage_error",  # main(): host-ip guess
    "test_launch_flags.py::test_log_level",  # main() builds a job spec: a free port
    "test_public_api.py::test_reference_builds_without_warnings",  # Sphinx in a child python
    "test_readme.py::test_the_readme_test_command_collects_without_torch",  # a child pytest
    "test_readme.py::test_pskv_torch_doctests_skip_without_torch",  # likewise
    "test_docs_examples.py::test_launched_example_runs_as_written",  # pskv-launch, a cluster
    "test_torch.py::test_import_pskv_and_pskv_torch_do_not_import_torch",  # a child python
    "test_train.py::test_runs_as_a_module",  # the example in a child python
    "test_train.py::test_output_through_a_pipe_is_whole_lines",  # likewise
})

#: docstring examples in src/pskv that open a socket or start processes (doctest names);
#: marked ``dist`` when this conftest is loaded, as it is for a plain ``pytest``
DIST_DOCTESTS = frozenset({"pskv.launch.launch"})  # runs a small job


def _folder(item: pytest.Item) -> str | None:
    """The first folder under tests/ that holds ``item`` (None outside tests/)."""
    try:
        rel = Path(str(item.path)).resolve().relative_to(TESTS)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 else None


def _unit_name(item: pytest.Item) -> str:
    name = getattr(item, "originalname", None) or item.name
    return f"{Path(str(item.path)).name}::{name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by folder (dist, mxnet, multihost + dist) and by DIST_IN_UNIT."""
    for item in items:
        folder = _folder(item)
        if folder in FOLDER_MARKERS:
            for marker in FOLDER_MARKERS[folder]:
                item.add_marker(marker)
        elif folder == "unit" and _unit_name(item) in DIST_IN_UNIT:
            item.add_marker("dist")
        elif folder is None and item.name in DIST_DOCTESTS:
            item.add_marker("dist")


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear the cluster and MXNet variables so no test sees another's settings."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) and name not in _KEEP:
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def unit_tests_open_no_sockets(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a tests/unit test that opens a socket but is not marked ``dist``."""
    item = request.node
    if _folder(item) != "unit" or item.get_closest_marker("dist") is not None:
        yield
        return
    opened: list[str] = []
    original = socket.socket.__init__

    def spy(sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        opened.append(f"socket.socket{args!r}")
        original(sock, *args, **kwargs)

    import zmq  # a core dependency; its sockets are made in C, so watch them here too
    zmq_socket = zmq.Context.socket

    def zmq_spy(ctx: zmq.Context[Any], *args: Any, **kwargs: Any) -> Any:
        opened.append(f"zmq socket{args!r}")
        return zmq_socket(ctx, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "__init__", spy)
    mp.setattr(zmq.Context, "socket", zmq_spy)
    try:
        yield
    finally:
        mp.undo()
    if opened:
        pytest.fail(f"{_unit_name(item)} opened {opened[0]}: tests/unit is the fast suite "
                    f"without sockets. Add it to DIST_IN_UNIT in tests/conftest.py (it is "
                    f"then marked dist), or move it to tests/dist.", pytrace=False)
