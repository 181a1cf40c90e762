"""Evidence from Horovod's timeline (read leniently, also when cut off) and the held-out measurement's refusals."""

import os
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from scalelab.grader import verify

# The shape of a real timeline written by `horovodrun -np 2 --timeline-filename` (Horovod 0.28.1): tensors
# are "processes", rank marks are X events named after the rank inside NEGOTIATE_ALLREDUCE.
HEADER = '[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":1}},\n'


def tensor(pid: int, name: str) -> str:
    return (f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": "{name}"}}}},\n'
            f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}},\n')


def allreduce(pid: int, ts: int, ranks=(0, 1)) -> str:
    marks = "".join(f'{{"ph": "X", "name": "{rank}", "ts": {ts + 1}, "pid": {pid}, "dur": 0}},' for rank in ranks)
    return (f'{{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": {ts}, "pid": {pid}}},{marks}'
            f'{{"ph": "E", "ts": {ts + 5}, "pid": {pid}}},'
            f'{{"ph": "B", "name": "ALLREDUCE", "ts": {ts + 6}, "pid": {pid}}},'
            f'{{"ph": "E", "ts": {ts + 9}, "pid": {pid}, "args": {{"dtype": "float32", "shape": "[4]"}}}},\n')


def write_timeline(path: Path, steps: int, tensors: int = 3, ranks=(0, 1), closed=True) -> Path:
    text = HEADER + "".join(tensor(pid, f"DistributedSGD_Allreduce/HorovodAllreduce_grads_{pid}_0")
                            for pid in range(1, tensors + 1))
    for step in range(steps):
        for pid in range(1, tensors + 1):
            text += allreduce(pid, 1_000_000 + step * 100_000 + pid * 10, ranks)
    path.write_text(text.rstrip(",\n") + ("]" if closed else ""))
    return path


def evidence_of(path: Path) -> verify.TimelineEvidence:
    return verify.timeline_evidence(path.parent, path.name, owner_uid=None)


def heldout_accuracy(model_path: Path, dataset: str) -> verify.ModelCheck:
    """Measure a model file the way the grader measures a run's: from a folder, through its own checked copy."""
    heldout = verify.HeldoutProcess(dataset)
    try:
        return heldout.measure(model_path.parent, model_path.name, owner_uid=None)
    finally:
        heldout.close()


def test_complete_timeline_shows_ranks_tensors_and_spread(tmp_path):
    evidence = evidence_of(write_timeline(tmp_path / "t.json", steps=20))
    assert evidence.ranks_seen == [0, 1]
    assert evidence.allreduce_count == 60 and evidence.allreduced_tensors == 3
    assert evidence.active_deciles == 10
    assert verify.evidence_problems(evidence, np=2, trainable_variables=3, min_spread_deciles=8, epochs_seen=2) == []


@pytest.mark.parametrize("cut", [0.3, 0.77, 0.999])
def test_timeline_cut_off_mid_write_is_still_read(tmp_path, cut):
    whole = write_timeline(tmp_path / "whole.json", steps=20, closed=False).read_text()
    cut_file = tmp_path / "cut.json"
    cut_file.write_text(whole[:int(len(whole) * cut)])
    evidence = evidence_of(cut_file)
    assert evidence.readable and evidence.ranks_seen == [0, 1]
    assert 0 < evidence.allreduce_count <= 60


def test_missing_rank_too_few_tensors_and_allreduces_only_at_the_end_are_each_named(tmp_path):
    evidence = evidence_of(write_timeline(tmp_path / "t.json", steps=1, tensors=2, ranks=(0,)))
    problems = verify.evidence_problems(evidence, np=2, trainable_variables=10, min_spread_deciles=8, epochs_seen=5)
    assert any("ranks [1] never took part" in p for p in problems)
    assert any("only 2 distinct tensors" in p for p in problems)
    assert any("only" in p and "tenths of the run" in p for p in problems)


