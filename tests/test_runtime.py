"""scalelab.runtime.pin_gpu: one GPU per local rank, on a host whose GPUs TensorFlow is made to list (fakes stand in
for the GPUs, and for the calls that would configure them)."""

from __future__ import annotations

import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from scalelab.runtime import pin_gpu  # noqa: E402


@pytest.fixture
def fake_gpus(monkeypatch):
    """Make TensorFlow list the GPUs the test puts in the returned list; record which ones get configured."""
    gpus: list = []
    configured = {"memory_growth": [], "visible": []}
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda device_type=None: list(gpus) if device_type == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda device, enable: configured["memory_growth"].append((device.name, enable)))
    monkeypatch.setattr(tf.config, "set_visible_devices",
                        lambda devices, device_type=None: configured["visible"].append((devices.name, device_type)))
    return gpus, configured


def gpu(index: int):
    return tf.config.PhysicalDevice(name=f"/physical_device:GPU:{index}", device_type="GPU")


def test_each_local_rank_sees_only_the_gpu_of_its_own_index(fake_gpus):
    gpus, configured = fake_gpus
    gpus.extend(gpu(index) for index in range(4))
    assert pin_gpu(2) == "/physical_device:GPU:2"
    assert configured == {"memory_growth": [("/physical_device:GPU:2", True)],
                          "visible": [("/physical_device:GPU:2", "GPU")]}


@pytest.mark.parametrize("local_rank, gpu_count", [(1, 1), (4, 4), (7, 2)])
def test_a_local_rank_without_a_gpu_of_its_own_is_refused_not_given_a_shared_one(fake_gpus, local_rank, gpu_count):
    gpus, configured = fake_gpus
    gpus.extend(gpu(index) for index in range(gpu_count))
    with pytest.raises(RuntimeError) as refused:
        pin_gpu(local_rank)
    message = str(refused.value)
    assert f"local rank {local_rank}" in message and f"{gpu_count} GPU(s)" in message
    assert "-np no more than the GPUs per host" in message
    assert configured == {"memory_growth": [], "visible": []}


def test_on_a_host_without_gpus_nothing_is_pinned(fake_gpus):
    _, configured = fake_gpus
    assert pin_gpu(3) is None
    assert configured == {"memory_growth": [], "visible": []}
