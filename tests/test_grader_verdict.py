"""One definition of the verdict (grader/verdict.py): every way a verdict is made gives the same fields."""

import dataclasses
from pathlib import Path

import pytest

from scalelab.grader import grading, pipeline, spec
from scalelab.grader.verdict import Verdict, new_verdict

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
