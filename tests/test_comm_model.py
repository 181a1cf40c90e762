"""scalelab.comm_model: the step-time model behind lab 4's predict-then-measure sliders (throughput and scaling
efficiency from 1 to 1024 ranks for each allreduce algorithm)."""

from __future__ import annotations

import pytest

from scalelab import comm, comm_model

RANKS = [2 ** k for k in range(11)]                                     # 1 … 1024
# The lab's GPU cluster: ResNet-50 (30 ms + 2.5 ms per image, 102 MB of gradients), α = 5 µs, 100 Gb/s.
GPU_CLUSTER = comm_model.StepFigures(t_fixed_s=0.030, t_image_s=0.0025, model_bytes=102.4e6, alpha_s=5e-6,
                                     beta_s_per_byte=1 / 12.5e9, batch_per_rank=128)


def test_the_allreduce_term_is_the_ring_cost_2_p_minus_1_alpha_plus_2_p_minus_1_over_p_n_beta():
    figures = comm_model.StepFigures(t_fixed_s=0.01, t_image_s=0.001, model_bytes=1e8, alpha_s=1e-5,
                                     beta_s_per_byte=1e-9, batch_per_rank=32)
    compute, communicate = comm_model.step_time_s("ring", 8, figures)
    assert compute == pytest.approx(0.01 + 32 * 0.001)
    assert communicate == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 1e8 * 1e-9)      # 0.17514 s
    assert comm_model.step_time_s("butterfly", 8, figures)[1] == pytest.approx(3 * 1e-5 + 3 * 1e8 * 1e-9)
    assert comm_model.step_time_s("reduction_tree", 8, figures)[1] == pytest.approx(6 * 1e-5 + 6 * 1e8 * 1e-9)
    assert comm_model.step_time_s("parameter_server", 8, figures)[1] == pytest.approx(14 * 1e-5 + 14 * 1e8 * 1e-9)
    for algorithm in comm.ALGORITHMS:
        assert comm_model.step_time_s(algorithm, 8, figures)[1] == comm.allreduce_time_s(algorithm, 1e8, 8, 1e-5, 1e-9)


def test_throughput_and_efficiency_have_the_known_values_of_the_gpu_cluster():
    # One GPU: 128 images in 30 + 320 ms. Eight: + 2·7·5 µs + 2·7/8 · 102.4 MB / 12.5 GB/s = 14.406 ms.
    assert comm_model.throughput("ring", 1, GPU_CLUSTER) == pytest.approx(128 / 0.350)
    assert comm_model.throughput("ring", 8, GPU_CLUSTER) == pytest.approx(8 * 128 / 0.364406)
    assert comm_model.scaling_efficiency("ring", 8, GPU_CLUSTER) == pytest.approx(0.350 / 0.364406)


def test_efficiency_is_1_on_one_rank_and_falls_as_ranks_are_added_for_every_algorithm():
    prediction = comm_model.predict(GPU_CLUSTER, RANKS)
    assert list(prediction) == list(comm.ALGORITHMS)
    for algorithm, rows in prediction.items():
        efficiency = rows["efficiency"]
        assert efficiency[0] == pytest.approx(1.0), algorithm
        assert all(later < earlier for earlier, later in zip(efficiency, efficiency[1:])), algorithm
        assert rows["communication_share"][0] == 0 and 0 < rows["communication_share"][-1] < 1
        assert rows["images_per_s"][0] == pytest.approx(128 / 0.350)


def test_the_ring_scales_best_for_a_large_model_and_the_parameter_server_worst():
    prediction = comm_model.predict(GPU_CLUSTER, RANKS)
    at_1024 = {algorithm: rows["efficiency"][-1] for algorithm, rows in prediction.items()}
    assert max(at_1024, key=at_1024.get) == "ring" and min(at_1024, key=at_1024.get) == "parameter_server"
    assert at_1024["ring"] > 0.9 and at_1024["parameter_server"] < 0.05
    # The ring's throughput keeps growing (its bytes are bounded); the parameter server's stalls.
    ring = prediction["ring"]["images_per_s"]
    assert all(later > earlier for earlier, later in zip(ring, ring[1:]))


def test_a_latency_bound_setting_makes_the_butterfly_beat_the_ring():
    tiny_model = comm_model.StepFigures(t_fixed_s=0.001, t_image_s=1e-5, model_bytes=1e3, alpha_s=1e-3,
                                        beta_s_per_byte=1e-9, batch_per_rank=8)
    assert comm_model.scaling_efficiency("butterfly", 64, tiny_model) > comm_model.scaling_efficiency(
        "ring", 64, tiny_model)


def test_the_model_rejects_figures_it_cannot_price():
    with pytest.raises(ValueError, match="batch_per_rank"):
        comm_model.StepFigures(0.01, 0.001, 1e6, 1e-5, 1e-9, batch_per_rank=0)
    with pytest.raises(ValueError, match="negative"):
        comm_model.StepFigures(0.01, -0.001, 1e6, 1e-5, 1e-9, batch_per_rank=8)
    with pytest.raises(ValueError, match="power-of-two"):
        comm_model.throughput("butterfly", 12, GPU_CLUSTER)
