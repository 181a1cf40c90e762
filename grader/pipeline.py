"""``assess()``: one submission through spec → launch → verify (the model) and witness (the evidence) → store,
ending in a verdict dict.

The verdict is a stable JSON contract (its fields are listed in the README). ``assess`` never raises for a
problem of the submission (that is a ``fail``/``timeout`` verdict), and when the grader itself fails or is
stopped it still writes a verdict, ``error``, with the reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import traceback
import uuid
from pathlib import Path
from typing import Callable

from scalelab import __version__, data as course_data, environment

from . import contention, curve, launch, ranklogs, spec, store, verify, witness
from . import sandbox as sandbox_module
from .verdict import new_verdict

SUBMISSION_SIZE_LIMIT_BYTES = 1 << 20


def _environment() -> dict:
    facts = environment.describe()
    facts["gpus"] = environment.gpus()
    return facts


def paths_to_hide(out_dir: Path, database: Path | None, extra=()) -> list[Path]:
    """Everything the submission must not see: the data sets (held-out splits), the grader's state (runs,
    jobs, results, gradebook), the reference solution, and the grader's home directory."""
    data_dirs = [*course_data.cifar10_dirs(), *course_data.fashion_mnist_dirs()]
    hidden = set(launch.data_paths_to_hide(data_dirs))
    hidden |= {store.scalelab_home(), store.jobs_root(), out_dir, spec.COURSE_ROOT / "assessment" / "solution",
               Path.home()}
    if database is not None:
        hidden.add(Path(database).parent)
    hidden |= {Path(p) for p in extra}
    return sorted(Path(p).resolve() for p in hidden if Path(p).exists())


FILE_IN_TRACEBACK = re.compile(r'File "([^"]+)"')
# What a rank raises when another rank failed first.
FAILURE_ECHOES = ("Horovod has been shut down", "Connection closed by peer", "Connection reset by peer")


def student_facing(text: str, job_dir: Path) -> str:
    """A traceback as the student wrote the script: their file as assessment.py (with its line), other files
    by their last two path components, never the grader's or the machine's paths."""
    def shorten(match: re.Match) -> str:
        path = Path(match.group(1))
        if path.is_absolute() and path.is_relative_to(job_dir):
            return f'File "{path.relative_to(job_dir)}"'
        return f'File "{Path(*path.parts[-2:]) if len(path.parts) > 2 else path}"'
    return FILE_IN_TRACEBACK.sub(shorten, text).replace(f"{job_dir}/", "")


def _rank_failure_reasons(run: launch.RunResult, job_dir: Path, launcher: str = "horovodrun") -> list[str]:
    reasons = [f"the run failed: {launcher} exited with status {run.exit_code} after {run.wall_time_s:.0f} s."]
    # The rank that failed first comes first: the others only report that Horovod shut down because of it, or
    # (Gloo under DDP) that their peer closed the connection.
    def consequence(item):
        return any(echo in item[1] for echo in FAILURE_ECHOES), item[0]
    for rank, text in sorted(run.rank_tracebacks.items(), key=consequence)[:2]:
        if ranklogs.CPP_TERMINATE.match(text.split("\n", 1)[0]):
            reasons.append(_terminate_reason(rank, text, launcher))
            continue
        text = student_facing(text, job_dir)
        last_line = text.strip().splitlines()[-1] if text.strip() else ""
        if len(last_line) > 300:
            last_line = last_line[:300] + " …"
        reasons.append(f"rank {rank} raised {last_line}\n{text}")
    if not run.rank_tracebacks:
        reasons.append(f"no rank printed a Python traceback; see the logs in the logs directory "
                       f"(launcher.log has {launcher}'s own messages).")
    return reasons


def _terminate_reason(rank: int, text: str, launcher: str) -> str:
    """A rank that died in C++ (std::terminate), and, for the abort PyTorch can cause as a DDP rank exits, why."""
    reason = f"rank {rank} aborted in C++, with no Python traceback: {' '.join(text.split())}"
    if launcher == "torchrun" and "without an active exception" in text:
        reason += (" — PyTorch (Gloo) can abort a rank this way as Python exits while the DDP-wrapped model is still "
                   "alive. At the end of the script free it while the process group is up (del model, then "
                   "gc.collect()), then call dist.barrier() and dist.destroy_process_group(), as lab 3's PyTorch "
                   "edition shows in its step 1.")
    return reason


