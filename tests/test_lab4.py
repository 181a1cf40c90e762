"""Lab 4 (communication): the α-β cost models of scalelab.comm, the solved notebook run end to end with small
settings (a real `horovodrun` allreduce sweep included), its quiz feedback, and nbgrader's student release
failing validation while the solved source passes."""

from __future__ import annotations

import csv
import re
import shutil

import nbformat
import numpy as np
import pytest
from nbclient.exceptions import CellExecutionError

import labtools
from labtools import LABS, execute, outputs_of, run_quiz, validate
from scalelab import comm

LAB_FOLDER = LABS / "source" / "lab4"
SOURCE_NOTEBOOK = LAB_FOLDER / "lab4_communication.ipynb"
SMALL_SETTINGS = dict(SWEEP_NP=2, SWEEP_MAX_BYTES=2**20, SWEEP_REPEATS=3, CONTROLLER="--gloo", SIM_WORKERS=[4, 16],
                      SIM_GRADIENTS=1000, STEP_TIMING_REPEATS=5)
QUIZ_ANSWERS = {"answer_ring_cost": '{"a", "c", "d"}', "answer_node_batch": '{"a", "b", "c", "f"}'}


# ------------------------------------------------------------------ the cost models (fast)

def test_ring_bytes_per_rank_grow_with_the_ranks_but_stay_below_twice_the_buffer_while_its_steps_grow_linearly():
    costs = [comm.allreduce_cost("ring", 1e8, p) for p in (4, 16, 256, 4096)]
    per_rank = [cost.busiest_bytes for cost in costs]
    assert per_rank == sorted(per_rank) and per_rank[0] == 1.5e8 and all(value < 2e8 for value in per_rank)
    assert [cost.steps for cost in costs] == [6, 30, 510, 8190]


def test_each_algorithm_wins_where_the_model_says():
    alpha, beta = 5e-6, 1 / 12.5e9
    small = {name: comm.allreduce_time_s(name, 64, 16, alpha, beta) for name in comm.ALGORITHMS}
    large = {name: comm.allreduce_time_s(name, 1e8, 16, alpha, beta) for name in comm.ALGORITHMS}
    assert min(small, key=small.get) == "butterfly"        # fewest steps: latency rules small messages
    assert min(large, key=large.get) == "ring"             # fewest bytes per link: bandwidth rules large ones
    assert max(large, key=large.get) == "parameter_server"


def test_cost_models_reject_what_they_cannot_price():
    with pytest.raises(ValueError, match="power-of-two"):
        comm.allreduce_cost("butterfly", 1e6, 12)
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm.allreduce_cost("gossip", 1e6, 4)
    assert comm.allreduce_time_s("parameter_server", 1e9, 1, 1.0, 1.0) == 0


def test_fit_alpha_beta_recovers_the_parameters_of_ring_times():
    sizes = np.logspace(2, 8, 13)
    times = [comm.allreduce_time_s("ring", n, 4, 3e-4, 2e-9) for n in sizes]
    alpha, beta = comm.fit_alpha_beta(sizes, times, 4)
    assert alpha == pytest.approx(3e-4, rel=1e-6) and beta == pytest.approx(2e-9, rel=1e-6)
    assert comm.bus_bandwidth(1e6, 1e-3, 2) == pytest.approx(1e9)


# ------------------------------------------------------------------ the notebook (slow)

@pytest.fixture(scope="module")
def executed_lab4(tmp_path_factory):
    # The notebook runs in (a copy of) its own folder, as a student's does: allreduce_bandwidth.py is there.
    workdir = tmp_path_factory.mktemp("lab4") / "lab4"
    shutil.copytree(LAB_FOLDER, workdir)
    return execute(workdir / SOURCE_NOTEBOOK.name, workdir, SMALL_SETTINGS), workdir


def table_rows(fragment: str) -> list[list[str]]:
    return [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", fragment)]


def test_lab4_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)


