"""One definition of the verdict (grader/verdict.py): every way a verdict is made gives the same fields."""

import dataclasses
from pathlib import Path

import pytest

from conftest import needs_tensorflow
from scalelab.grader import grading, pipeline, spec
from scalelab.grader.verdict import Verdict, new_verdict

# The Keras edition's (its track trains with Keras): skipped, with the reason, on the PyTorch edition.
needs_tensorflow()
FIELDS = {field.name for field in dataclasses.fields(Verdict)}
TRACK = spec.load_track("fashion-mnist-test", Path(__file__).parent / "submissions" / "tracks.toml")


def test_a_misspelt_field_fails_at_once():
    with pytest.raises(TypeError):
        new_verdict(heldout_acuracy=0.9)


def test_the_pipeline_and_the_class_grader_give_the_same_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    broken = tmp_path / "assessment.py"
    broken.write_text("def train(:\n")
    from_pipeline = pipeline.assess(broken, TRACK, out_dir=tmp_path / "out")
    assert from_pipeline["verdict"] == "fail" and "not valid Python" in from_pipeline["reasons"][0]
    empty = tmp_path / "empty.py"
    empty.write_text("")
    not_gradable = grading._not_gradable("ada", empty, TRACK, tmp_path / "class")
    missing = grading._not_gradable("bob", None, TRACK, tmp_path / "class")
    assert set(from_pipeline) == set(not_gradable) == set(missing) == FIELDS
    assert not_gradable["verdict"] == missing["verdict"] == "fail"
    assert "no assessment.py was submitted" in missing["reasons"][0]


def test_a_run_out_of_time_whose_model_was_fed_other_pixels_is_told_the_cause_not_only_to_be_faster():
    from scalelab.grader import verify, witness
    from test_grader_contention import TRACK, run_result

    def timed_out_with(tried: dict | None) -> dict:
        verdict = new_verdict(np=2)
        model = verify.ModelCheck(0.10, None, 4, trainable_parameters=1000, accuracy_with_preprocessing=tried)
        timeline = witness.TimelineEvidence(ranks_seen=[0, 1], allreduce_count=400, allreduced_tensors=4,
                                            active_deciles=10, span_s=30.0, events=2000)
        traffic = witness.TrafficEvidence(loopback_bytes=10**8, expected_bytes=10**8, steps=100, ratio=1.0)
        run = run_result(timed_out=True, wall_time_s=TRACK.time_budget_s + TRACK.grace_s, share=0.0)
        pipeline.decide(verdict, TRACK, run, model, timeline, traffic, Path("/nonexistent"))
        return verdict

    rescaled = timed_out_with({"scaled to [0, 1]": TRACK.target_accuracy + 0.1})
    assert rescaled["verdict"] == "timeout" and "make training faster" in rescaled["reasons"][0]
    assert any("preprocessed outside the model" in reason for reason in rescaled["reasons"]), rescaled["reasons"]
    # Preprocessing that would not have reached the target is not named as the cause.
    assert not any("preprocessed" in reason for reason in timed_out_with({"scaled to [0, 1]": 0.12})["reasons"])
    assert not any("preprocessed" in reason for reason in timed_out_with(None)["reasons"])