def _say_memory_ran_out(verdict: dict, run: launch.RunResult) -> None:
    """The kernel killed processes of the run at its memory limit: the first reason when the run did not pass."""
    sentence = (f"the run reached its memory limit ({run.memory_limit_bytes / 1024**3:.1f} GiB for all ranks "
                f"together) and the kernel killed {run.out_of_memory_kills} of its processes: use less memory "
                f"(smaller batches, no copies of the whole data set per rank).")
    if verdict["verdict"] == "pass":
        verdict["notes"].append(sentence)
    else:
        verdict["reasons"].insert(0, sentence)


def _preprocessing_cause(model: verify.ModelCheck, track: spec.Track) -> str | None:
    """Why a model below the target is there, when preprocessing alone explains it (None otherwise)."""
    tried = model.accuracy_with_preprocessing or {}
    if model.heldout_accuracy is None or not tried:
        return None
    how, accuracy = max(tried.items(), key=lambda item: item[1])
    # Named only when preprocessing alone would have reached the target: then it is the cause, not a hint.
    if accuracy < track.target_accuracy or accuracy < model.heldout_accuracy + 0.05:
        return None
    first_layer = ("as the first step of its forward() (pixels / 255, or the training images' mean and standard "
                   "deviation)" if track.framework == "pytorch" else "as its first layer "
                   "(tf.keras.layers.Rescaling(1/255), or a Normalization layer adapted to the training images)")
    return (f"held-out accuracy {model.heldout_accuracy:.4f} is below the target {track.target_accuracy:.4f}, yet "
            f"the same model reaches {accuracy:.4f} when the pixels are first {how} (measured for this message only, "
            f"never for the verdict): it was trained on pixels preprocessed outside the model, and the grader feeds "
            f"the saved model raw 0-255 pixels, as the data loaders give them. Put the preprocessing inside the "
            f"model, {first_layer}, and feed it raw pixels.")


def _accuracy_reason(model: verify.ModelCheck, track: spec.Track) -> str:
    return _preprocessing_cause(model, track) or (
        f"held-out accuracy {model.heldout_accuracy:.4f} is below the target {track.target_accuracy:.4f}: "
        f"train longer or better within the budget.")


def _curve_reasons(points: list[dict], track: spec.Track, run: launch.RunResult,
                   model: verify.ModelCheck) -> list[str]:
    """What the held-out curve (the grader's measurements of the snapshots, none at the target) says of the cause."""
    measured = [point for point in points if point["accuracy"] is not None]
    reasons = []
    if len(measured) >= 2:
        last, before = measured[-1], measured[-2]
        recent = measured[-3:]
        if last["accuracy"] >= before["accuracy"] + 0.01:
            reasons.append(f"the grader's held-out accuracy was {last['accuracy']:.2f} at {last['at_s']:.0f} s and "
                           f"still rising ({before['accuracy']:.2f} at {before['at_s']:.0f} s), short of the target "
                           f"{track.target_accuracy:.2f} within the {track.time_budget_s:.0f} s budget: faster steps "
                           f"(a larger batch, fewer evaluations) or a larger learning rate would get there sooner.")
        elif len(recent) == 3 and max(p["accuracy"] for p in recent) - min(p["accuracy"] for p in recent) < 0.01:
            reasons.append(f"the grader's held-out accuracy stalled at about {last['accuracy']:.2f} over the last "
                           f"three snapshots ({recent[0]['at_s']:.0f}-{last['at_s']:.0f} s), below the target "
                           f"{track.target_accuracy:.2f}: training stopped improving (a learning rate too large or "
                           f"too small, or too small a model), not only too slow.")
    claimed = run.reported_accuracy
    best = max((point["accuracy"] for point in measured), default=model.heldout_accuracy)
    if claimed is not None and best is not None and claimed >= track.target_accuracy > best:
        reasons.append(f"the run's own validation accuracy reached {claimed:.2f}, but on the held-out images the "
                       f"grader measured at most {best:.2f}: the model does not generalise as its validation "
                       f"split suggests (validation on training images, or a split too small to trust).")
    return reasons