def test_no_timeline_or_garbage_means_no_evidence(tmp_path):
    for content in (None, "", "not json", "[]"):
        path = tmp_path / "t.json"
        if content is not None:
            path.write_text(content)
        evidence = evidence_of(path)
        problems = verify.evidence_problems(evidence, 2, 4, 8, 1)
        assert evidence.allreduce_count == 0 and "shows no allreduce" in problems[0]


def test_model_file_refusals(tmp_path):
    assert "no model was saved" in heldout_accuracy(tmp_path / "model.keras", "fashion-mnist").reason
    corrupt = tmp_path / "corrupt.keras"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    assert "not a Keras archive" in verify.model_file_problem(corrupt)
    bomb = tmp_path / "bomb.keras"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.weights.h5", b"\0" * (verify.MODEL_SIZE_LIMIT_BYTES + 1))
    assert "unpacks to" in verify.model_file_problem(bomb)


def test_heldout_measurement_refuses_lambda_layers_and_wrong_outputs(tmp_path):
    import tensorflow as tf

    inputs = tf.keras.Input((28, 28, 1))
    hacked = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda x: tf.reduce_mean(x, axis=(1, 2)) * 0 + 1)(
        tf.keras.layers.Flatten()(inputs)[:, :10, None, None]))
    hacked.save(tmp_path / "lambda.keras")
    refused = heldout_accuracy(tmp_path / "lambda.keras", "fashion-mnist")
    # the lambda's code is pickled with its module's name: refused before Keras (or its safe mode) sees it
    assert refused.heldout_accuracy is None and "names the Python module(s) builtins" in refused.reason

    wrong = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
    wrong.save(tmp_path / "wrong.keras")
    refused = heldout_accuracy(tmp_path / "wrong.keras", "fashion-mnist")
    assert refused.heldout_accuracy is None and "10 class scores" in refused.reason


def thread_policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not verify.may_raise_priority(), reason="needs CAP_SYS_NICE (the grader runs as root here)")
def test_heldout_process_started_ahead_waits_at_idle_priority_and_measures_at_normal(tmp_path):
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "model.keras")
    fresh = heldout_accuracy(tmp_path / "model.keras", "fashion-mnist")

    heldout = verify.HeldoutProcess("fashion-mnist")
    heldout.start_ahead()
    waiting = heldout.waiting
    assert waiting is not None and waiting.poll() is None
    # the Python inside the sandbox (bwrap's last descendant), once it has started TensorFlow's threads
    deadline = time.monotonic() + 120
    python = None
    while time.monotonic() < deadline:
        family = psutil.Process(waiting.pid).children(recursive=True)
        python = next((p for p in family if "scalelab.grader.heldout" in " ".join(p.cmdline())
                       and "bwrap" not in p.name()), None)
        if python is not None and len(os.listdir(f"/proc/{python.pid}/task")) >= 2:
            break
        time.sleep(0.2)
    # every thread it starts while importing TensorFlow inherits the idle policy: it takes no CPU from a run
    assert python is not None and thread_policies(python.pid) == {os.SCHED_IDLE}
    assert verify._restore_normal_priority(waiting.pid)
    assert thread_policies(python.pid) == {os.SCHED_OTHER}

    measured = heldout.measure(tmp_path, "model.keras", owner_uid=None)
    assert waiting.returncode == 0 and heldout.waiting is None  # the process started ahead did the measuring
    assert measured == fresh and measured.images == 10000 and 0 <= measured.heldout_accuracy <= 1


@pytest.mark.skipif(not verify.may_raise_priority(), reason="needs CAP_SYS_NICE (the grader runs as root here)")
def test_heldout_process_started_ahead_is_stopped_when_there_is_no_model(tmp_path):
    heldout = verify.HeldoutProcess("fashion-mnist")
    heldout.start_ahead()
    waiting = heldout.waiting
    # the run saved no model: refused without asking the measuring process anything...
    assert heldout.measure(tmp_path, "model.keras", owner_uid=None).reason.startswith("no model was saved")
    assert waiting.poll() is None
    heldout.close()  # ...which the grader then stops, rather than leave it waiting
    assert waiting.returncode is not None and heldout.waiting is None