@pytest.mark.slow
def test_lab4_runs_without_errors_and_draws_its_plots(executed_lab4):
    text, _, images, errors = outputs_of(executed_lab4[0])
    assert errors == []
    # cost model (2 panels), sweep, sync vs async, two node-batch bar charts
    assert images >= 5
    assert "data parallel  == one device: True" in text and "model parallel == one device: True" in text
    assert "rank 0 sent 96 bytes in 6 steps; the model: 96 bytes in 6 steps" in text


@pytest.mark.slow
def test_lab4_fills_the_algorithm_table_from_the_cost_model(executed_lab4):
    _, html, _, _ = outputs_of(executed_lab4[0])
    tables = [fragment for fragment in html if "MB through the busiest link" in fragment]
    assert len(tables) == 1
    rows = table_rows(tables[0])
    assert [row[0] for row in rows] == ["parameter server", "reduction tree", "butterfly", "ring"]
    times = {row[0]: float(row[4]) for row in rows}
    assert min(times, key=times.get) == "ring"


@pytest.mark.slow
def test_lab4_measures_a_real_allreduce_sweep_under_horovodrun(executed_lab4):
    notebook, workdir = executed_lab4
    text, _, _, _ = outputs_of(notebook)
    assert "$ horovodrun -np 2 --gloo python allreduce_bandwidth.py" in text
    with (workdir / "lab4_runs" / "allreduce_np2.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    sizes = [int(row["message_bytes"]) for row in rows]
    assert sizes[0] == 4 and sizes[-1] == 2**20 and len(sizes) == 10
    assert all(row["ranks"] == "2" and float(row["median_s"]) > 0 for row in rows)
    assert float(rows[-1]["bus_gb_per_s"]) > float(rows[0]["bus_gb_per_s"])   # bandwidth builds up with size
    fitted = re.search(r"fitted ring model: α = ([\d.]+) µs per step, 1/β = ([\d.]+) GB/s", text)
    assert fitted and float(fitted.group(1)) > 0 and float(fitted.group(2)) > 0


@pytest.mark.slow
def test_lab4_simulates_sync_and_async_sgd_and_models_the_node_batch_tradeoff(executed_lab4):
    text, html, _, _ = outputs_of(executed_lab4[0])
    simulation = table_rows(next(fragment for fragment in html if "async mean staleness" in fragment))
    assert [row[0] for row in simulation] == ["4", "16"]
    assert float(simulation[1][5]) > float(simulation[0][5]) > 1       # staleness grows with the workers
    assert float(simulation[1][3]) > 10 * float(simulation[1][1])      # 16 asynchronous workers diverge
    node_tables = [fragment for fragment in html if "images/s per node" in fragment]
    assert len(node_tables) == 2                                        # assumed GPU cluster + measured here
    for fragment in node_tables:
        layouts = [row[0] for row in table_rows(fragment)]
        assert layouts == ["1 x 1024", "4 x 256", "16 x 64", "64 x 16", "256 x 4", "1024 x 1"]
    assert re.search(r"fitted compute model: t0 = [\d.]+ ms \+ [\d.]+ ms per image", text)


@pytest.mark.slow
def test_lab4_quiz_accepts_the_right_answers_and_explains_wrong_ones():
    source = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    run_quiz(source, QUIZ_ANSWERS, questions=2)
    for name, wrong, explanation in (("answer_ring_cost", '{"b", "e"}', r"bounded by\s+2n"),
                                     ("answer_node_batch", '{"d"}', r"3\.5 times faster per step")):
        with pytest.raises(CellExecutionError, match=explanation):
            answers = dict(QUIZ_ANSWERS, **{name: wrong})
            run_quiz(source, answers, questions=2)


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab4")


@pytest.mark.slow
def test_lab4_release_ships_the_sweep_script_has_no_solutions_and_fails_validation(released_course):
    released = released_course / "release" / "lab4"
    assert (released / "allreduce_bandwidth.py").is_file()
    text = (released / "lab4_communication.ipynb").read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError" in text
    results = validate(released / "lab4_communication.ipynb")
    # two exercises and two quiz questions, each unanswered
    assert len(results.get("failed", [])) == 4, results.keys()


@pytest.mark.slow
def test_lab4_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab4" / "lab4_communication.ipynb") == {}
