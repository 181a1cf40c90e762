"""Rank 0 leaves traps where the grader reads after the run: the timeline and the model become named pipes (an
open never returns), links to /dev/zero (a read never ends), or the model a link to someone else's model."""
import os

TRAP = "@@TRAP@@"          # fifo | zero | other
OTHER_MODEL = "@@OTHER@@"  # a real model outside the job directory, for "other"

if int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
    model = os.path.join(os.environ["SCALELAB_OUTPUT_DIR"], "model.keras")
    for path in ("timeline.json", model):
        if os.path.lexists(path):
            os.remove(path)
        if TRAP == "fifo":
            os.mkfifo(path, 0o666)
        elif TRAP == "zero":
            os.symlink("/dev/zero", path)
    if TRAP == "other":
        os.symlink(OTHER_MODEL, model)
