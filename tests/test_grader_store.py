"""The results database (grader/store.py): where it is created and who may read it."""

import stat

from scalelab.grader import store


def test_a_new_results_database_directory_is_private_and_an_existing_one_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    database = store.ResultsDatabase()
    assert database.path == tmp_path / "home" / "results.db" and database.path.is_file()
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700  # every student's verdicts
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    store.ResultsDatabase(shared / "results.db")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # the instructor's own folder: not ours to change


def test_the_graders_home_is_created_private_wherever_grading_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "fresh-home"))
    run_dir = store.new_run_dir("student")
    assert run_dir.is_dir()
    assert stat.S_IMODE((tmp_path / "fresh-home").stat().st_mode) == 0o700  # submissions, logs, verdicts
