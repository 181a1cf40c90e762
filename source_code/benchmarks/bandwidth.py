"""P6 and the bandwidth sweep, from the runner's side: ``allreduce_bandwidth.py`` under ``horovodrun -np 2``,
once per transport (Gloo, MPI), and the figures computed from what rank 0 wrote.

P6 = allreduce bus bandwidth at 64 MB ÷ single-core memcpy bandwidth, both measured in the same job.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from . import processes
from .summary import spread

P6_MESSAGE_BYTES = 64 << 20
# Sizes of the sweep: 4 KB to 64 MB, each 4× the previous; --quick stops at 1 MB.
FULL_SIZES = [4 ** k * 4096 for k in range(0, 8)]
QUICK_SIZES = [4096, 65536, 1 << 20]
# The transport settings measured: the course's default (Gloo, as the tracks launch); MPI with the course's
# collective rules (scalelab/openmpi-collective-rules.conf: segmented ring from 1 MiB); MPI with Open MPI's own
# fixed decisions, to show what the rules buy in the same run; and MPI with TensorFlow's BFC allocator on the
# CPU, which reuses the 64 MB output buffer instead of faulting in a fresh mmap for every allreduce.
VARIANTS = {
    "gloo": ("gloo", {}),
    "mpi": ("mpi", {}),
    "mpi-fixed": ("mpi", {"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}),
    "mpi+bfc": ("mpi", {"TF_CPU_ALLOCATOR_USE_BFC": "true"}),
}


def measure(variant: str, out_dir: Path, *, sizes, repeats: int, np: int = 2) -> dict:
    """One Horovod job of ``allreduce_bandwidth.py`` with a setting of VARIANTS; returns rank 0's document with
    the figures added."""
    controller, extra_env = VARIANTS[variant]
    result_file = out_dir / f"allreduce_{variant}.json"
    argv = processes.horovodrun(np, controller) + [
        str(processes.BENCHMARKS / "allreduce_bandwidth.py"), "--sizes", ",".join(map(str, sizes)),
        "--repeats", str(repeats), "--json", str(result_file)]
    finished = processes.run(argv, out_dir / f"allreduce_{variant}.log",
                             env=processes.environment(**extra_env), timeout_s=300)
    document = json.loads(result_file.read_text())
    document.update(variant=variant, variant_env=extra_env)
    document["job_wall_s"] = finished.wall_s
    memcpy_median = statistics.median(document["memcpy_gb_per_s"])
    for row in document["sizes"]:
        row["bus_gb_per_s_spread"] = spread(row["bus_gb_per_s"])
        row["ratio_to_memcpy"] = spread(bw / memcpy_median for bw in row["bus_gb_per_s"])
    document["memcpy_gb_per_s_spread"] = spread(document["memcpy_gb_per_s"])
    return document


def p6_ratio(document: dict, message_bytes: int = P6_MESSAGE_BYTES) -> dict:
    """Bus bandwidth ÷ memcpy bandwidth at ``message_bytes`` (or the largest size measured, named in the result)."""
    rows = {row["message_bytes"]: row for row in document["sizes"]}
    size = message_bytes if message_bytes in rows else max(rows)
    figure = dict(rows[size]["ratio_to_memcpy"])
    figure["message_bytes"] = size
    figure["bus_gb_per_s"] = rows[size]["bus_gb_per_s_spread"]
    figure["memcpy_gb_per_s"] = document["memcpy_gb_per_s_spread"]
    figure["controller"] = document["controller"]
    figure["variant"] = document.get("variant", document["controller"])
    figure["variant_env"] = document.get("variant_env", {})
    return figure


def ideal_bound(out_dir: Path, message_bytes: int, repeats: int) -> dict:
    """``allreduce_bound.py``: the P6 ratio of an ideal shared-memory allreduce on this machine."""
    result_file = out_dir / "allreduce_bound.json"
    argv = [sys.executable, str(processes.BENCHMARKS / "allreduce_bound.py"), "--bytes", str(message_bytes),
            "--repeats", str(repeats), "--json", str(result_file)]
    processes.run(argv, out_dir / "allreduce_bound.log", timeout_s=120)
    document = json.loads(result_file.read_text())
    return {"message_bytes": message_bytes, "ratio": spread(document["ratio"]),
            "allreduce_s": spread(document["allreduce_s"]), "memcpy_s": spread(document["memcpy_s"])}
