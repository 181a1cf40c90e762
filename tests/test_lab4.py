"""Lab 4 (communication): the α-β cost models of scalelab.comm, the solved notebook run end to end with small
settings (a real `horovodrun` allreduce sweep included, the allreduce pictures, the scaling prediction next to the
recorded GPU runs and its sliders; section 7's Gloo-against-MPI sweeps, Horovod timeline, fp16 compression and
hierarchical allreduce model), its quiz feedback, and nbgrader's student release failing validation while the
solved source passes."""

from __future__ import annotations

import csv
import json
import re
import shutil

import nbformat
import numpy as np
import pytest
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell

from conftest import keras_only
import labtools
from labtools import LABS, code_cell_containing, execute, outputs_of, run_quiz, validate
from scalelab import comm

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

LAB_FOLDER = LABS / "source" / "lab4"
SOURCE_NOTEBOOK = LAB_FOLDER / "lab4_communication.ipynb"
SMALL_SETTINGS = dict(SWEEP_NP=2, SWEEP_MAX_BYTES=2**20, SWEEP_REPEATS=3, CONTROLLER="--gloo", SIM_WORKERS=[4, 16],
                      SIM_GRADIENTS=1000, STEP_TIMING_REPEATS=5, PRACTICE_STEPS=4, COMPRESSION_BYTES=[4096, 262144],
                      COMPRESSION_REPEATS=3)
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

# Appended to a copy of the notebook: moves the prediction's sliders to the GPU cluster's figures as a student's
# browser does (a change of each slider's `value`), after the explorer was drawn with this machine's figures.
MOVE_THE_SLIDERS = """
sliders = {control.description: control for control in explorer.kwargs_widgets}
for name, value in (("t₀ (ms)", 30), ("t_image (ms)", 2.5), ("batch/rank", 128), ("model (MB)", 102.4),
                    ("α (µs)", 5), ("1/β (GB/s)", 12.5)):
    sliders[name].value = value
"""


@pytest.fixture(scope="module")
def executed_lab4(tmp_path_factory):
    # The notebook runs in (a copy of) its own folder, as a student's does: allreduce_bandwidth.py and the recorded
    # GPU runs are there.
    workdir = tmp_path_factory.mktemp("lab4") / "lab4"
    shutil.copytree(LAB_FOLDER, workdir)
    notebook = nbformat.read(workdir / SOURCE_NOTEBOOK.name, as_version=4)
    notebook.cells.append(new_code_cell(MOVE_THE_SLIDERS))
    nbformat.write(notebook, workdir / SOURCE_NOTEBOOK.name)
    return execute(workdir / SOURCE_NOTEBOOK.name, workdir, SMALL_SETTINGS), workdir


def table_rows(fragment: str) -> list[list[str]]:
    return [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", fragment)]


def test_lab4_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)


@pytest.mark.slow
def test_lab4_runs_without_errors_and_draws_its_plots(executed_lab4):
    text, _, images, errors = outputs_of(executed_lab4[0])
    assert errors == []
    # tree, butterfly and ring pictures, cost model (2 panels), sweep, sync vs async, two node-batch bar charts, the
    # scaling prediction with the GPU cluster's and with this machine's figures; section 7: Gloo against MPI, the
    # timeline's Gantt chart, fp16 compression, the hierarchical allreduce model
    assert images >= 14
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
def test_lab4_draws_the_tree_butterfly_and_ring_step_by_step_from_the_simulation(executed_lab4):
    text, _, images, errors = outputs_of(code_cell_containing(executed_lab4[0], "allreduce_steps.reduction_tree("))
    assert errors == [] and images == 3
    assert ("reduction tree of 7 nodes holding 1..7: the root holds 28 after 3 reduce steps; every node holds 28 "
            "after 6 steps") in text
    assert "butterfly of 4 nodes holding 1..4: every node holds 10 after 2 exchanges" in text
    assert "ring of 4 ranks: after 6 steps every rank holds [10. 20. 30. 40.] = True" in text


