"""Takes what the grading machine shares with the service: processes until refused (each in a session of its own,
to outlive its rank), then /dev/shm (memory) until refused. Prints how far it got, holds on a few seconds, fails."""
import errno
import os
import subprocess
import time

children = 0
try:
    for _ in range(5000):
        subprocess.Popen(["sleep", "3142"], start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        children += 1
    print(f"spawned {children} processes, never refused", flush=True)
except OSError as error:
    print(f"spawned {children} processes, then refused: {error}", flush=True)

written, chunk = 0, b"\0" * (16 * 1024**2)
try:
    with open(f"/dev/shm/filler-{os.getpid()}", "wb") as handle:
        while written < 1024**3:
            handle.write(chunk)
            handle.flush()
            written += len(chunk)
    outcome = "never refused"
except OSError as error:
    outcome = f"refused with {errno.errorcode.get(error.errno, error.errno)}"
print(f"wrote {written // 1024**2} MiB to /dev/shm, {outcome}", flush=True)
time.sleep(5)
raise SystemExit(1)
