"""A submission that sleeps 25 s, then fails: long enough to stop the service under its run, short enough for the
run to be graded again from scratch after the restart."""
import time

time.sleep(25)
raise SystemExit("slept 25 s; trained nothing")
