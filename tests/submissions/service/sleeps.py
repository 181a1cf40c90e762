"""A submission that only sleeps: it keeps a job "running" long enough to stop the server under it."""
import time

time.sleep(600)
