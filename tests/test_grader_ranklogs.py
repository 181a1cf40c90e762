"""Splitting horovodrun's merged output into capped per-rank logs, with real Gloo and Open MPI prefixes."""

from pathlib import Path
from types import SimpleNamespace

from scalelab.grader import pipeline, ranklogs


def test_rank_log_demux_splits_gloo_and_mpi_prefixes_and_caps_each_log(tmp_path):
    demux = ranklogs.RankLogDemux(tmp_path, cap_bytes=100)
    demux.feed_line(b"[0]<stdout>:epoch 3/10  loss 1.2  accuracy 0.5  val_accuracy 0.4500\n")
    demux.feed_line(b"[1,1]<stderr>:Traceback (most recent call last):\n")
    demux.feed_line(b'[1,1]<stderr>:  File "assessment.py", line 3, in <module>\n')
    demux.feed_line(b"[1,1]<stderr>:ValueError: bad\n")
    demux.feed_line(b"horovodrun's own message\n")
    for _ in range(50):
        demux.feed_line(b"[0]<stdout>:" + b"x" * 30 + b"\n")
    assert demux.epochs_seen == 3 and demux.latest_accuracy == 0.45
    assert demux.tracebacks()[1].splitlines()[-1] == "ValueError: bad"
    ranks, launcher_log, truncated = demux.close()
    assert set(ranks) == {0, 1}
    assert Path(launcher_log).read_text() == "horovodrun's own message\n"
    rank0 = Path(ranks[0]).read_text()
    assert rank0.startswith("epoch 3/10") and "log capped at 100 bytes" in rank0
    assert truncated == [ranks[0]]


def test_mpi_output_tagged_in_mid_line_is_put_back_together_per_rank(tmp_path):
    import io
    # As Open MPI forwarded a crash under horovodrun --mpi: Python wrote the exception line in pieces and each
    # piece got the rank's tag; rank 0's progress came in between rank 1's pieces.
    stream = (b"[1,1]<stderr>:Traceback (most recent call last):\n"
              b'[1,1]<stderr>:  File "assessment.py", line 9, in <module>\n'
              b"[1,1]<stderr>:RuntimeError[1,0]<stdout>:epoch 2/5  accuracy 0.6100\n"
              b"[1,1]<stderr>:: [1,1]<stderr>:rank one failed on purpose[1,1]<stderr>:\n"
              b"[1,0]<stderr>:Traceback (most recent call last):\n[1,0]<stderr>:ValueError: ended without newline")
    demux = ranklogs.RankLogDemux(tmp_path)
    demux.pump(io.BytesIO(stream))
    ranks, launcher_log, _ = demux.close()
    assert demux.tracebacks()[1].splitlines()[-1] == "RuntimeError: rank one failed on purpose"
    assert demux.tracebacks()[0].splitlines()[-1] == "ValueError: ended without newline"
    assert demux.epochs_seen == 2 and demux.latest_accuracy == 0.61
    assert Path(ranks[1]).read_text().endswith('line 9, in <module>\nRuntimeError: rank one failed on purpose\n')
    assert "<stderr>" not in Path(ranks[0]).read_text() + Path(ranks[1]).read_text()
    assert Path(launcher_log).read_text() == ""


def test_over_long_lines_are_cut_and_stay_in_their_rank_log(tmp_path):
    import io
    demux = ranklogs.RankLogDemux(tmp_path, cap_bytes=10 * ranklogs.LINE_CAP_BYTES)
    demux.pump(io.BytesIO(b"[1]<stdout>:" + b"y" * (3 * ranklogs.LINE_CAP_BYTES) + b"\n[0]<stdout>:short\n"))
    ranks, launcher_log, _ = demux.close()
    assert Path(ranks[1]).read_text().count("y") == 3 * ranklogs.LINE_CAP_BYTES
    assert Path(ranks[0]).read_text() == "short\n"
    assert Path(launcher_log).read_text() == ""


def test_torchrun_tags_split_each_ranks_lines_and_tracebacks(tmp_path):
    demux = ranklogs.RankLogDemux(tmp_path)
    for line in (b"W1127 11:55:04.878000 torch/distributed/run.py:874] Setting OMP_NUM_THREADS\n",
                 b"[default0]:epoch 1/8  loss 2.0  val_accuracy 0.31\n",
                 b"[default1]:Traceback (most recent call last):\n",
                 b'[default1]:  File "assessment.py", line 3, in <module>\n',
                 b"[default1]:ValueError: bad shape\n",
                 b"[default0]:epoch 2/8  loss 1.5  val_accuracy 0.42\n"):
        demux.feed_line(line)
    ranks, launcher, truncated = demux.close()
    assert sorted(ranks) == [0, 1] and truncated == []
    assert (tmp_path / "rank-0.log").read_text().splitlines()[-1] == "epoch 2/8  loss 1.5  val_accuracy 0.42"
    assert "OMP_NUM_THREADS" in Path(launcher).read_text()
    assert (demux.epochs_seen, demux.latest_accuracy) == (2, 0.42)
    assert demux.tracebacks()[1].splitlines()[-1] == "ValueError: bad shape"


