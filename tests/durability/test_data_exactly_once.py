"""Exactly-once training with the data position on the servers (issue #32, docs/data.md):
a pskv.torch job reads a counting data set through ``pskv.data.Sampler`` under
``pskv-launch`` with replicas and restarts, workers and servers are SIGKILLed, and the job
must end with every sample trained exactly once and, in ``dist_sync``, the weights and the
optimizer states of the run where nothing died, bit for bit."""
from __future__ import annotations

import os
import shutil
import sys
import time
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pskv.launch import control, launch
from test_chaos import SERVERS, SIZE, Chaos
from test_reshard import Lines, _await_handback

# the job is a pskv.torch program (scripts/train_data.py)
pytest.importorskip("torch", reason="the data job trains with pskv.torch: "
                                    "pip install -e '.[test,torch]'")



def _soak() -> float:
    """Seconds of kills of the long soak (``CHAOS_SECONDS``; 0: the CI variant, which kills
    until the job nears its end). ``CHAOS_INTERVAL``: seconds between two kills."""
    return float(os.environ.get("CHAOS_SECONDS", "0"))


#: steps a second the paced chaos job makes under kills every 15 s, about (3 workers, PACE
#: 0.08 s; 10.1 measured here), so that the soak's job outlasts its kills
PACED_STEPS_PER_S = 11

pytestmark = [pytest.mark.timeout(900 + 4 * _soak())]

SCRIPT = Path(__file__).parent / "scripts" / "train_data.py"


