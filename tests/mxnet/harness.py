"""Run one scenario on real MXNet 1.9.1 (in its own interpreter) and on pskv.

A scenario is Python source that uses the names ``mx`` (``mxnet`` or ``pskv``), ``np``
(NumPy) and ``result`` (a dict it fills with arrays or numbers). The same source runs
under both libraries, so a differential test is "run it twice, compare ``result``".

MXNet 1.9.1 needs ``numpy<1.24``, so it lives in a separate virtual environment whose
interpreter is named by ``PSKV_MXNET_PYTHON``; without it, the tests skip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ENV_MXNET_PYTHON = "PSKV_MXNET_PYTHON"
SKIP_REASON = (f"no MXNet 1.9.1 interpreter: set {ENV_MXNET_PYTHON} to the python of a venv "
               "with mxnet==1.9.1 and numpy<1.24 (the README's Tests section shows the "
               "two commands)")

_RUNNER = r'''
import json, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
import {module} as mx
result = {{}}
_src = open(sys.argv[1]).read()
_err = None
try:
    exec(compile(_src, "<scenario>", "exec"), {{"mx": mx, "np": np, "result": result}})
except BaseException as e:  # report the error class and message to the caller
    _err = [type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)[:2000]]
arrays = {{}}
meta = {{}}
for k, v in result.items():
    if hasattr(v, "asnumpy"):
        v = v.asnumpy()
    if isinstance(v, np.ndarray) or isinstance(v, (list, tuple)) and v and hasattr(v[0], "shape"):
        arrays[k] = np.asarray(v)
    else:
        meta[k] = v
np.savez(sys.argv[2], **arrays)
with open(sys.argv[3], "w") as f:
    json.dump({{"meta": meta, "error": _err}}, f, default=str)
'''


def mxnet_python() -> str:
    """The MXNet interpreter, or skip the test."""
    path = os.environ.get(ENV_MXNET_PYTHON, "")
    if not path or not Path(path).exists():
        pytest.skip(SKIP_REASON)
    return path


def run_scenario(source: str, *, use_mxnet: bool, timeout: float = 120.0) -> dict[str, Any]:
    """Run ``source`` under MXNet (subprocess) or pskv (a subprocess too, for isolation).

    Returns the ``result`` dict (arrays as NumPy) plus ``"__error__"``: ``None`` or
    ``[class name, [mro names], message]`` when the scenario raised.
    """
    python = mxnet_python() if use_mxnet else sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "scenario.py")
        src.write_text(textwrap.dedent(source))
        runner = Path(tmp, "runner.py")
        runner.write_text(_RUNNER.format(module="mxnet" if use_mxnet else "pskv"))
        npz, meta = Path(tmp, "out.npz"), Path(tmp, "meta.json")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DMLC_", "MXNET_", "PSKV_"))}
        env["MXNET_ENGINE_TYPE"] = "NaiveEngine" if use_mxnet else ""
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run([python, str(runner), str(src), str(npz), str(meta)],
                              capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=tmp)
        if proc.returncode != 0 or not meta.exists():
            raise AssertionError(f"scenario runner failed (rc={proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        info = json.loads(meta.read_text())
        with np.load(npz, allow_pickle=False) as data:
            out: dict[str, Any] = {k: data[k] for k in data.files}
        out.update(info["meta"])
        out["__error__"] = info["error"]
        return out


def run_both(source: str, timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``source`` under MXNet 1.9.1 and under pskv; return (mxnet, pskv) results."""
    mxnet_python()
    return (run_scenario(source, use_mxnet=True, timeout=timeout),
            run_scenario(source, use_mxnet=False, timeout=timeout))


def assert_results_close(ref: dict[str, Any], got: dict[str, Any], *, rtol: float = 1e-6,
                         atol: float = 1e-7) -> None:
    """Every key of ``ref`` is in ``got`` with an equal (within tolerance) value."""
    assert ref["__error__"] is None, f"the scenario failed on MXNet: {ref['__error__']}"
    assert got["__error__"] is None, f"the scenario failed on pskv: {got['__error__']}"
    for key, want in ref.items():
        if key == "__error__":
            continue
        assert key in got, f"pskv's result has no {key!r}"
        if isinstance(want, np.ndarray):
            np.testing.assert_allclose(np.asarray(got[key], dtype=want.dtype), want,
                                       rtol=rtol, atol=atol, err_msg=key)
        else:
            assert got[key] == want, f"{key}: pskv {got[key]!r} != mxnet {want!r}"
