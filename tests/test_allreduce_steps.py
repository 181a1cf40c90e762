"""scalelab.allreduce_steps: the step-by-step simulations lab 4 draws (reduction tree, butterfly, ring) end with
the sum on every rank, take the steps and send the bytes the α-β cost models of scalelab.comm charge."""

from __future__ import annotations

import numpy as np
import pytest

from scalelab import allreduce_steps, comm


def test_the_seven_node_reduction_tree_of_1_to_7_ends_with_28_at_the_root_then_everywhere():
    steps = allreduce_steps.reduction_tree(range(1, 8))
    assert [step.phase for step in steps] == ["start"] + ["reduce"] * 3 + ["broadcast"] * 3
    after_reduce = steps[3]
    assert after_reduce.values[0, 0] == 28 and after_reduce.contributors[0, 0] == 7
    assert [tuple(message[:2]) for message in steps[1].messages] == [(1, 0), (3, 2), (5, 4)]
    assert steps[1].values[:, 0].tolist() == [3, 2, 7, 4, 11, 6, 7]
    assert np.all(steps[-1].values == 28)


def test_the_four_node_butterfly_gives_every_node_the_sum_in_two_exchanges():
    steps = allreduce_steps.butterfly([1, 2, 3, 4])
    assert [step.phase for step in steps] == ["start", "exchange", "exchange"]
    assert steps[1].values[:, 0].tolist() == [3, 3, 7, 7]
    assert np.all(steps[-1].values == 10) and np.all(steps[-1].contributors == 4)
    with pytest.raises(ValueError, match="power-of-two"):
        allreduce_steps.butterfly([1, 2, 3])


def test_the_ring_reduce_scatters_then_allgathers_to_the_full_sum_vector_on_every_node():
    buffers = [np.arange(8.0) * (rank + 1) for rank in range(4)]
    steps = allreduce_steps.ring(buffers)
    assert [step.phase for step in steps] == ["start"] + ["reduce-scatter"] * 3 + ["allgather"] * 3
    after_reduce_scatter = steps[3]
    # Each rank now owns one fully summed chunk: rank r chunk (r + 1) mod p.
    for rank in range(4):
        assert after_reduce_scatter.contributors[rank, (rank + 1) % 4] == 4
        assert sorted(after_reduce_scatter.contributors[rank]) == [1, 2, 3, 4]
    for values in steps[-1].values:
        assert np.allclose(values, sum(buffers))
    assert all(message.destination == (message.source + 1) % 4 for step in steps for message in step.messages)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 8, 16])
def test_every_simulation_ends_with_the_sum_on_every_rank_in_the_cost_models_steps_and_bytes(ranks):
    rng = np.random.default_rng(ranks)
    numbers = 6 * ranks                      # chunks of equal size: the ring's 2(p-1)/p·n is then exact
    buffers = [rng.normal(size=numbers) for _ in range(ranks)]
    for algorithm in allreduce_steps.SIMULATIONS:
        if algorithm == "butterfly" and ranks & (ranks - 1):
            continue
        steps = allreduce_steps.simulate(algorithm, buffers)
        assert np.allclose(steps[-1].values, sum(buffers)), algorithm
        cost = comm.allreduce_cost(algorithm, numbers, ranks)
        assert len(steps) - 1 == cost.steps, algorithm
        if algorithm == "reduction_tree":      # rank 0's link: it receives, then sends, the whole buffer each step
            busiest = sum(message.numbers for step in steps for message in step.messages if 0 in message[:2])
        else:
            busiest = max(sum(step.sent_numbers(rank) for step in steps) for rank in range(ranks))
        assert busiest == pytest.approx(cost.busiest_bytes), algorithm
        assert sum(message.numbers for step in steps for message in step.messages) == pytest.approx(
            cost.total_bytes), algorithm


def test_simulate_names_the_algorithms_it_has():
    with pytest.raises(ValueError, match="no simulation"):
        allreduce_steps.simulate("parameter_server", [1, 2])
