"""Every rank starts a background process that outlives it, then ends at once (saving no model): the rank's
stray child keeps horovodrun's output pipe open, so horovodrun itself would wait for it."""
import subprocess

subprocess.Popen(["sleep", "3141"])
print("rank done, leaving a sleep behind", flush=True)
