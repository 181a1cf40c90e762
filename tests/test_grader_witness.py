"""The witnesses of distributed training, piece by piece: the timeline read as it grows (stamped on arrival,
bounded, deaf to rewrites), the traffic figure and the sentences a student reads."""

import json
import os
import time
from pathlib import Path

import pytest

from scalelab.grader import witness

HEADER = '[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":1}},\n'


def tensor(pid: int, name: str) -> str:
    return (f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": "{name}"}}}},\n'
            f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}},\n')


def allreduce(pid: int, ts: int, ranks=(0, 1)) -> str:
    """One allreduce of one tensor as Horovod 0.28.1 writes it (the seek-back leaves '}]' then ',' between)."""
    marks = "".join(f'{{"ph": "X", "name": "{rank}", "ts": {ts + 1}, "pid": {pid}, "dur": 0}},' for rank in ranks)
    return (f'{{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": {ts}, "pid": {pid}}},{marks}'
            f'{{"ph": "E", "ts": {ts + 5}, "pid": {pid}}},'
            f'{{"ph": "B", "name": "ALLREDUCE", "ts": {ts + 6}, "pid": {pid}}},'
            f'{{"ph": "E", "ts": {ts + 9}, "pid": {pid}, "args": {{"dtype": "float32", "shape": "[4]"}}}},\n')


def tensors_header(count: int) -> str:
    return HEADER + "".join(tensor(pid, f"DistributedSGD_Allreduce/HorovodAllreduce_grads_{pid}_0")
                            for pid in range(1, count + 1))


def counted(text_by_arrival: list[tuple[float, str]]) -> witness.TimelineEvidence:
    counter = witness.TimelineCounter()
    parser = witness.EventParser(counter.feed)
    for arrived, text in text_by_arrival:
        parser.feed(text, arrived)
    return counter.evidence()


