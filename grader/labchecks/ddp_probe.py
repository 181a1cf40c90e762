"""One torchrun rank of a student's DDP conversion (lab 3, PyTorch edition), run with the grader's instruments around
torch.distributed, the data loaders, DDP, the optimizer and file writes.

    torchrun --standalone --nproc_per_node 2 -m scalelab.grader.labchecks.ddp_probe RECORD_DIR SCRIPT [ARGUMENTS...]

The student's script runs unchanged (``runpy``, as ``__main__``); nothing of the harness is in it. Around it the
probe records what the rank did, in ``RECORD_DIR/rank<R>.json``, rewritten after every event so that a rank that
hangs still leaves where it stopped:

- ``init_process_group``: the backend asked for and the group it made (backend, rank, world size), or its error;
- every ``DistributedSampler`` made (its num_replicas, rank, shuffle) and every ``set_epoch``;
- every pass over a ``DataLoader``: its sampler, the sampler's epoch and, for a ``DistributedSampler``, the indices
  it hands out (deterministic: reading them draws no random number of the script's), and the optimizer steps taken
  during the pass: a pass with steps is a training epoch;
- every ``DistributedDataParallel`` made, and how often its forward ran in training;
- every optimizer made (its learning rate per parameter group) and, at each step, the largest rate it used;
- every ``dist.all_reduce`` the script calls, with the tensor's shape and dtype, the operation and where it came
  (after which loader pass). DDP averages the gradients in its C++ reducer, never through ``dist.all_reduce``, and
  calls made by torch's own Python code are left out: what is recorded is the script's own;
- files written: ``torch.save``, ``open`` in a writing mode, ``export_model_atomically``; and every line the
  rank printed to its standard output;
- a digest of the weights at the first step and after each training pass, and at the end.

Nothing here decides a grade: :mod:`ddp_questions` asks its questions of the records.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import inspect
import io
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

MAX_RECORDED_INDICES = 4096
MAX_RECORDED_LINES = 200
MAX_LINE_CHARS = 300
WRITING_MODES = set("wax+")

record: dict = {"rank": None, "launcher_world_size": None, "stage": "starting", "events": [], "init": None,
                "samplers": [], "set_epoch": [], "passes": [], "ddp": [], "ddp_training_forwards": 0,
                "optimizers": [], "steps": 0, "peak_lr": None, "all_reduces": [], "writes": [], "printed": [],
                "weights": {"first_step": None, "after_passes": [], "end": None}, "error": None}
_record_path: Path | None = None
_real_open = io.open
_writing_depth = 0            # inside a recorded write: the files it opens are part of it
_sampler_ids: dict[int, int] = {}
_open_pass: dict | None = None
_stepped_optimizer = None


def save() -> None:
    if _record_path is None:
        return
    partial = _record_path.with_suffix(".partial")
    with _real_open(partial, "w") as out:
        out.write(json.dumps(record, default=str))
    os.replace(partial, _record_path)


def reached(stage: str) -> None:
    record["stage"] = stage
    record["events"].append([round(time.monotonic(), 3), stage])
    save()


def called_by_torch() -> bool:
    """True when the caller of the instrumented function is PyTorch's own code, not the script (or its helpers)."""
    frame = inspect.currentframe().f_back.f_back
    module = frame.f_globals.get("__name__", "") if frame else ""
    return module.split(".")[0] == "torch"


