"""Ratios, targets and tables of ``bench_embeddings.py`` (pure functions of its JSON).

Ratios are taken within one run: pskv's time per step over the NumPy ceiling's, and
pskv's steps/s over each peer's (= the peer's time per step over pskv's), so machine
speed cancels and load falls on every system alike.
"""
from __future__ import annotations

from typing import Any

import _common

__all__ = ["ISSUE", "TARGETS", "markdown", "ratios", "summary", "targets"]

#: the issue's own figures (quiet machine, N = 1e6, Zipf), ms per step, for reference
ISSUE = {"numpy train (1 process)": 2.4, "FBGEMM CPU train (1 process)": 2.1,
         "pskv row_sparse, local (1 process)": 7.4,
         "pskv row_sparse, dist_sync 2 workers 2 servers": 25.0,
         "TorchRec DMP over gloo, 2 processes": 17.0, "DGL DistEmbedding, 2 trainers": 86.0}

#: target name -> (goal, description)
TARGETS = {
    "local_train": (1.5, "one process: pskv lookup + AdaGrad time <= 1.5 x the NumPy "
                         "ceiling's"),
    "memory": (1.3, "memory per row <= 1.3 x (row + AdaGrad state + 8-byte ID)"),
    "dist_vs_torchrec": (4.0, "2 workers: pskv train steps/s >= 4 x TorchRec DMP (gloo, "
                              "2 processes)"),
    "dist_vs_dgl": (4.0, "2 workers: pskv train steps/s >= 4 x DGL DistEmbedding "
                         "(2 trainers)"),
}

PHASES = ("lookup", "train", "insert")
DIST_PEERS = {"dist_vs_torchrec": "torchrec-dmp-w2", "dist_vs_dgl": "dgl-dist-t2"}


def _ms(case: dict[str, Any], system: str, phase: str) -> float | None:
    return (case.get("ms_per_batch", {}).get(system, {}).get(phase) or {}).get("median")


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ratios(data: dict[str, Any]) -> dict[str, Any]:
    """Per case: pskv time / NumPy ceiling time, and pskv steps/s / each peer's."""
    out: dict[str, Any] = {"local": {}, "dist": {}}
    for name, case in data.get("local", {}).items():
        r: dict[str, Any] = {}
        for phase in PHASES:
            r[f"{phase}: pskv/numpy time"] = _div(_ms(case, "pskv", phase),
                                                  _ms(case, "numpy", phase))
        for system in case.get("ms_per_batch", {}):
            if system in ("pskv", "numpy"):
                continue
            for phase in ("lookup", "train"):
                r[f"{phase}: pskv/{system} steps/s"] = _div(_ms(case, system, phase),
                                                            _ms(case, "pskv", phase))
        out["local"][name] = r
    for name, case in data.get("dist", {}).items():
        r = {}
        for label in case.get("ms_per_batch", {}):
            if not label.startswith("pskv"):
                continue
            for peer in DIST_PEERS.values():
                r[f"{label} / {peer} train steps/s"] = _div(_ms(case, peer, "train"),
                                                            _ms(case, label, "train"))
        out["dist"][name] = r
    return out


