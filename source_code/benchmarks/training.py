"""P1, P2, P10 and the batch-size sweep: the course's own training scripts timed against a bare training step.

- P1 = img/s of ``source_code/fashion_mnist.py`` (its own ``Throughput`` callback, training steps only)
  ÷ img/s of ``train_step_throughput.py`` (same model, in-memory data), batch 128.
- P2 = img/s of ``source_code/fashion_mnist_horovod.py`` under ``horovodrun -np 2 --mpi`` (1 intra-op thread
  per rank, set by the script; Open MPI's idle threads yield, as ``processes.environment`` sets) ÷ img/s of
  ``fashion_mnist.py`` (1 process, TensorFlow's 2 threads), same model, same global batch (64 × 2 = 128).
  MPI, not Gloo: on 2 cores Gloo's loopback TCP costs the ranks more (about 0.8 against 1.0 here; see the README).
- P10 = img/s of the PyTorch reference solution (one DDP rank under ``torchrun``, on the GPU where there is one)
  ÷ img/s of ``train_step_throughput_torch.py`` (same model and batch, the data already on the device).
P1 and P2's three programs (P10's two) run in turn, once per repeat; each ratio is taken within a repeat and its
spread is over repeats. The first epoch of every script (tracing, warm-up) is dropped.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from . import processes
from .summary import run_in_turn, spread

# Under horovodrun every line starts with the rank's prefix: "[0]<stdout>:" (Gloo) or "[1,0]<stdout>:" (MPI).
IMAGES_PER_S = re.compile(r"^(?:\[[\d,]+\]<stdout>:)?epoch (\d+)/\d+.*\bimg/s (\d+)", re.MULTILINE)
GLOBAL_BATCH = 128


def epoch_throughputs(output: str) -> list[float]:
    """img/s of every epoch after the first, from the course scripts' epoch lines."""
    return [float(rate) for epoch, rate in IMAGES_PER_S.findall(output) if int(epoch) > 1]


def course_script_args(epochs: int, train_images: int, out_dir: Path) -> list[str]:
    # A target above 1 so the run never stops early; few validation images, since validation is not timed.
    return ["--epochs", str(epochs), "--train-images", str(train_images), "--val-images", "1024",
            "--target-accuracy", "1.01", "--output-dir", str(out_dir)]


def serial_script(out_dir: Path, tag: str, epochs: int, train_images: int) -> list[float]:
    argv = [sys.executable, str(processes.SOURCE_CODE / "fashion_mnist.py"),
            "--batch-size", str(GLOBAL_BATCH)] + course_script_args(epochs, train_images, out_dir / f"ckpt_{tag}")
    finished = processes.run(argv, out_dir / f"fashion_mnist_{tag}.log", timeout_s=400)
    return epoch_throughputs(finished.output)