def weights_digest(optimizer) -> str | None:
    if optimizer is None:
        return None
    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def dataset_size(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an iterable dataset has no length
        return None


def close_open_pass() -> None:
    """The steps of the loader pass that ran last: a pass is over when the next one starts or the script ends."""
    global _open_pass
    if _open_pass is not None:
        _open_pass["steps"] = record["steps"] - _open_pass.pop("steps_before")
        if _open_pass["steps"]:
            record["weights"]["after_passes"].append(weights_digest(_stepped_optimizer))
        _open_pass = None


class PrintedLines:
    """The rank's standard output, passed on as it is, each whole line also recorded."""

    def __init__(self, stream):
        self._stream, self._pending = stream, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        if lines:
            room = MAX_RECORDED_LINES - len(record["printed"])
            record["printed"].extend(line[:MAX_LINE_CHARS] for line in lines[:max(0, room)])
            save()
        return written

    def __getattr__(self, name):
        return getattr(self._stream, name)


# ------------------------------------------------------------------------------------------- torch.distributed

def instrument_distributed() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    real_init, real_all_reduce = dist.init_process_group, dist.all_reduce
    init_signature = inspect.signature(real_init)
    reduce_signature = inspect.signature(real_all_reduce)

    def init_process_group(*args, **kwargs):
        asked = init_signature.bind(*args, **kwargs).arguments.get("backend")
        calls = (record["init"] or {}).get("calls", 0) + 1
        record["init"] = {"backend_asked": None if asked is None else str(asked), "calls": calls}
        reached("init_process_group")
        try:
            result = real_init(*args, **kwargs)
        except Exception as error:
            record["init"]["failed"] = f"{type(error).__name__}: {error}"[:500]
            reached("init_process_group failed")
            raise
        record["init"].update(backend=str(dist.get_backend()), rank=dist.get_rank(),
                              world_size=dist.get_world_size())
        reached("joined the process group")
        return result

    def all_reduce(*args, **kwargs):
        if called_by_torch():
            return real_all_reduce(*args, **kwargs)
        arguments = reduce_signature.bind(*args, **kwargs).arguments
        tensor, op = arguments.get("tensor"), arguments.get("op", dist.ReduceOp.SUM)
        record["all_reduces"].append({
            "shape": list(getattr(tensor, "shape", [])), "dtype": str(getattr(tensor, "dtype", "")),
            "op": str(op).rsplit(".", 1)[-1], "passes_started": len(record["passes"]), "steps": record["steps"]})
        reached(f"all_reduce {len(record['all_reduces'])}")
        return real_all_reduce(*args, **kwargs)

    for module in (dist, distributed_c10d):
        module.init_process_group, module.all_reduce = init_process_group, all_reduce


# ------------------------------------------------------------------------------------------------- data

def instrument_data() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    real_sampler_init, real_set_epoch, real_iter = (DistributedSampler.__init__, DistributedSampler.set_epoch,
                                                    DataLoader.__iter__)

    def sampler_init(self, *args, **kwargs):
        real_sampler_init(self, *args, **kwargs)
        _sampler_ids[id(self)] = len(record["samplers"])
        record["samplers"].append({"num_replicas": self.num_replicas, "rank": self.rank, "shuffle": self.shuffle,
                                   "seed": self.seed, "drop_last": self.drop_last,
                                   "dataset_size": dataset_size(self.dataset)})
        reached("DistributedSampler made")

    def set_epoch(self, epoch):
        record["set_epoch"].append({"sampler": _sampler_ids.get(id(self)), "epoch": epoch})
        reached(f"set_epoch({epoch})")
        return real_set_epoch(self, epoch)

    def iterate(self):
        global _open_pass
        close_open_pass()
        sampler = getattr(self.batch_sampler, "sampler", self.sampler)
        entry = {"loader": id(self), "sampler": type(sampler).__name__, "sampler_id": _sampler_ids.get(id(sampler)),
                 "distributed": isinstance(sampler, DistributedSampler),
                 "sampler_epoch": getattr(sampler, "epoch", None), "dataset_size": dataset_size(self.dataset),
                 "indices": None, "batches": 0, "steps": None, "steps_before": record["steps"]}
        if isinstance(sampler, DistributedSampler):
            entry.update(num_replicas=sampler.num_replicas, sampler_rank=sampler.rank, shuffle=sampler.shuffle)
            # Its order depends only on its seed and epoch: listing it again draws nothing from the script's RNG.
            entry["indices"] = [int(index) for index in sampler][:MAX_RECORDED_INDICES]
        record["passes"].append(entry)
        _open_pass = entry
        reached(f"loader pass {len(record['passes'])}")
        for batch in real_iter(self):
            entry["batches"] += 1
            yield batch

    DistributedSampler.__init__, DistributedSampler.set_epoch = sampler_init, set_epoch
    DataLoader.__iter__ = iterate


# ------------------------------------------------------------------------------------- DDP and the optimizer

def instrument_model_and_optimizer() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    real_ddp_init, real_forward, real_optimizer_init = (DistributedDataParallel.__init__,
                                                        DistributedDataParallel.forward, torch.optim.Optimizer.__init__)

    def ddp_init(self, module, *args, **kwargs):
        record["ddp"].append({"module": type(module).__name__, "group_ready": dist.is_initialized()})
        reached("DistributedDataParallel")
        return real_ddp_init(self, module, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            record["ddp_training_forwards"] += 1
        return real_forward(self, *args, **kwargs)

    def optimizer_init(self, *args, **kwargs):
        real_optimizer_init(self, *args, **kwargs)
        record["optimizers"].append({"type": type(self).__name__,
                                     "lrs": [float(group["lr"]) for group in self.param_groups]})
        reached(f"{type(self).__name__} made")

    def before_step(optimizer, args, kwargs):
        global _stepped_optimizer
        _stepped_optimizer = optimizer
        record["steps"] += 1
        if record["steps"] == 1:
            record["weights"]["first_step"] = weights_digest(optimizer)
        rate = max(float(group["lr"]) for group in optimizer.param_groups)
        record["peak_lr"] = rate if record["peak_lr"] is None else max(record["peak_lr"], rate)
        reached(f"step {record['steps']}")

    DistributedDataParallel.__init__, DistributedDataParallel.forward = ddp_init, forward
    torch.optim.Optimizer.__init__ = optimizer_init
    register_optimizer_step_pre_hook(before_step)


# ----------------------------------------------------------------------------------------------- writes

def note_write(how: str, target) -> None:
    if isinstance(target, (str, os.PathLike)):
        path = str(Path(os.fspath(target)).resolve())
    elif isinstance(getattr(target, "name", None), str):
        path = target.name
    else:
        return  # a buffer in memory (io.BytesIO): no file
    if _record_path is not None and path.startswith(str(_record_path.parent.resolve())):
        return
    record["writes"].append({"how": how, "path": path})
    reached(f"{how} {Path(path).name}")


@contextlib.contextmanager
def one_write(how: str, target):
    global _writing_depth
    if _writing_depth == 0:
        note_write(how, target)
    _writing_depth += 1
    try:
        yield
    finally:
        _writing_depth -= 1


def instrument_writes() -> None:
    import torch
    from torch import serialization

    from scalelab import torch_models

    real_save, real_export = torch.save, torch_models.export_model_atomically

    def opening(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and WRITING_MODES.intersection(str(mode)) and not called_by_torch():
            with one_write("open", file):
                return _real_open(file, mode, *args, **kwargs)
        return _real_open(file, mode, *args, **kwargs)

    def torch_save(obj, f, *args, **kwargs):
        with one_write("torch.save", f):
            return real_save(obj, f, *args, **kwargs)

    def export_model_atomically(model, path, *args, **kwargs):
        with one_write("export_model_atomically", path):
            return real_export(model, path, *args, **kwargs)

    builtins.open = io.open = opening
    torch.save = serialization.save = torch_save
    torch_models.export_model_atomically = export_model_atomically


def main(argv: list[str]) -> int:
    global _record_path
    if len(argv) < 2:
        print("usage: torchrun ... -m scalelab.grader.labchecks.ddp_probe RECORD_DIR SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    record_dir, script, script_args = Path(argv[0]), argv[1], argv[2:]
    record["rank"] = int(os.environ.get("RANK", -1))
    record["launcher_world_size"] = int(os.environ.get("WORLD_SIZE", 0)) or None
    _record_path = record_dir / f"rank{record['rank']}.json"
    reached("importing torch")
    instrument_distributed()
    instrument_data()
    instrument_model_and_optimizer()
    instrument_writes()
    sys.stdout = PrintedLines(sys.stdout)
    reached("running the script")
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else (0 if leaving.code is None else 1)
        if code:
            close_open_pass()
            record["error"] = f"the script exited with status {code}"
            reached("exited")
            return code
    except BaseException as error:  # the student's error, recorded where the questions can name it
        close_open_pass()
        record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
        reached("raised an exception")
        return 1
    close_open_pass()
    record["weights"]["end"] = weights_digest(_stepped_optimizer)
    reached("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
