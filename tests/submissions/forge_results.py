"""Tries to cheat from inside the run: read held-out data and the grader's files, forge verdicts and progress.

The test replaces the @@...@@ markers with the real paths of this grading run before submitting it. Every
attempt prints one line, OPENED/WROTE when it worked and BLOCKED when it did not; it trains nothing.
"""
import json
import os
import socket
from pathlib import Path

FORGED = {"verdict": "pass", "heldout_accuracy": 0.99, "reasons": ["forged"]}
targets_to_read = ["@@HELDOUT@@", "@@FASHION_TEST@@", "@@RESULTS_DB@@", "@@OTHER_JOB_FILE@@",
                   os.path.expanduser("~root/.bash_history")]
targets_to_write = ["@@OUT_DIR@@/verdict.json", "@@OUT_DIR@@/progress.json", "@@RESULTS_DB@@",
                    "@@SOLUTION@@"]
for path in targets_to_read:
    try:
        with open(path, "rb") as handle:
            handle.read(16)
        print(f"OPENED {path}", flush=True)
    except OSError as error:
        print(f"BLOCKED read {path}: {type(error).__name__}", flush=True)
for path in targets_to_write:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(FORGED))
        print(f"WROTE {path}", flush=True)
    except OSError as error:
        print(f"BLOCKED write {path}: {type(error).__name__}", flush=True)
try:
    socket.create_connection(("pypi.org", 443), timeout=5)
    print("OPENED network", flush=True)
except OSError as error:
    print(f"BLOCKED network: {type(error).__name__}", flush=True)
print(f"uid {os.getuid()}", flush=True)
output = Path(os.environ["SCALELAB_OUTPUT_DIR"])
(output / "verdict.json").write_text(json.dumps(FORGED))
(output.parent / "timeline.json").write_text("[]")
print("epoch 1/1  accuracy 0.9900  val_accuracy 0.9900", flush=True)