def test_a_ddp_ranks_traceback_is_found_under_pytorchs_rank_prefix(tmp_path):
    # As torchrun passed on a DDP rank's crash: once a process group is up, PyTorch's exception hook prints each
    # line of the uncaught exception as "[rank1]: ...", inside torchrun's own "[default1]:" tag.
    demux = ranklogs.RankLogDemux(tmp_path)
    for line in (b"[default1]:[rank1]: Traceback (most recent call last):\n",
                 b'[default1]:[rank1]:   File "assessment.py", line 8, in <module>\n',
                 b'[default1]:[rank1]:     raise RuntimeError("rank one failed on purpose")\n',
                 b"[default1]:[rank1]: RuntimeError: rank one failed on purpose\n",
                 b"[default0]:[rank0]: Traceback (most recent call last):\n",
                 b'[default0]:[rank0]:   File "assessment.py", line 9, in <module>\n',
                 b"[default0]:[rank0]: RuntimeError: Connection closed by peer\n"):
        demux.feed_line(line)
    ranks, _launcher, _truncated = demux.close()
    crashed = demux.tracebacks()[1].splitlines()
    assert crashed[0] == "Traceback (most recent call last):"
    assert crashed[2] == '    raise RuntimeError("rank one failed on purpose")'
    assert crashed[-1] == "RuntimeError: rank one failed on purpose"
    assert demux.tracebacks()[0].splitlines()[-1] == "RuntimeError: Connection closed by peer"
    # The rank's log keeps what it printed.
    assert Path(ranks[1]).read_text().splitlines()[-1] == "[rank1]: RuntimeError: rank one failed on purpose"


def test_a_rank_that_aborts_in_cpp_as_pytorch_exits_is_named_with_the_cause_and_the_fix(tmp_path):
    # As torchrun (--tee 3) passed on a DDP rank that PyTorch's Gloo threads ended as Python exited: a C++ line on
    # stderr, no Python traceback. Before, the verdict said that no rank printed a Python traceback.
    demux = ranklogs.RankLogDemux(tmp_path)
    for line in (b"[default0]:saved /job/output/model.pt2\n",
                 b"[default1]:terminate called without an active exception\n"):
        demux.feed_line(line)
    demux.close()
    found = demux.tracebacks()
    assert found == {1: "terminate called without an active exception"}
    run = SimpleNamespace(exit_code=1, wall_time_s=42.0, rank_tracebacks=found)
    reasons = pipeline._rank_failure_reasons(run, tmp_path, "torchrun")
    assert reasons[0] == "the run failed: torchrun exited with status 1 after 42 s."
    assert reasons[1].startswith("rank 1 aborted in C++, with no Python traceback: terminate called without an "
                                 "active exception — PyTorch (Gloo) can abort a rank")
    assert "del model, then gc.collect()" in reasons[1] and len(reasons) == 2
    # Any other C++ abort is named as it is, without PyTorch's explanation.
    thrown = {0: "terminate called after throwing an instance of 'std::runtime_error'\n  what():  out of range"}
    reasons = pipeline._rank_failure_reasons(SimpleNamespace(exit_code=134, wall_time_s=3.0, rank_tracebacks=thrown),
                                             tmp_path, "horovodrun")
    assert reasons[1] == ("rank 0 aborted in C++, with no Python traceback: terminate called after throwing an "
                          "instance of 'std::runtime_error' what(): out of range")


def test_a_python_traceback_is_preferred_to_a_cpp_abort_line_in_the_same_rank(tmp_path):
    demux = ranklogs.RankLogDemux(tmp_path)
    for line in (b"[default0]:terminate called without an active exception\n",
                 b"[default0]:Traceback (most recent call last):\n",
                 b'[default0]:  File "assessment.py", line 3, in <module>\n',
                 b"[default0]:ValueError: bad shape\n"):
        demux.feed_line(line)
    demux.close()
    assert demux.tracebacks()[0].splitlines()[-1] == "ValueError: bad shape"