MODEL_LINE = re.compile(r"^ *(parameter server|reduction tree|butterfly|ring): 1 rank ([\d,]+) images/s \| 8 ranks "
                        r"([\d,]+) images/s, efficiency ([\d.]+) \| 1024 ranks ([\d,]+) images/s, efficiency ([\d.]+)$",
                        re.MULTILINE)


def model_lines(text: str) -> dict[str, list[float]]:
    return {name: [float(value.replace(",", "")) for value in values] for name, *values in MODEL_LINE.findall(text)}


@pytest.mark.slow
def test_lab4_predicts_scaling_from_the_gpu_figures_next_to_the_recorded_gpu_runs(executed_lab4):
    cell = code_cell_containing(executed_lab4[0], "draw_prediction(**slider_values(GPU_CLUSTER, 128)")
    text, html, images, errors = outputs_of(cell)
    assert errors == [] and images == 2                       # the GPU cluster's figures, this machine's
    recorded = [fragment for fragment in html if "scaling efficiency" in fragment]
    assert len(recorded) == 1 and any("Recorded (not measured here)" in fragment for fragment in html)
    rows = table_rows(recorded[0])
    assert [(row[0][:5], row[3], row[4]) for row in rows[:2]] == [("DGX-1", "1", "412"), ("DGX-1", "8", "3,170")]
    assert rows[1][6] == "0.962"                               # 3170 / (8 x 412)
    gpu, here = text.split("This machine's measured figures")
    gpu_model = model_lines(gpu)
    assert list(gpu_model) == ["parameter server", "reduction tree", "butterfly", "ring"]
    # 128 images in 30 + 320 ms; on 8 GPUs + 2·7·5 µs + 2·7/8 · 102.4 MB at 12.5 GB/s
    assert gpu_model["ring"][:3] == [366, 2810, 0.960]
    assert gpu_model["ring"][4] > 0.9 > gpu_model["butterfly"][4] > gpu_model["reduction tree"][4] \
        > gpu_model["parameter server"][4]
    measured = model_lines(here)
    assert set(measured) == set(gpu_model) and all(0 < values[2] <= 1 for values in measured.values())


@pytest.mark.slow
def test_lab4_prediction_sliders_start_at_the_measured_figures_and_redraw_for_new_values(executed_lab4):
    # The executed notebook keeps its widgets' state: the six sliders and the Output widget interactive() redraws
    # into, which after the moves holds the prediction for the GPU cluster's figures.
    widget_state = executed_lab4[0].metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = list(widget_state.values())
    sliders = {model["state"].get("description"): model["state"] for model in models
               if model["model_name"] in ("FloatLogSliderModel", "SelectionSliderModel")}
    assert set(sliders) == {"t₀ (ms)", "t_image (ms)", "batch/rank", "model (MB)", "α (µs)", "1/β (GB/s)"}
    assert sliders["α (µs)"]["value"] == pytest.approx(5) and sliders["1/β (GB/s)"]["value"] == pytest.approx(12.5)
    outputs = [output for model in models if model["model_name"] == "OutputModel"
               for output in model["state"].get("outputs", [])]
    printed = "".join(output.get("text", "") for output in outputs if output.get("output_type") == "stream")
    assert model_lines(printed)["ring"][:3] == [366, 2810, 0.960], printed
    assert sum("image/png" in output.get("data", {}) for output in outputs) == 1, "the redrawn prediction is not plotted"
    text = outputs_of(executed_lab4[0]).text
    fitted = re.search(r"fitted compute model: t0 = ([\d.]+) ms \+ ([\d.]+) ms per image", text)
    measured_line = re.search(r"model for t0 = ([\d.e+-]+) ms, t_image = ([\d.e+-]+) ms, batch 64 per rank", text)
    assert fitted and measured_line
    assert float(measured_line.group(1)) == pytest.approx(float(fitted.group(1)), rel=0.05, abs=0.01)


# ------------------------------------------------------------------ section 7: Horovod in practice