def test_a_timeline_written_after_the_fact_is_told_apart_from_one_written_live():
    steps = [allreduce(pid, 1_000_000 + step * 1_000_000, (0, 1)) for step in range(20) for pid in (1, 2, 3)]
    # The same events (19 s of training by their own clock), written as they happen or all at once at the end.
    live = counted([(0.0, tensors_header(3))] + [(1.0 + i // 3, text) for i, text in enumerate(steps)])
    at_once = counted([(0.0, tensors_header(3)), (40.0, "".join(steps))])
    for evidence in (live, at_once):
        assert evidence.ranks_seen == [0, 1] and evidence.allreduce_count == 60 and evidence.allreduced_tensors == 3
        assert evidence.active_deciles == 10 and evidence.span_s == 19.0
    assert live.late_allreduces == 0
    assert at_once.late_allreduces > 0.6 * 60  # all but the last 5 s of training arrived late
    traffic = witness.traffic_evidence(None, at_once, None, None, 2)
    sentences = witness.evidence_problems(at_once, traffic, np=2, trainable_variables=3, min_spread_deciles=8)
    assert len(sentences) == 1 and "written after the fact" in sentences[0]
    assert witness.evidence_problems(live, traffic, np=2, trainable_variables=3, min_spread_deciles=8) == []


def test_allreduces_only_at_the_start_or_the_end_of_training_leave_tenths_empty():
    broadcast = '{"ph": "B", "name": "BROADCAST", "ts": 1000000, "pid": 1},{"ph": "E", "ts": 1000010, "pid": 1},\n'
    end_only = [allreduce(1, 9_000_000 + step * 10_000) for step in range(50)]
    evidence = counted([(0.0, tensors_header(1) + broadcast)] + [(9.0, text) for text in end_only])
    assert evidence.allreduce_count == 50 and evidence.active_deciles == 1


def test_events_split_anywhere_between_reads_are_all_counted():
    whole = tensors_header(3) + "".join(allreduce(pid, 1_000 + s * 100) for s in range(10) for pid in (1, 2, 3))
    for cut in (1, 7, 64, 1000, 4096):
        pieces = [whole[i:i + cut] for i in range(0, len(whole), cut)]
        evidence = counted([(i * 0.01, piece) for i, piece in enumerate(pieces)])
        assert evidence.allreduce_count == 30 and evidence.ranks_seen == [0, 1], cut


def test_garbage_in_the_timeline_keeps_memory_bounded_and_later_events_count():
    counter = witness.TimelineCounter()
    parser = witness.EventParser(counter.feed)
    parser.feed('{"unterminated": "' + "x" * (3 * witness.UNPARSED_CAP_BYTES), 0.0)
    assert len(parser.pending) <= witness.UNPARSED_CAP_BYTES + 1
    parser.feed(tensors_header(1) + allreduce(1, 10), 1.0)
    assert counter.evidence().allreduce_count == 1


def test_stream_reads_what_is_added_stamped_on_arrival_and_ignores_rewrites(tmp_path):
    stream = witness.TimelineStream(tmp_path).start()
    try:
        with open(stream.path, "a") as horovod:  # what rank 0's Horovod does: open, then append events
            horovod.write(tensors_header(2))
            horovod.flush()
            for step in range(6):
                horovod.write("".join(allreduce(pid, 1_000 + step * 100) for pid in (1, 2)))
                horovod.flush()
                time.sleep(0.25)
        # Afterwards the run rewrites what Horovod wrote, in place: nothing already read changes.
        read_before = stream.offset
        with open(stream.path, "r+") as run:
            run.write(tensors_header(2) + "".join(allreduce(pid, s) for s in range(6) for pid in (1, 2))
                      .replace('"name": "1"', '"name": "7"')[: read_before - len(tensors_header(2))])
        time.sleep(0.3)
        assert stream.offset == read_before
        os.truncate(stream.path, 10)  # and cuts it short: counted, never read again
        time.sleep(0.3)
    finally:
        evidence = stream.stop()
    assert evidence.allreduce_count == 12 and evidence.ranks_seen == [0, 1]
    assert stream.truncations == 1
    assert evidence.late_allreduces == 0


def test_stream_file_is_the_graders_and_the_run_can_only_write_it(tmp_path):
    stream = witness.TimelineStream(tmp_path)
    info = os.stat(stream.path)
    assert oct(info.st_mode & 0o777) == "0o600"
    if os.geteuid() == 0:
        stream.allow(61997)
        assert os.stat(stream.path).st_uid == 61997
    stream.start()
    assert stream.stop().events == 0


def test_traffic_far_below_what_the_gradients_need_is_a_problem_with_the_figures():
    timeline = witness.TimelineEvidence(ranks_seen=[0, 1], allreduce_count=1200, allreduced_tensors=12,
                                        active_deciles=10, span_s=30.0, events=20_000, late_allreduces=0)
    needed = witness.expected_traffic_bytes(117_434, steps=100, np=2)
    assert needed == 117_434 * 4 * 100 * 2  # ring allreduce: 2(N-1)/N per rank, N ranks
    honest = witness.traffic_evidence(int(1.1 * needed), timeline, 117_434, 12, 2)
    compressed = witness.traffic_evidence(int(0.5 * needed), timeline, 117_434, 12, 2)  # hvd.Compression.fp16
    dummies = witness.traffic_evidence(400_000, timeline, 117_434, 12, 2)
    assert honest.steps == 100 and witness.traffic_problem(honest) is None
    assert witness.traffic_problem(compressed) is None
    sentence = witness.traffic_problem(dummies)
    assert sentence and "0.40 MB" in sentence and "93.9 MB" in sentence and "DistributedOptimizer" in sentence
    # many names allreduced once each do not make the steps look few: steps count per variable of the model
    spread_thin = witness.TimelineEvidence([0, 1], 120, 120, 10, 30.0, 1_000)
    assert witness.traffic_evidence(500_000, spread_thin, 117_434, 12, 2).steps == 10
    unmeasured = witness.traffic_evidence(None, timeline, 117_434, 12, 2)
    assert unmeasured.ratio is None and witness.traffic_problem(unmeasured) is None


def test_coordination_in_small_packets_cannot_make_up_the_gradients_traffic():
    """Figures measured on a sandbox-like loopback (`unshare -n`, two ranks of small_cnn's 117,434 parameters):
    Horovod's coordination alone for 15 s at a 0.1 ms cycle, against a real DistributedOptimizer epoch of 60
    steps. Counted in bytes alone, the coordination passed for 30 % of the gradients' traffic."""
    timeline = witness.TimelineEvidence(ranks_seen=[0, 1], allreduce_count=188 * 12, allreduced_tensors=12,
                                        active_deciles=10, span_s=30.0, events=20_000, late_allreduces=0)
    coordination = witness.traffic_evidence(52_517_642, timeline, 117_434, 12, 2, packets=581_699)
    assert coordination.loopback_bytes / coordination.expected_bytes > witness.MIN_TRAFFIC_RATIO
    assert coordination.bulk_bytes == 0 and coordination.ratio == 0
    sentence = witness.traffic_problem(coordination)
    assert "sent 0.00 MB to each other beyond Horovod's own coordination (52.52 MB in all)" in sentence
    sixty_steps = witness.TimelineEvidence([0, 1], 60 * 12, 12, 10, 20.0, 10_000)
    honest = witness.traffic_evidence(62_318_144, sixty_steps, 117_434, 12, 2, packets=66_004)
    assert honest.ratio > 0.9 and witness.traffic_problem(honest) is None


def test_each_failed_witness_gets_its_own_sentence():
    timeline = witness.TimelineEvidence(ranks_seen=[0], allreduce_count=20, allreduced_tensors=2,
                                        active_deciles=2, span_s=5.0, events=200)
    traffic = witness.traffic_evidence(1_000, timeline, 50_000, 10, 2)
    problems = witness.evidence_problems(timeline, traffic, np=2, trainable_variables=10, min_spread_deciles=8)
    assert len(problems) == 4
    assert "ranks [1] never took part" in problems[0]
    assert "only 2 distinct tensors" in problems[1]
    assert "2 of 10 tenths" in problems[2]
    assert "sent 0.00 MB to each other beyond Horovod's own coordination (0.00 MB in all)" in problems[3]
    nothing = witness.TimelineCounter().evidence()
    assert witness.evidence_problems(nothing, witness.traffic_evidence(None, nothing, None, None, 2), 2, 4, 8) == [
        next(p for p in witness.evidence_problems(nothing, witness.traffic_evidence(None, nothing, None, None, 2), 2, 4, 8)
             if "shows no allreduce" in p)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_figures_for_the_verdict_are_plain_json(ranks):
    timeline = witness.TimelineEvidence([0, 1], 10, 2, 9, 3.0, 100)
    figures = witness.figures(timeline, witness.traffic_evidence(10**6, timeline, 1000, 2, ranks), 1000)
    assert json.loads(json.dumps(figures)) == figures
    assert figures["traffic"]["minimum_ratio"] == witness.MIN_TRAFFIC_RATIO


def test_the_traffics_spread_counts_tenths_with_bulk_bytes_and_ignores_small_packets():
    segment = witness.BULK_SAMPLE_BYTES
    # (seconds, cumulative bytes, cumulative packets) as the grader samples the loopback
    steady = [(t, t * 4 * segment, t * 10) for t in range(0, 21)]
    assert witness.traffic_spread(steady) == (10, 19.0)
    # Bulk at the start and at the end only: two tenths, however long the span.
    bursts = [(0, 0, 0), (1, 2 * segment, 5), (2, 2 * segment, 6), (30, 2 * segment, 90), (31, 4 * segment, 95)]
    assert witness.traffic_spread(bursts) == (2, 30.0)
    # Many small packets (coordination, keep-alives) never count as bulk, whatever they add up to.
    chatter = [(t, t * 1000 * 100, t * 1000) for t in range(0, 21)]
    assert witness.traffic_spread(chatter) == (0, 0.0)
    assert witness.traffic_spread([]) == (0, 0.0)


def test_a_ddp_runs_witnesses_name_a_rank_that_only_waits_too_little_traffic_and_bursts():
    parameters = 100_000
    per_step = witness.expected_traffic_bytes(parameters, 1, 2)
    enough = witness.ddp_traffic_evidence(int(per_step * 50), parameters, 2, packets=1000)
    assert enough.steps == pytest.approx(50, abs=0.5) and enough.ratio > 1
    honest = witness.RankEvidence([40.0, 38.5], active_deciles=10, span_s=30.0)
    assert witness.ddp_evidence_problems(honest, enough, np=2, min_spread_deciles=8) == []
    waiting = witness.RankEvidence([40.0, 3.0], active_deciles=10, span_s=30.0)
    assert "computed less than 50% of the busiest" in witness.ddp_evidence_problems(waiting, enough, 2, 8)[0]
    one = witness.RankEvidence([40.0], active_deciles=10, span_s=30.0)
    assert "saw 1 rank processes of the 2" in witness.ddp_evidence_problems(one, enough, 2, 8)[0]
    little = witness.ddp_traffic_evidence(int(per_step * 5), parameters, 2, packets=100)
    assert f"less than {witness.MIN_DDP_STEPS} averagings" in witness.ddp_evidence_problems(honest, little, 2, 8)[0]
    bursty = witness.RankEvidence([40.0, 38.5], active_deciles=2, span_s=30.0)
    assert "in only 2 of 10 tenths" in witness.ddp_evidence_problems(bursty, enough, 2, 8)[0]
    figures = witness.ddp_figures(honest, enough, parameters)
    assert json.loads(json.dumps(figures)) == figures and figures["traffic"]["minimum_steps"] == witness.MIN_DDP_STEPS
