"""PyTorch through the grader. DDP under real torchrun in the real sandbox on a torchrun track
(fashion-mnist-ddp-test), the model a torch.export program measured in the sandboxed measuring process, and the
witnesses that stand in for Horovod's timeline (each rank's CPU time, when and how much bulk traffic flowed)
catching a rank that only waits, ranks that never average, and averaging in bursts; and Horovod for PyTorch under
horovodrun, on Horovod's own witnesses."""

import json
from pathlib import Path

import pytest

from test_grader_adversarial import SUBMISSIONS, assess, rank_log
from scalelab.grader import witness
from scalelab.torch_models import SmallCNN

pytestmark = pytest.mark.slow
TRACK = "fashion-mnist-ddp-test"


def submission(tmp_path: Path, mode: str) -> Path:
    source = (SUBMISSIONS / "ddp_small.py").read_text()
    assert source.count('MODE = "honest"') == 1
    path = tmp_path / f"ddp_{mode}.py"
    path.write_text(source.replace('MODE = "honest"', f'MODE = "{mode}"'))
    return path


def test_an_honest_ddp_submission_passes_with_both_ranks_computing_and_averaging_throughout(tmp_path):
    code, verdict, _ = assess(tmp_path, submission(tmp_path, "honest"), track=TRACK)
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    network = SmallCNN(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
    assert verdict["trainable_variables"] == len(list(network.parameters()))
    ranks, traffic = verdict["witnesses"]["ranks"], verdict["witnesses"]["traffic"]
    assert len(ranks["rank_cpu_s"]) == 2 and min(ranks["rank_cpu_s"]) >= 0.5 * max(ranks["rank_cpu_s"]) > 1
    assert ranks["active_deciles"] >= 6 and verdict["active_deciles"] == ranks["active_deciles"]
    # 2 epochs of 4,000 images a rank in batches of 64: 126 averagings of the gradients; the bytes carried about
    # as many (fewer: the last buckets of a step may share a segment with its first)
    assert 60 <= traffic["steps"] <= 200, traffic
    # The grader's own copies: every snapshot and the graded model are torch.export archives.
    out = tmp_path / "out"
    assert (out / "model.pt2").is_file() and Path(verdict["model_path"]) == out / "model.pt2"
    assert sorted(path.suffix for path in (out / "snapshots").iterdir()) == [".pt2"] * len(verdict["snapshots"])
    # torchrun's [defaultK]: tags split the output into each rank's log.
    assert "epoch 2/2" in rank_log(verdict, 0) and "epoch 2/2" in rank_log(verdict, 1)


def test_rank_zero_training_alone_with_forged_files_fails_on_cpu_time_and_traffic(tmp_path):
    code, verdict, _ = assess(tmp_path, submission(tmp_path, "rank0_alone"), track=TRACK)
    assert (code, verdict["verdict"]) == (1, "fail"), verdict["reasons"]
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]  # the model is good: the evidence is not
    reasons = " ".join(verdict["reasons"])
    cpu = verdict["witnesses"]["ranks"]["rank_cpu_s"]
    assert min(cpu) < witness.MIN_RANK_CPU_SHARE * max(cpu), cpu
    assert "computed less than 50% of the busiest" in reasons and "not every rank trained" in reasons
    assert f"less than {witness.MIN_DDP_STEPS} averagings" in reasons
    # What it wrote in its output directory and printed decides nothing.
    assert not (tmp_path / "out" / "timeline.json").exists()


def test_ranks_training_apart_without_ddp_fail_for_lack_of_bulk_traffic(tmp_path):
    code, verdict, _ = assess(tmp_path, submission(tmp_path, "no_ddp"), track=TRACK)
    assert (code, verdict["verdict"]) == (1, "fail"), verdict["reasons"]
    assert verdict["witnesses"]["traffic"]["steps"] < 1
    assert any("Wrap the model in DistributedDataParallel" in reason for reason in verdict["reasons"])
    assert not any("CPU times" in reason for reason in verdict["reasons"])  # both computed: only the traffic fails


def test_averaging_in_two_bursts_fails_on_the_spread_though_the_bytes_suffice(tmp_path):
    code, verdict, _ = assess(tmp_path, submission(tmp_path, "bursts"), track=TRACK)
    assert (code, verdict["verdict"]) == (1, "fail"), verdict["reasons"]
    traffic, ranks = verdict["witnesses"]["traffic"], verdict["witnesses"]["ranks"]
    assert traffic["ratio"] >= 1, traffic  # 30 averagings' worth of bytes, more than the floor
    assert ranks["active_deciles"] < 6
    assert any("in only" in reason and "tenths of the training" in reason for reason in verdict["reasons"])


def test_the_horovod_for_pytorch_reference_passes_a_horovodrun_pytorch_track_on_horovods_own_witnesses(tmp_path):
    # Horovod for PyTorch: launched by horovodrun, so its timeline is the witness, as for Keras; the model is a
    # torch.export program all the same.
    solution = SUBMISSIONS.parent.parent / "assessment" / "solution" / "assessment_pytorch_horovod.py"
    code, verdict, _ = assess(tmp_path, solution, track="fashion-mnist-horovod-torch-test")
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    assert verdict["ranks_seen"] == [0, 1]
    assert verdict["allreduced_tensors"] >= verdict["trainable_variables"] > 0
    assert verdict["witnesses"]["traffic"]["ratio"] >= witness.MIN_TRAFFIC_RATIO
    assert Path(verdict["model_path"]).name == "model.pt2"
    assert "saved" in rank_log(verdict, 0) and "saved" not in rank_log(verdict, 1)  # rank 0 alone saves