def _not_graded_for_contention(verdict: dict, cpu_contention: dict, facts: list[str]) -> None:
    """A run out of time while other work crowded the machine: the budget assumes the machine to itself, so the
    run does not count (an ``error`` verdict, ``contended``); what was measured of it stays in the notes."""
    verdict["verdict"], verdict["contended"] = "error", True
    verdict["reasons"] = [f"{contention.busy_machine_sentence(cpu_contention)}, and the run ran out of time. The "
                          f"time budget assumes the machine to itself, so this is not held against your submission: "
                          f"it was not graded, and must be graded again."]
    verdict["notes"] += [f"for information: {fact}" for fact in facts]


def decide(verdict: dict, track: spec.Track, run: launch.RunResult, model: verify.ModelCheck,
           timeline: witness.TimelineEvidence, traffic: witness.TrafficEvidence, job_dir: Path,
           points: list[dict] = (), deciding: dict | None = None, ranks: witness.RankEvidence | None = None) -> None:
    """Fill ``verdict`` (verdict and reasons) from what was measured. Pass iff every condition holds.

    ``deciding`` is the first snapshot whose held-out accuracy reached the target within the budget (``points``
    the whole curve): then the clock stopped when that snapshot appeared, ``model`` is its measurement, and what
    the run did after it (stopped by the grader, crashed, ran over time) does not count; the evidence must still
    show all ranks training together. Without one, the run is judged by how it ended and its final model. A run out
    of time while others used at least ``contention.CONTENDED_SHARE`` of the machine is not graded (``contended``);
    any other verdict under such contention gets a note saying so. A torchrun track's evidence is ``ranks`` and
    ``traffic`` (no timeline)."""
    def evidence_problems() -> list[str]:
        if track.horovod:
            return witness.evidence_problems(timeline, traffic, verdict["np"], model.trainable_variables,
                                             track.min_spread_deciles)
        return witness.ddp_evidence_problems(ranks or witness.RankEvidence([], 0, 0.0), traffic, verdict["np"],
                                             track.min_spread_deciles)
    reasons = []
    budget = track.time_budget_s
    if deciding is not None:
        reasons = evidence_problems()
        if reasons:
            verdict["verdict"], verdict["reasons"] = "fail", reasons
            return
        verdict["verdict"], verdict["time_to_accuracy_s"] = "pass", deciding["at_s"]
        stopped = " (the grader then stopped the run)" if run.stopped_at_target else ""
        verdict["reasons"] = [f"held-out accuracy {model.heldout_accuracy:.4f} ≥ target {track.target_accuracy:.4f} "
                              f"at {deciding['at_s']:.1f} s of the {budget:.0f} s budget, measured by the grader "
                              f"on snapshot {deciding['index']}{stopped}, with all {verdict['np']} ranks "
                              f"allreducing gradients throughout training."]
        return
    crowded = contention.is_contended(run.cpu_contention)
    if run.timed_out or run.wall_time_s > budget:
        if run.timed_out:
            ran_out = (f"the run was still going at the {budget:.0f} s time budget (+{track.grace_s:.0f} s grace) "
                       f"and was stopped")
            advice = ": make training faster, or stop it once the target is reached."
        else:
            ran_out = f"the run ended after {run.wall_time_s:.0f} s, over the {budget:.0f} s time budget"
            advice = "."
        last_model = None if model.heldout_accuracy is None else (
            f"the last saved model reached held-out accuracy {model.heldout_accuracy:.4f} "
            f"(target {track.target_accuracy:.4f}).")
        if crowded:
            facts = [f"{ran_out}."] + ([last_model] if last_model else [])
            _not_graded_for_contention(verdict, run.cpu_contention, facts)
            return
        verdict["verdict"] = "timeout"
        verdict["reasons"] = [ran_out + advice] + ([f"for information: {last_model}"] if last_model else [])
        cause = _preprocessing_cause(model, track)
        if cause:  # faster training would not have helped: the model was fed other pixels than it learned on
            verdict["reasons"].append(cause)
        else:
            verdict["reasons"] += _curve_reasons(list(points), track, run, model)
        return
    if crowded:  # the verdict stands: a run that did not run out of time was not cut short
        verdict["notes"].append(f"{contention.busy_machine_sentence(run.cpu_contention)}: your run had less of the "
                                f"machine than the time budget assumes.")
    if run.exit_code != 0:
        verdict["verdict"] = "fail"
        verdict["reasons"] = _rank_failure_reasons(run, job_dir, "horovodrun" if track.horovod else "torchrun")
        return
    if model.heldout_accuracy is None:
        reasons.append(model.reason)
    elif model.heldout_accuracy < track.target_accuracy:
        reasons.append(_accuracy_reason(model, track))
        if not _preprocessing_cause(model, track):
            reasons += _curve_reasons(list(points), track, run, model)
    reasons += evidence_problems()
    if reasons:
        verdict["verdict"], verdict["reasons"] = "fail", reasons
    else:
        verdict["verdict"] = "pass"
        verdict["time_to_accuracy_s"] = run.wall_time_s  # no snapshot decided: the final model, at the run's end
        verdict["reasons"] = [f"held-out accuracy {model.heldout_accuracy:.4f} ≥ target {track.target_accuracy:.4f}, "
                              f"in {run.wall_time_s:.0f} s of the {budget:.0f} s budget, with all {verdict['np']} "
                              f"ranks allreducing gradients throughout training."]