def horovod_script(out_dir: Path, tag: str, epochs: int, train_images: int, np: int = 2,
                   controller: str = "mpi") -> list[float]:
    argv = processes.horovodrun(np, controller) + [
        str(processes.SOURCE_CODE / "fashion_mnist_horovod.py"), "--batch-size", str(GLOBAL_BATCH // np)
    ] + course_script_args(epochs, train_images, out_dir / f"ckpt_{tag}")
    finished = processes.run(argv, out_dir / f"fashion_mnist_horovod_{tag}.log", timeout_s=400)
    return epoch_throughputs(finished.output)


def bare_step(out_dir: Path, tag: str, batch_sizes, repeats: int, *, steps: int = 0,
              images: int = 0) -> dict[int, list[float]]:
    """img/s of the bare step per batch size: ``steps`` steps per repeat, or ``images`` images' worth."""
    result_file = out_dir / f"train_step_{tag}.json"
    argv = [sys.executable, str(processes.BENCHMARKS / "train_step_throughput.py"),
            "--batch-sizes", ",".join(map(str, batch_sizes)),
            *(["--steps", str(steps)] if steps else ["--images-per-repeat", str(images)]),
            "--repeats", str(repeats), "--json", str(result_file)]
    processes.run(argv, out_dir / f"train_step_{tag}.log", timeout_s=400)
    return {row["batch_size"]: row["images_per_s"] for row in json.loads(result_file.read_text())["results"]}


def measure(out_dir: Path, *, repeats: int, epochs: int, train_images: int, steps: int,
            with_horovod: bool = True, log=print) -> dict:
    """P1 and P2 with their raw samples; every ratio within one repeat (median of its epochs or steps)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = {"bare": [], "serial": [], "horovod": []}
    p1, p2 = [], []
    for repeat in range(repeats):
        tag = f"r{repeat}"
        programs = {"bare": lambda: bare_step(out_dir, tag, [GLOBAL_BATCH], 3, steps=steps)[GLOBAL_BATCH],
                    "serial": lambda: serial_script(out_dir, tag, epochs, train_images)}
        if with_horovod:
            programs["horovod"] = lambda: horovod_script(out_dir, tag, epochs, train_images)
        rates = run_in_turn(programs, repeat)
        for name, rate in rates.items():
            samples[name].append(rate)
        medians = {name: statistics.median(rate) for name, rate in rates.items()}
        p1.append(medians["serial"] / medians["bare"])
        line = f"  repeat {repeat + 1} ({' → '.join(rates)}): bare {medians['bare']:.0f} img/s, " \
               f"course script {medians['serial']:.0f} img/s"
        if with_horovod:
            p2.append(medians["horovod"] / medians["serial"])
            line += f", horovodrun -np 2 --mpi {medians['horovod']:.0f} img/s"
        log(line)
    return {
        "P1": spread(p1),
        "P2": spread(p2) if with_horovod else None,
        "images_per_s": {name: spread(statistics.median(s) for s in runs) for name, runs in samples.items()},
        "raw": samples,
        "settings": {"global_batch": GLOBAL_BATCH, "epochs": epochs, "train_images": train_images,
                     "bare_steps": steps, "repeats": repeats},
    }


def batch_sweep(out_dir: Path, batch_sizes, images: int, repeats: int) -> list[dict]:
    """img/s of the bare step at each batch size (one process, so the sizes are comparable), each repeat
    ``images`` images' worth of steps."""
    rates = bare_step(out_dir, "sweep", batch_sizes, repeats, images=images)
    return [{"batch_size": size, "images_per_s": spread(rates[size])} for size in batch_sizes]


# P10: the PyTorch edition's P1, on the GPU where there is one.
TORCH_BATCH = 64  # the PyTorch reference's batch per rank on CIFAR-10


def torch_reference(out_dir: Path, tag: str, epochs: int) -> list[float]:
    """img/s of the PyTorch reference solution (assessment/solution/assessment_pytorch.py on CIFAR-10) as one DDP
    rank under torchrun, by its own epoch lines (the training loop only), every epoch after the first."""
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--standalone", "--nproc_per_node", "1",
            str(processes.COURSE_ROOT / "assessment" / "solution" / "assessment_pytorch.py"), "--epochs", str(epochs)]
    env = processes.environment(SCALELAB_DATASET="cifar10", SCALELAB_OUTPUT_DIR=str(out_dir / f"torch_ref_{tag}"))
    finished = processes.run(argv, out_dir / f"torch_reference_{tag}.log", env=env, timeout_s=900)
    return epoch_throughputs(finished.output)


def torch_bare_step(out_dir: Path, tag: str, steps: int, device: str | None = None) -> dict:
    """img/s of the bare PyTorch step (train_step_throughput_torch.py), 3 repeats of ``steps`` steps, and the
    device it ran on."""
    result_file = out_dir / f"torch_step_{tag}.json"
    argv = [sys.executable, str(processes.BENCHMARKS / "train_step_throughput_torch.py"),
            "--batch-size", str(TORCH_BATCH), "--steps", str(steps), "--json", str(result_file),
            *(["--device", device] if device else [])]
    processes.run(argv, out_dir / f"torch_step_{tag}.log", timeout_s=600)
    return json.loads(result_file.read_text())


def measure_torch(out_dir: Path, *, repeats: int, epochs: int, steps: int, log=print) -> dict:
    """P10 = the reference's img/s ÷ the bare step's, same model and batch, each ratio within one repeat."""
    out_dir.mkdir(parents=True, exist_ok=True)
    samples, ratios, device = {"bare": [], "reference": []}, [], None
    for repeat in range(repeats):
        tag = f"r{repeat}"
        rates = run_in_turn({"bare": lambda: torch_bare_step(out_dir, tag, steps),
                             "reference": lambda: torch_reference(out_dir, tag, epochs)}, repeat)
        device = rates["bare"]["device_name"]
        rates["bare"] = rates["bare"]["images_per_s"]
        if not rates["reference"]:
            raise processes.BenchmarkError(f"the PyTorch reference printed no epoch after the first "
                                           f"(--epochs {epochs}); log {out_dir / f'torch_reference_{tag}.log'}")
        for name, rate in rates.items():
            samples[name].append(rate)
        medians = {name: statistics.median(rate) for name, rate in rates.items()}
        ratios.append(medians["reference"] / medians["bare"])
        log(f"  repeat {repeat + 1} on {device}: bare step {medians['bare']:.0f} img/s, "
            f"the reference under torchrun {medians['reference']:.0f} img/s")
    return {
        "P10": spread(ratios),
        "device": device,
        "images_per_s": {name: spread(statistics.median(s) for s in runs) for name, runs in samples.items()},
        "raw": samples,
        "settings": {"batch": TORCH_BATCH, "epochs": epochs, "bare_steps": steps, "repeats": repeats},
    }