def _verdict(ratio: float | None, goal: float, lower_is_better: bool) -> str:
    if ratio is None:
        return "n/a"
    ok = ratio <= goal if lower_is_better else ratio >= goal
    return "PASS" if ok else "MISS"


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each PASS, MISS or n/a (a report, never an assert)."""
    rows = []
    for name, case in data.get("local", {}).items():
        goal, desc = TARGETS["local_train"]
        ratio = _div(_ms(case, "pskv", "train"), _ms(case, "numpy", "train"))
        rows.append({"case": name, "target": desc, "where": "local", "ratio": ratio,
                     "verdict": _verdict(ratio, goal, True)})
        goal, desc = TARGETS["memory"]
        mem = case.get("memory", {})
        ratio = mem.get("rss_over_reference")
        rows.append({"case": name, "target": desc + " (resident growth)", "where": "local",
                     "ratio": ratio, "verdict": _verdict(ratio, goal, True)})
    for name, case in data.get("dist", {}).items():
        labels = sorted(set(case.get("jobs", {})) | {k for k in case.get("ms_per_batch", {})
                                                     if k.startswith("pskv")})
        for label in labels:
            unsupported = bool(case.get("jobs", {}).get(label, {}).get("unsupported"))
            for tname, peer in DIST_PEERS.items():
                goal, desc = TARGETS[tname]
                ratio = _div(_ms(case, peer, "train"), _ms(case, label, "train"))
                rows.append({"case": name, "target": desc, "where": label, "ratio": ratio,
                             "verdict": "not supported yet" if unsupported
                             else _verdict(ratio, goal, False)})
    return rows


# ---- tables -------------------------------------------------------------------------------
def _f(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _per_s(ms: float | None, per_step: float) -> str:
    return "n/a" if not ms else f"{per_step * 1e3 / ms:,.0f}"


def local_table(data: dict[str, Any], name: str, md: bool) -> str:
    case = data["local"][name]
    b = data["workload"]["batch"]
    header = ["system", "lookup ms/step", "lookups/s", "train ms/step", "train steps/s",
              "insert ms/step", "inserts/s", "train: pskv time / this",
              "train: pskv steps/s / this"]
    rows = []
    pskv_train = _ms(case, "pskv", "train")
    for system in case.get("ms_per_batch", {}):
        lk, tr, ins = (_ms(case, system, p) for p in PHASES)
        rows.append([system, _f(lk, 3), _per_s(lk, b), _f(tr, 3), _per_s(tr, 1), _f(ins, 3),
                     _per_s(ins, b), _f(_div(pskv_train, tr)), _f(_div(tr, pskv_train))])
    table = _common.md_table if md else _common.text_table
    return table(header, rows)


def memory_table(data: dict[str, Any], md: bool) -> str:
    header = ["case", "rows", "reference B/row", "table B/row", "resident growth B/row",
              "table / ref", "resident / ref", "NumPy ceiling B/row", "fill rows/s"]
    rows = []
    for name, case in data.get("local", {}).items():
        m = case.get("memory", {})
        rows.append([name, f"{m.get('rows', 0):,}", m.get("reference_bytes_per_row"),
                     _f(m.get("table_bytes_per_row"), 1), _f(m.get("rss_bytes_per_row"), 1),
                     _f(m.get("table_over_reference")), _f(m.get("rss_over_reference")),
                     _f(case.get("numpy_bytes_per_row"), 1),
                     _per_s(1e3 * case["fill"]["seconds"] / max(1, m.get("rows", 1)), 1)
                     if case.get("fill") else "n/a"])
    table = _common.md_table if md else _common.text_table
    return table(header, rows)


def dist_table(data: dict[str, Any], name: str, md: bool) -> str:
    case = data["dist"][name]
    b = data["workload"]["batch"]
    header = ["system", "lookup ms/step", "train ms/step", "train steps/s (per worker)",
              "insert ms/step", "inserts/s (per worker)", "server resident B/row",
              "steps/s / TorchRec DMP", "steps/s / DGL"]
    rows = []
    labels = list(dict.fromkeys([*case.get("jobs", {}), *case.get("ms_per_batch", {})]))
    for label in labels:
        info = case.get("jobs", {}).get(label, {})
        if info.get("unsupported"):
            rows.append([label, "not supported yet", "", "", "", "", "", "", ""])
            continue
        lk, tr, ins = (_ms(case, label, p) for p in PHASES)
        rows.append([label, _f(lk, 3), _f(tr, 3), _per_s(tr, 1), _f(ins, 3), _per_s(ins, b),
                     _f(info.get("server_rss_bytes_per_row"), 1),
                     _f(_div(_ms(case, "torchrec-dmp-w2", "train"), tr))
                     if label.startswith("pskv") else "",
                     _f(_div(_ms(case, "dgl-dist-t2", "train"), tr))
                     if label.startswith("pskv") else ""])
    table = _common.md_table if md else _common.text_table
    return table(header, rows)


def cpu_table(data: dict[str, Any], name: str, md: bool) -> str:
    """CPU ms per step of each pskv dist job and phase, by role (summed over processes)."""
    case = data["dist"][name]
    header = ["system", "phase", "total CPU ms/step", "of which kernel", "workers", "servers",
              "scheduler", "worker 0's own (timed steps)"]
    rows = []
    for label, phases in case.get("cpu_ms_per_batch", {}).items():
        for phase, roles in phases.items():
            rows.append([label, phase, _f(roles.get("total"), 3), _f(roles.get("system"), 3),
                         _f(roles.get("worker"), 3),
                         _f(roles.get("server"), 3), _f(roles.get("scheduler"), 3),
                         _f(roles.get("worker0_self"), 3)])
    table = _common.md_table if md else _common.text_table
    return table(header, rows)


def targets_table(data: dict[str, Any], md: bool) -> str:
    header = ["case", "where", "target", "ratio", "verdict"]
    rows = [[t["case"], t["where"], t["target"], _f(t["ratio"]), t["verdict"]]
            for t in data.get("targets", [])]
    table = _common.md_table if md else _common.text_table
    return table(header, rows)


def summary(data: dict[str, Any], markdown: bool) -> str:
    """The figures as tables (no header): per local case, memory, per dist case, targets."""
    parts = []
    h = "### " if markdown else ""
    for name in data.get("local", {}):
        parts += [f"{h}One process, {name}", "", local_table(data, name, markdown), ""]
    if data.get("local"):
        parts += [f"{h}Memory per row (pskv local table, every row trained once)", "",
                  memory_table(data, markdown), ""]
    for name in data.get("dist", {}):
        parts += [f"{h}2 workers, {name}", "", dist_table(data, name, markdown), ""]
        if data["dist"][name].get("cpu_ms_per_batch"):
            parts += [f"{h}2 workers, {name}: CPU per step (all processes; medians)", "",
                      "CPU seconds from /proc/<pid>/stat at the phase's start and end "
                      "markers, over its warm-up and timed steps, divided by the steps; "
                      "a step is one batch on each worker. Less dependent on the machine's "
                      "load than the times above (a busy box still inflates it: shared "
                      "caches); compare runs made side by side.", "",
                      cpu_table(data, name, markdown), ""]
    parts += [f"{h}Targets (the issue's; a report, not an assert)", "",
              targets_table(data, markdown)]
    return "\n".join(parts)


def markdown(data: dict[str, Any]) -> str:
    m, w = data["machine"], data["workload"]
    versions = {}
    for case in data.get("local", {}).values():
        for label, info in case.get("peer_info", {}).items():
            if info.get("versions"):
                versions[label.split("-")[0]] = info["versions"]
    lines = [
        "# bench_embeddings: pskv dynamic tables, the NumPy ceiling and the peers", "",
        f"- command: `{data['command']}`",
        f"- commit: {data['commit']['commit']}"
        f"{' (dirty)' if data['commit']['dirty'] else ''}; run at {data['timestamp']}; "
        f"pskv {data.get('pskv')}",
        f"- machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['mem_total_gib']} GiB, "
        f"{m['platform']}, Python {m['python']}, NumPy {m['numpy']}",
        f"- load average (1, 5, 15 min): {m['loadavg_at_start']} at start, "
        f"{m.get('loadavg_at_end')} at end",
        f"- workload: N = {', '.join(f'{r:,}' for r in w['rows'])} rows x d = {w['dim']} "
        f"float32; B = {w['batch']} IDs per step, {', '.join(w['id_dists'])} "
        f"(Zipf s = {w['zipf_s']}, ranks scattered); AdaGrad lr {w['lr']}, eps {w['eps']}; "
        f"{w['warmup']} warm-up + {w['steps']} timed steps per phase; {w['rounds']} rounds, "
        "systems alternating; figures are medians over rounds",
        f"- peers: TorchRec {'yes' if data['peers']['torchrec'] else 'not given'}, "
        f"DGL {'yes' if data['peers']['dgl'] else 'not given'}; versions: "
        f"{versions or 'n/a'}; threads: {data['threads']}",
        "",
        "Phases: **lookup** reads B rows (pskv: `kv.lookup(key, ids, train=False)`; NumPy: "
        "`np.take`; peers: forward under no_grad); **train** is a training lookup plus the "
        "AdaGrad update of the batch's rows (pskv: `kv.lookup(..., train=True)` + "
        "`kv.push(key, (ids, grad))`; NumPy: take + sort/`reduceat` + element-wise AdaGrad; "
        "peers: forward + backward with the optimizer fused); **insert** is a training "
        "lookup of B never-seen IDs (pskv: rows born; NumPy: a Python dict ID -> slot plus "
        "the new rows written). The peers' optimizers differ (TorchRec row-wise or "
        "element-wise AdaGrad, DGL averages duplicates): the label says which. 2-worker "
        "times are the slowest worker's; steps/s are per worker (each takes B IDs a step).",
        "",
        summary(data, markdown=True), "",
        "The issue's own figures (quiet machine, N = 1e6, Zipf, ms per step): "
        + "; ".join(f"{k} {v}" for k, v in ISSUE.items()) + ".",
    ]
    if data.get("errors"):
        lines += ["", "## Errors", ""]
        lines += [f"- `{k}`: {v.splitlines()[0] if v else v}"
                  for k, v in data["errors"].items()]
    return "\n".join(lines)
