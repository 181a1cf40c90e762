"""A submission that sleeps a minute, then fails: long enough to stop the service under its run, short enough
for the run to be graded again from scratch after the restart."""
import time

time.sleep(60)
raise SystemExit("slept a minute; trained nothing")
