"""A submission that sleeps 12 s, then fails: long enough to stop the service under its run, short enough for the
run to be graded again from scratch after the restart."""
import time

time.sleep(12)
raise SystemExit("slept 12 s; trained nothing")