def cell_after(notebook: nbformat.NotebookNode, grade_id: str) -> nbformat.NotebookNode:
    """The code cell that follows the markdown cell ``grade_id``."""
    index = next(i for i, cell in enumerate(notebook.cells)
                 if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    return next(cell for cell in notebook.cells[index + 1:] if cell.cell_type == "code")


def read_csv(path) -> list[dict]:
    with path.open() as handle:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]


@pytest.mark.slow
def test_lab4_sweeps_gloo_and_mpi_and_fits_each_from_its_own_measurements(executed_lab4):
    notebook, workdir = executed_lab4
    text, html, images, errors = outputs_of(cell_after(notebook, "backends-md"))
    assert errors == [] and images == 1
    assert "$ horovodrun -np 2 --mpi python allreduce_bandwidth.py" in text
    # This machine's Open MPI reaches a rank of the same node through its shared-memory BTL, single copy by CMA.
    assert "between two ranks of this node Open MPI's ob1 sends through 'vader'" in text
    assert "(single copy: cma)" in text
    runs = workdir / "lab4_runs"
    gloo, mpi = read_csv(runs / "allreduce_np2.csv"), read_csv(runs / "allreduce_np2_mpi.csv")
    assert [row["message_bytes"] for row in mpi] == [row["message_bytes"] for row in gloo] and len(mpi) == 10
    rows = table_rows(next(fragment for fragment in html if "fitted α (µs)" in fragment))
    assert [row[0] for row in rows] == ["--gloo", "--mpi"] and rows[1][1] == "Open MPI (vader)"
    # The table's α and 1/β are each backend's fit to its own CSV.
    for row, measured in zip(rows, (gloo, mpi)):
        alpha, beta = comm.fit_alpha_beta([r["message_bytes"] for r in measured], [r["median_s"] for r in measured], 2)
        assert row[2] == f"{alpha * 1e6:.0f}" and row[3] == f"{1 / beta / 1e9:.2f}"
        assert row[5] == f"{measured[-1]['bus_gb_per_s']:.3f}"
    assert re.search(r"--mpi moved [\d.]+ times the bytes per second of --gloo", text)