def assess(submission_path, track_name: str | spec.Track | None = None, np: int | None = None, out_dir=None,
           backend: str = "local", allow_unsandboxed: bool = False,
           progress: Callable[[dict], None] | None = None, *, track_file=None, database=None,
           student: str | None = None, extra_hidden=(), live_evaluation: bool = True) -> dict:
    """Grade one submission; returns the verdict (also written to ``out_dir/verdict.json`` and the database).
    ``live_evaluation=False`` measures the snapshots only after the run (no early stop; for the benchmark that
    prices live evaluation)."""
    out_dir = Path(out_dir) if out_dir else store.new_run_dir(Path(submission_path).stem)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs_dir = out_dir / "logs"
    verdict = new_verdict(
        np=np, track=getattr(track_name, "name", track_name), submission=str(submission_path), student=student,
        started_at=launch.utc_now(), logs_dir=str(logs_dir), out_dir=str(out_dir), backend=backend,
        sandboxed=not allow_unsandboxed, grader_version=__version__)
    job_dir = heldout = live = None

    def report(state: dict) -> None:
        store.write_json_atomic(out_dir / "progress.json", state)
        if progress is not None:
            progress(state)

    try:
        verdict["environment"] = _environment()
        # A Track object is taken as it is (calibration runs a track with a stretched budget).
        track = track_name if isinstance(track_name, spec.Track) else spec.load_track(track_name, track_file)
        verdict.update(track=track.name, dataset=track.dataset, target_accuracy=track.target_accuracy,
                       time_budget_s=track.time_budget_s)
        verdict["np"] = np = np or track.resolve_ranks(len(verdict["environment"]["gpus"]))
        source = Path(submission_path).read_bytes()
        verdict["submission_sha256"] = hashlib.sha256(source).hexdigest()
        report({"state": "running", "elapsed_s": 0.0, "time_budget_s": track.time_budget_s, "epochs_seen": 0,
                "latest_accuracy": None, "checkpoint_mtime": None})
        try:
            compile(source, track.submission_file, "exec")  # compiling runs none of the submission's code
        except (SyntaxError, ValueError) as error:
            line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
            verdict.update(verdict="fail", wall_time_s=0.0, reasons=[
                f"{track.submission_file} is not valid Python: {type(error).__name__}{line}: "
                f"{getattr(error, 'msg', str(error))}. Run `python {track.submission_file}` yourself before "
                f"submitting."])
            return verdict
        sandbox = True
        problem = sandbox_module.sandbox_works()
        if problem and not allow_unsandboxed:
            raise launch.LaunchError(f"{problem}; refusing to grade without a sandbox (an instructor may pass "
                                     f"--allow-unsandboxed to run submissions unconfined)")
        if allow_unsandboxed and problem:
            sandbox = False
            verdict["notes"].append(f"ran WITHOUT a sandbox, as the instructor allowed: {problem}")
        verdict["sandboxed"] = sandbox
        store.private_home()
        job_dir = store.jobs_root() / f"{uuid.uuid4().hex[:12]}"
        job_dir.parent.mkdir(parents=True, exist_ok=True)
        hidden = paths_to_hide(out_dir, database, extra_hidden)
        job = launch.prepare_job(Path(submission_path), job_dir, dataset=track.dataset, track_name=track.name,
                                 np=np, launcher=track.launcher, launcher_options=track.launcher_options,
                                 time_budget_s=track.time_budget_s, grace_s=track.grace_s, logs_dir=logs_dir,
                                 hidden_paths=hidden, sandbox=sandbox, snapshots_dir=out_dir / "snapshots",
                                 memory_limit_bytes=int(track.memory_limit_gib * 1024**3),
                                 model_file=track.model_file)
        verdict["sandbox_uid"] = job.sandbox_uid
        heldout = verify.HeldoutProcess(track.dataset, sandboxed=sandbox, explain_below=track.target_accuracy,
                                        framework=track.framework)
        heldout.start_ahead()  # imports the framework at idle priority while the run goes on
        live = curve.LiveCurve(heldout, track.target_accuracy, track.time_budget_s)

        def report_running(state: dict) -> None:
            report({**state, "heldout_curve": live.curve()})
        try:
            if backend == "local":
                run = launch.run_local(job, on_progress=report_running,
                                       on_snapshot=live.add if live_evaluation else None,
                                       target_reached=live.reached if live_evaluation else None)
            elif backend == "slurm":  # the snapshots are measured once the run is over
                from . import slurm  # written separately; reuses JobSpec, sandbox_argv and RankLogDemux
                run = slurm.run(job, on_progress=report_running)
            else:
                raise ValueError(f"unknown backend {backend!r}; known: local, slurm")
        finally:
            sandbox_module.release_uid(job.sandbox_uid)
        verdict.update(wall_time_s=run.wall_time_s, exit_code=run.exit_code, epochs_seen=run.epochs_seen,
                       started_at=run.started_at)
        report({"state": "verifying", "elapsed_s": run.wall_time_s, "time_budget_s": track.time_budget_s,
                "epochs_seen": run.epochs_seen, "latest_accuracy": None,
                "checkpoint_mtime": None})
        heldout.normal_priority()
        live.finish(run.snapshots)
        deciding = live.deciding.as_dict() if live.deciding is not None else None
        if deciding is not None:  # the clock stopped there: that snapshot is the model graded
            model, graded_model = live.deciding_check(), live.deciding_file()
        else:
            owner_uid = job.sandbox_uid if job.sandbox_uid is not None else os.getuid()
            model = heldout.measure(job.job_dir, f"output/{track.model_file}", owner_uid)
            graded_model = heldout.checked_model
        timeline = witness.TimelineEvidence(**run.timeline) if run.timeline else witness.TimelineCounter().evidence()
        ranks = witness.RankEvidence(run.rank_cpu_s, run.traffic_active_deciles, run.traffic_span_s)
        if track.horovod:
            traffic = witness.traffic_evidence(run.loopback_bytes, timeline, model.trainable_parameters,
                                               model.trainable_variables, np, run.loopback_packets)
            verdict.update(ranks_seen=timeline.ranks_seen, allreduce_count=timeline.allreduce_count,
                           allreduced_tensors=timeline.allreduced_tensors, active_deciles=timeline.active_deciles,
                           witnesses=witness.figures(timeline, traffic, model.trainable_parameters))
        else:  # torchrun writes no timeline: the ranks' CPU time and when the traffic flowed stand in for it
            traffic = witness.ddp_traffic_evidence(run.loopback_bytes, model.trainable_parameters, np,
                                                   run.loopback_packets)
            verdict.update(active_deciles=ranks.active_deciles,
                           witnesses=witness.ddp_figures(ranks, traffic, model.trainable_parameters))
        verdict.update(heldout_accuracy=model.heldout_accuracy, trainable_variables=model.trainable_variables)
        verdict["cpu_contention"] = run.cpu_contention
        # What a track's memory_limit_gib is chosen from (None where the run had no memory cgroup).
        verdict["memory"] = {"limit_bytes": run.memory_limit_bytes, "peak_bytes": run.peak_memory_bytes}
        # The models the run saved as it went, on the grader's clock (the grader's copies stay in out_dir).
        measured = {point["index"]: point for point in live.curve()}
        verdict["snapshots"] = [{**{key: snapshot[key] for key in ("index", "at_s", "bytes", "sha256")},
                                 "heldout_accuracy": measured.get(snapshot["index"], {}).get("accuracy")}
                                for snapshot in run.snapshots]
        verdict["deciding_snapshot"] = deciding["index"] if deciding else None
        verdict["stopped_at_target"] = run.stopped_at_target
        verdict["notes"] += run.snapshot_notes + live.notes
        decide(verdict, track, run, model, timeline, traffic, job.job_dir, list(measured.values()), deciding,
               ranks)
        if run.out_of_memory_kills:
            _say_memory_ran_out(verdict, run)
        if run.loopback_bytes is None and verdict["verdict"] != "timeout":
            verdict["notes"].append("the ranks' traffic was not measured (it is counted on the sandbox's own "
                                    "network, and this run had no sandbox).")
        if run.truncated_logs:
            verdict["notes"].append(f"output was capped at {job.log_cap_bytes} bytes per log: "
                                    + ", ".join(Path(p).name for p in run.truncated_logs))
        if run.strays_killed:
            verdict["notes"].append(f"every rank had exited, but {run.strays_killed} processes they started were "
                                    f"still running and kept horovodrun from ending; the grader ended them at once "
                                    f"(a run must stop what it starts).")
        if run.survivors_killed and not run.stopped_at_target:  # after the grader's own stop, expected
            verdict["notes"].append(f"{run.survivors_killed} processes of the run outlived horovodrun and were "
                                    f"killed by the grader.")
        if graded_model is not None:  # the grader's own copy, never the run's file itself
            shutil.copyfile(graded_model, out_dir / track.model_file)
            verdict["model_path"] = str(out_dir / track.model_file)
    except Exception as error:  # the grader's own failure: still a verdict, with the reason
        verdict["verdict"] = "error"
        verdict["reasons"] = [f"internal error in the grader (not your submission's fault): "
                              f"{type(error).__name__}: {error}"]
        (out_dir / "grader-error.log").write_text(traceback.format_exc())
    except BaseException:  # stopped (SIGTERM, Ctrl-C): the stored verdict says so, and nothing counts
        verdict["verdict"] = "error"
        verdict["reasons"] = ["the grader was stopped before this submission was graded; nothing was "
                              "measured. Submit it again."]
        raise
    finally:
        if live is not None:
            live.abandon()
        if heldout is not None:
            heldout.close()
        verdict["finished_at"] = launch.utc_now()
        if job_dir is not None and job_dir.exists():
            shutil.rmtree(job_dir, ignore_errors=True)
        store.write_json_atomic(out_dir / "verdict.json", verdict)
        _finish(verdict, out_dir, report, database, student)
    return verdict


def _finish(verdict: dict, out_dir: Path, report, database, student) -> None:
    try:
        report({"state": "done", "elapsed_s": verdict["wall_time_s"], "time_budget_s": verdict["time_budget_s"],
                "epochs_seen": verdict["epochs_seen"], "latest_accuracy": verdict["heldout_accuracy"],
                "checkpoint_mtime": None, "verdict": verdict["verdict"],
                "heldout_curve": [{"index": snapshot["index"], "at_s": snapshot["at_s"],
                                   "accuracy": snapshot["heldout_accuracy"], "reason": None}
                                  for snapshot in verdict["snapshots"] if snapshot["heldout_accuracy"] is not None]})
        store.ResultsDatabase(database).record(verdict, student=student)
    except Exception as error:  # the verdict file is written; say that the database is behind
        verdict["notes"].append(f"the results database could not be updated: {error}")
        store.write_json_atomic(out_dir / "verdict.json", verdict)
