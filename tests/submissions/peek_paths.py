"""Tries to read each path below from inside the run and prints what it found; reads nothing else."""
import os

PATHS = @@PATHS@@

if int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
    for path in PATHS:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                open(path, "rb").close()
            print(f"SEEN {path}", flush=True)
        except OSError as error:
            print(f"ABSENT {path} ({type(error).__name__})", flush=True)