def _job(out: Path, store_type: str, epochs: int, workers: int, servers: int,
         env: dict[str, str] | None = None, chaos: Chaos | None = None,
         moves: Any = None) -> int:
    """Run the data job; ``moves(out, sock, log)``, on a thread, adds and removes servers
    through the launcher's control channel while it trains."""
    out.mkdir()
    sockets = tempfile.mkdtemp(prefix="pskv-data")
    sock = os.path.join(sockets, "control")
    log = Lines()
    thread = watch = None
    if moves is not None:
        thread = threading.Thread(target=moves, args=(out, sock, log), daemon=True)
        thread.start()
    if chaos is not None:
        # the kills begin once every worker trains (see the note on _started)
        thread = threading.Thread(target=_after_start, args=(out, workers, chaos),
                                  name="chaos", daemon=True)
        thread.start()
        # no kill once a worker is near the last step: a worker killed while the job
        # closes is not restarted (the job is over) and the launch would report it
        last = epochs * (96 // (workers * 4)) - 3
        watch = threading.Thread(target=_stop_near, args=(out, last, chaos), daemon=True)
        watch.start()
    try:
        result = launch([sys.executable, str(SCRIPT), str(out), str(epochs), store_type],
                        workers, servers, max_restarts=100000, timeout=600 + 3 * _soak(),
                        env={"PSKV_REPLICAS": "1", "PSKV_HEARTBEAT_TIMEOUT": "20",
                             "PSKV_CONNECT_TIMEOUT": "60", "TMPDIR": sockets, **(env or {})},
                        server_command=[sys.executable, "-m", "pskv.server"],
                        control=sock if moves is not None else None,
                        stderr=chaos.copies if chaos is not None else   # type: ignore[arg-type]
                        log if moves is not None else None)
    finally:
        if chaos is not None and thread is not None:
            chaos.stop.set()
            thread.join(30)
        elif thread is not None:
            thread.join(60)
        shutil.rmtree(sockets, ignore_errors=True)
    return result.returncode


def _after_start(out: Path, workers: int, chaos: Chaos) -> None:
    """Run ``chaos`` once every worker of the job in ``out`` began its first step.

    Kills while the workers still initialize their keys (torch's import takes seconds)
    once ended a dist_async job with a key missing on the server that took its shard over
    twice (CHAOS_SEED=50 of test_async_job_under_chaos_trains_each_sample_once, before this
    wait): a durability case of the init phase, left open, not of data positions."""
    while not chaos.stop.wait(0.05):
        if all(any(p.read_text().strip() for p in out.glob(f"steps-{r}-*.txt"))
               for r in range(workers)):
            chaos.run()
            return


def _stop_near(out: Path, last: int, chaos: Chaos) -> None:
    """Stop ``chaos`` once some worker of the job in ``out`` began step ``last``."""
    while not chaos.stop.wait(0.05):
        for p in out.glob("steps-*.txt"):
            try:
                steps = p.read_text().split()
            except OSError:
                continue
            if steps and int(steps[-1]) >= last:
                chaos.stop.set()
                return


def _began(out: Path, rank: int) -> int:
    """The last step worker ``rank`` of the job in ``out`` began (-1: none yet)."""
    steps = [int(x) for p in out.glob(f"steps-{rank}-*.txt") for x in p.read_text().split()]
    return max(steps, default=-1)


def _await_began(out: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while _began(out, 0) < step:
        assert time.monotonic() < deadline, f"worker 0 did not begin step {step} in 300 s"
        time.sleep(0.05)


def _final(out: Path) -> tuple[dict[str, np.ndarray], bytes]:
    with np.load(out / "final.npz") as data:
        return {k: data[k] for k in data.files}, (out / "states.bin").read_bytes()


def _steps(out: Path, rank: int) -> list[list[int]]:
    """The steps each run of worker ``rank`` began, run by run."""
    runs = sorted(out.glob(f"steps-{rank}-*.txt"), key=lambda p: int(p.stem.split("-")[2]))
    return [[int(x) for x in p.read_text().split()] for p in runs]


def _same(got: Path, want: Path) -> None:
    (gv, gs), (wv, ws) = _final(got), _final(want)
    assert sorted(gv) == sorted(wv)
    for k in wv:
        np.testing.assert_array_equal(gv[k], wv[k], err_msg=k)
    assert gs == ws, "the optimizer states differ"


def test_a_worker_killed_mid_step_resumes_at_that_step_with_the_calm_bits(tmp_path: Path) -> None:
    assert _job(tmp_path / "calm", "dist_sync", 2, 2, 2) == 0
    # worker 1 dies in step 7 after backward pushed its buckets and "seen", before the seal
    assert _job(tmp_path / "die", "dist_sync", 2, 2, 2,
                env={"DIE_WORKER": "1", "DIE_STEP": "7"}) == 0
    runs = _steps(tmp_path / "die", 1)
    # resumed where it died (7), not at 0; or at the last step it sealed (6), made again
    # with every push dropped, when no push of step 7 had left it (D4)
    assert runs[0][-1] == 7 and runs[1][0] in (6, 7), runs
    assert runs[0][:runs[1][0]] + runs[1] == _steps(tmp_path / "calm", 1)[0]
    _same(tmp_path / "die", tmp_path / "calm")


def test_sync_job_under_chaos_trains_each_sample_once_with_the_calm_bits(
        tmp_path: Path) -> None:
    # steps of the job: 8 an epoch with 3 workers; the soak's job outlasts its kills
    epochs = max(6, int(_soak() * PACED_STEPS_PER_S / 8))
    start = time.monotonic()
    assert _job(tmp_path / "calm", "dist_sync", epochs, SIZE, SERVERS) == 0
    calm_s = time.monotonic() - start
    chaos = Chaos(int(os.environ.get("CHAOS_SEED", "21")),
                  interval=float(os.environ.get("CHAOS_INTERVAL", "3")),
                  seconds=_soak() or None)
    start = time.monotonic()
    code = _job(tmp_path / "chaos", "dist_sync", epochs, SIZE, SERVERS,
                env={"PACE": "0.08"}, chaos=chaos)
    chaos_s = time.monotonic() - start
    assert code == 0, chaos.kills
    assert chaos.kills, "the job ended before anything was killed: raise its epochs"
    _same(tmp_path / "chaos", tmp_path / "calm")
    # every worker began every step, each at least once (a step made again after a kill
    # pushes nothing the servers hold: "seen" above says each sample counted once)
    steps = epochs * 96 // (SIZE * 4)
    for rank in range(SIZE):
        began = {t for run in _steps(tmp_path / "chaos", rank) for t in run}
        assert began == set(range(steps)), rank
    print(f"\nchaos data dist_sync: {len(chaos.kills)} faults survived in {chaos_s:.0f} s "
          f"({steps} steps, the calm run {calm_s:.0f} s unpaced): "
          + ", ".join(f"{w} at {t:.0f} s" for t, w in chaos.kills))


def test_async_job_with_a_worker_killed_trains_each_sample_once(tmp_path: Path) -> None:
    epochs = 3
    assert _job(tmp_path / "die", "dist_async", epochs, 2, 2,
                env={"DIE_WORKER": "0", "DIE_STEP": "9"}) == 0
    values, _ = _final(tmp_path / "die")
    # "seen" starts at 0 and each push of a sample adds exactly 1 (SGD of rate 1)
    np.testing.assert_array_equal(values["value:seen"], np.full(96, float(epochs)))
    runs = _steps(tmp_path / "die", 0)
    assert len(runs) == 2 and runs[1][0] in (8, 9), runs


def test_async_job_under_chaos_trains_each_sample_once(tmp_path: Path) -> None:
    epochs = 12
    chaos = Chaos(int(os.environ.get("CHAOS_SEED", "21")) + 1, interval=3.0)
    code = _job(tmp_path / "chaos", "dist_async", epochs, SIZE, SERVERS,
                env={"PACE": "0.08"}, chaos=chaos)
    assert code == 0, chaos.kills
    assert chaos.kills, "the job ended before anything was killed: raise its epochs"
    values, _ = _final(tmp_path / "chaos")
    # each push of a sample adds exactly 1 to "seen" (SGD of rate 1): once an epoch each
    np.testing.assert_array_equal(values["value:seen"], np.full(96, float(epochs)))
    print(f"\nchaos data dist_async: {len(chaos.kills)} faults: "
          + ", ".join(f"{w} at {t:.0f} s" for t, w in chaos.kills))


def test_a_sync_job_whose_server_is_removed_and_added_trains_with_the_calm_bits(
        tmp_path: Path) -> None:
    """The data position (seals and marks) moves with its shard: server 2 is removed while
    the Sampler's job trains (its backup serves its shard and the workers' commits), then
    added back (the shard, with its marks, handed back to it); the job ends as the calm
    run, weights, "seen" and optimizer states bit for bit, every step begun once."""
    moved: list[str] = []

    def moves(out: Path, sock: str, log: Lines) -> None:
        _await_began(out, 8)
        got = control(sock, "remove-server", 2, wait=60)
        moved.append(got.get("state", got.get("error", "")))
        _await_began(out, 24)
        mark = len(log.lines)
        moved.append(str(control(sock, "add-server", 2).get("ok")))
        _await_handback(log, mark, 2)
        moved.append("handed back")

    assert _job(tmp_path / "calm", "dist_sync", 5, 2, 3) == 0
    assert _job(tmp_path / "moved", "dist_sync", 5, 2, 3, env={"PACE": "0.05"},
                moves=moves) == 0
    assert moved == ["retired", "True", "handed back"], moved
    _same(tmp_path / "moved", tmp_path / "calm")
    for rank in range(2):
        assert _steps(tmp_path / "moved", rank) == _steps(tmp_path / "calm", rank), rank
