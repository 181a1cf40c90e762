#!/usr/bin/env bash
# The PyTorch edition's GPU checks on a machine that has NVIDIA GPUs and a Python with PyTorch, and nothing of the
# course: no ScaleLab, no bubblewrap, no network (the GPU machine ../shared/ENVIRONMENT.md describes, which gets a
# copy of this checkout and up to 64 MiB of carried files). Two steps:
#
#   containers/gpu-check.sh --pack DIR
#       here, with a network: put into DIR what such a machine lacks: Debian's bubblewrap package, the setuptools
#       and wheel wheels (an editable install without build isolation needs them) and the CIFAR-10 folder
#       SCALELAB_CIFAR10_DIR names (data/cifar10). DIR is then carried, e.g. .gpu-carry (git ignores it).
#   containers/gpu-check.sh --run DIR OUT [--tracks T1,T2] [--runs N] [--no-bench]
#       there: install this checkout into the machine's Python (SCALELAB_PYTHON, else python3) as an editable
#       package without dependencies (its PyTorch, NumPy and psutil stay), bubblewrap from DIR where the machine has
#       none, then grade through the grader and its sandbox: `scalelab calibrate --runs N --record` (default 5, the
#       calibration's minimum) on each track, and benchmark P10 (the PyTorch reference's images/s against a bare
#       PyTorch step of the same model on the same device). The default tracks are containers/gpu-check-tracks.toml's:
#       one rank per GPU over NCCL, and two ranks sharing a one-GPU machine's GPU over Gloo. Figures, logs and the
#       track file with the calibrations recorded go to OUT; each step has a deadline, and a failed step does not
#       stop the others. OUT gets gpu-check.log (all of it), tracks.toml (the copy with the calibrations recorded),
#       bench-report.md and .json, and runs.tar.gz (each run's verdict, curve and logs, without the models).
#
# The carried CIFAR-10 is the 5,170-image subset, where the course's GPU track (cifar10-ddp, target 0.75 on the full
# set) cannot be reached: the check tracks ask the subset's target (0.50, as the CPU tracks do), so their figures
# say how the GPU path grades and how fast it trains, not what budget the full data set needs.
# Exit codes: 0 every step passed; 1 a step failed (its log says why); 2 bad usage.
set -euo pipefail

project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() {
    sed -n '5,/runs.tar.gz/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

pack() {
    local dir="$1"
    if [ -z "${SCALELAB_CIFAR10_DIR:-}" ] || [ ! -d "$SCALELAB_CIFAR10_DIR" ]; then
        echo "gpu-check.sh: SCALELAB_CIFAR10_DIR must name the CIFAR-10 folder to carry" >&2
        exit 2
    fi
    mkdir -p "$dir/data"
    (cd "$dir" && apt-get download bubblewrap)
    python3 -m pip download --quiet --no-deps --dest "$dir" "setuptools==80.9.0" "wheel==0.48.0"
    rm -rf "$dir/data/cifar10"
    cp -r "$SCALELAB_CIFAR10_DIR" "$dir/data/cifar10"
    du -sh "$dir"
}

# Run "$@" with a deadline, its output in the work folder's logs/NAME.log and the end of it on stdout; record a
# failure without stopping.
failed=()
step() {
    local name="$1" deadline="$2"
    shift 2
    echo "== $name (deadline ${deadline} s): $*"
    local started=$SECONDS status=0
    timeout --kill-after=10 "$deadline" "$@" >"$work/logs/$name.log" 2>&1 || status=$?
    tail -n 25 "$work/logs/$name.log"
    echo "== $name: exit $status in $((SECONDS - started)) s"
    if [ "$status" != 0 ]; then
        failed+=("$name (exit $status)")
    fi
}

run() {
    local carried out tracks="cifar10-ddp-subset-nccl,cifar10-ddp-subset-shared" runs=5 bench=1
    carried="$(cd "$1" && pwd)"
    mkdir -p "$2"
    out="$(cd "$2" && pwd)"
    shift 2
    while [ $# -gt 0 ]; do
        case "$1" in
            --tracks) tracks="$2"; shift 2 ;;
            --runs) runs="$2"; shift 2 ;;
            --no-bench) bench=0; shift ;;
            *) usage ;;
        esac
    done
    # OUT gets a few flat files (what a lent machine sends back is limited); the runs work beside it.
    work="${TMPDIR:-/tmp}/scalelab-gpu-check"
    rm -rf "$work"
    mkdir -p "$work/logs"
    exec > >(tee "$out/gpu-check.log") 2>&1
    local python="${SCALELAB_PYTHON:-python3}"
    export SCALELAB_CIFAR10_DIR="$carried/data/cifar10" SCALELAB_HOME="$work/home"
    # The grader counts the GPUs with nvidia-smi, which a driver mounted into a container may keep off PATH.
    if ! command -v nvidia-smi >/dev/null && [ -x /usr/local/nvidia/bin/nvidia-smi ]; then
        export PATH="$PATH:/usr/local/nvidia/bin"
    fi

    # The machine as the grader will see it.
    "$python" - <<'PY'
import os, sys
import numpy, torch
print("python", sys.version.split()[0], "at", sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "numpy", numpy.__version__)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None, "cpus", os.cpu_count())
PY
    nvidia-smi -L || true

    if ! command -v bwrap >/dev/null; then
        rm -rf "$carried/bubblewrap"
        dpkg -x "$carried"/bubblewrap_*.deb "$carried/bubblewrap"
        export PATH="$carried/bubblewrap/usr/bin:$PATH"
    fi
    bwrap --version
    if ! "$python" -c 'import setuptools, wheel' 2>/dev/null; then
        "$python" -m pip install --quiet --no-index --no-deps "$carried"/setuptools-*.whl "$carried"/wheel-*.whl
    fi
    # Only the course itself: the machine's PyTorch, NumPy and psutil stay as they are.
    "$python" -m pip install --quiet --no-index --no-deps --no-build-isolation --editable "$project_root"
    "$python" -m scalelab.cli doctor || true

    # calibrate --record writes into this copy, with the check tracks added.
    cat "$project_root/assessment/tracks.toml" "$project_root/containers/gpu-check-tracks.toml" >"$out/tracks.toml"
    local track
    IFS=, read -r -a track_list <<<"$tracks"
    for track in "${track_list[@]}"; do
        step "calibrate-$track" 420 "$python" -m scalelab.cli calibrate --track "$track" \
            --track-file "$out/tracks.toml" --runs "$runs" --out "$work/calibration/$track" --record
    done
    if [ "$bench" = 1 ]; then
        step bench-training-torch 300 env PYTHONPATH="$project_root/source_code" \
            "$python" -m benchmarks.run --only training-torch --out "$work/bench"
        cp "$work/bench/report.md" "$out/bench-report.md" 2>/dev/null || true
        cp "$work/bench/report.json" "$out/bench-report.json" 2>/dev/null || true
    fi
    # The runs' verdicts, curves and logs, without the saved models (of the folders the steps made).
    local made=()
    for folder in logs calibration bench; do
        if [ -d "$work/$folder" ]; then
            made+=("$folder")
        fi
    done
    tar -czf "$out/runs.tar.gz" -C "$work" --exclude='*.pt2' "${made[@]}"
    if [ ${#failed[@]} -gt 0 ]; then
        printf 'failed: %s\n' "${failed[@]}"
        exit 1
    fi
    echo "every step passed; results in $out"
}

case "${1:-}" in
    --pack) [ $# = 2 ] || usage; pack "$2" ;;
    --run) [ $# -ge 3 ] || usage; shift; run "$@" ;;
    *) usage ;;
esac