def reference_spans(events: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """tensor -> phase -> its (start, end) in µs: the timeline read independently of the notebook's exercise."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and "name" in e.get("args", {})}
    stacks, found = {}, {}
    for event in events:
        if event.get("ph") == "B":
            stacks.setdefault(event["pid"], []).append(event)
        elif event.get("ph") == "E" and stacks.get(event["pid"]):
            begin = stacks[event["pid"]].pop()
            found.setdefault(names[event["pid"]], {}).setdefault(begin["name"], []).append((begin["ts"], event["ts"]))
    return found


@pytest.mark.slow
def test_lab4_reads_the_real_timeline_into_fused_allreduces_per_step(executed_lab4):
    notebook, workdir = executed_lab4
    text, html, images, errors = outputs_of(code_cell_containing(notebook, "def fused_operations("))
    assert errors == [] and images == 1
    practice = json.loads((workdir / "lab4_runs" / "practice.json").read_text())
    gradient_bytes = sum(gradient["bytes"] for gradient in practice["gradients"])
    assert len(practice["gradients"]) == 12 and gradient_bytes == 1_871_272      # the course's small CNN
    assert (f"12 gradient tensors ({gradient_bytes:,} bytes), each allreduced 4 times: once per training step"
            in text)
    timeline = json.loads((workdir / "lab4_runs" / "timeline.json").read_text())
    spans = reference_spans(timeline)
    gradients = [tensor for tensor in spans if "HorovodAllreduce_grads_" in tensor]
    assert len(gradients) == 12 and all(len(spans[tensor]["ALLREDUCE"]) == 4 for tensor in gradients)
    assert not any("fp16" in tensor or "barrier" in tensor for tensor in spans)   # stopped before the fp16 part
    rows = table_rows(next(fragment for fragment in html if "allreduce operations" in fragment))
    assert len(rows) == 4
    for step, row in enumerate(rows):
        # Fused operations recounted from the file: the ALLREDUCE spans of one operation overlap.
        intervals, operations = sorted(spans[tensor]["ALLREDUCE"][step] for tensor in gradients), []
        for start, end in intervals:
            if operations and start < operations[-1][1]:
                operations[-1] = (operations[-1][0] + 1, max(operations[-1][1], end))
            else:
                operations.append((1, end))
        assert int(row[1]) == len(operations) and 1 <= len(operations) <= 12
        assert sorted(int(count) for count in row[2].split(" + ")) == sorted(count for count, _ in operations)
        assert sum(int(size.replace(",", "")) for size in row[3].split(" + ")) == gradient_bytes
        negotiation, allreduce = float(row[4]), float(row[5])
        assert negotiation > 0 and allreduce >= float(row[6]) > 0
    assert re.search(r"steps 2-4: [\d.]+ allreduce operations per step for 12 tensors", text)


@pytest.mark.slow
def test_lab4_measures_fp16_compression_error_and_float16s_range(executed_lab4):
    notebook, workdir = executed_lab4
    text, html, images, errors = outputs_of(cell_after(notebook, "fp16-md"))
    assert errors == [] and images == 1
    practice = json.loads((workdir / "lab4_runs" / "practice.json").read_text())
    rows = {(row["message_bytes"], row["compression"]): row for row in practice["compression"]}
    assert set(rows) == {(size, label) for size in (4096, 262144) for label in ("none", "fp16")}
    for size in (4096, 262144):
        assert rows[size, "none"]["relative_error"] < 1e-6                 # float32 rounding only
        assert 1e-5 < rows[size, "fp16"]["relative_error"] < 2e-3           # float16's 11 significant bits
        assert rows[size, "fp16"]["result_dtype"] == "float32"              # decompressed back to the input's type
    measured = table_rows(next(fragment for fragment in html if "fp16 / none" in fragment))
    assert [row[0] for row in measured] == ["4,096", "262,144"]
    assert "float16: 11 significant bits (relative rounding error up to 4.9e-04), largest 65504" in text
    cast = {row[0]: row for row in table_rows(next(fragment for fragment in html if "values become 0" in fragment))}
    assert cast["0.01"][2] == "0.0%" and float(cast["0.01"][1]) < 1e-3
    assert float(cast["1e-08"][2].rstrip("%")) > 90                          # below float16's smallest subnormal


@pytest.mark.slow
def test_lab4_models_flat_against_hierarchical_allreduce_on_a_gpu_cluster(executed_lab4):
    text, _, images, errors = outputs_of(cell_after(executed_lab4[0], "hierarchical-md"))
    assert errors == [] and images == 1
    # 16 nodes x 8 GPUs, network α 5 µs and 12.5 GB/s, inside a node 2 µs and 100 GB/s: the figures the text quotes.
    assert ("1 MB on 16 nodes x 8 GPUs: flat ring 1.43 ms, hierarchical, 1 network link per node 0.35 ms, "
            "hierarchical, 8 network links per node 0.21 ms") in text
    assert ("102 MB on 16 nodes x 8 GPUs: flat ring 17.53 ms, hierarchical, 1 network link per node 17.33 ms, "
            "hierarchical, 8 network links per node 3.89 ms") in text
    efficiency = re.search(r"scaling efficiency: flat ring ([\d.]+), hierarchical, 1 network link per node ([\d.]+), "
                           r"hierarchical, 8 network links per node ([\d.]+)", text)
    assert efficiency and float(efficiency.group(1)) < float(efficiency.group(2)) < float(efficiency.group(3)) <= 1


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
    assert (released / "allreduce_bandwidth.py").is_file() and (released / "recorded_gpu_scaling.csv").is_file()
    assert (released / "horovod_in_practice.py").is_file()
    text = (released / "lab4_communication.ipynb").read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError" in text
    results = validate(released / "lab4_communication.ipynb")
    # three exercises and two quiz questions, each unanswered
    assert len(results.get("failed", [])) == 5, results.keys()


@pytest.mark.slow
def test_lab4_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab4" / "lab4_communication.ipynb") == {}
