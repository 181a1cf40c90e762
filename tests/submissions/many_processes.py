"""Spawns processes until it is refused, each in a session of its own so it outlives the job's group."""
import subprocess
import sys

children = 0
try:
    for _ in range(5000):
        subprocess.Popen(["sleep", "3141"], start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        children += 1
except OSError as error:
    print(f"spawned {children} processes, then refused: {error}", flush=True)
else:
    print(f"spawned {children} processes, never refused", flush=True)
sys.exit(0)
