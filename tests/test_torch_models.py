"""The course's PyTorch networks match their Keras twins, and a saved model runs without the code that defined it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import keras_only, subprocess_env
from scalelab import torch_models

# A fresh interpreter that knows nothing of scalelab: it loads the program and scores the images it is given.
SCORE_ELSEWHERE = """
import json, sys
import numpy as np, torch
program = torch.export.load(sys.argv[1])
images = np.load(sys.argv[2])
with torch.no_grad():
    scores = program.module()(torch.from_numpy(images))
print(json.dumps({"scores": scores.tolist(), "scalelab_imported": "scalelab" in sys.modules}))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pixels(count: int, shape=(32, 32, 3), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, *shape), dtype=np.uint8)


@keras_only
def test_the_pytorch_networks_have_the_keras_networks_parameters_and_output_ten_scores():
    from scalelab import models

    twins = [(torch_models.cifar_cnn(batch_norm=False), models.cifar_cnn(batch_norm=False), (32, 32, 3)),
             (torch_models.cifar_cnn(batch_norm=True), models.cifar_cnn(batch_norm=True), (32, 32, 3)),
             (torch_models.SmallCNN(), models.small_cnn(), (28, 28, 1))]
    for network, keras_network, shape in twins:
        trainable = sum(int(np.prod(weight.shape)) for weight in keras_network.trainable_weights)
        assert sum(p.numel() for p in network.parameters()) == trainable
        # batch norm's moving mean and variance: Keras's non-trainable weights, PyTorch's buffers
        assert sum(b.numel() for name, b in network.named_buffers() if "running" in name) == \
            keras_network.count_params() - trainable
        network.eval()
        scores = network(torch.from_numpy(pixels(3, shape)))
        assert scores.shape == (3, 10) and torch.isfinite(scores).all()


def test_an_exported_model_scores_any_batch_in_a_process_that_never_imports_the_course(tmp_path):
    torch.manual_seed(0)
    network = torch_models.cifar_cnn()
    network.train()  # as it is during training: the export must still record the network evaluating
    path = torch_models.export_model_atomically(network, tmp_path / "model.pt2", torch.from_numpy(pixels(4)))
    assert network.training, "exporting must leave a training network training"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"], "no partial file may be left behind"
    images = pixels(5, seed=1)  # another batch size than the example's
    np.save(tmp_path / "images.npy", images)
    script = tmp_path / "score.py"
    script.write_text(SCORE_ELSEWHERE)
    # -I: no site-packages path tricks and no current directory; the venv's torch only.
    scored = subprocess.run([sys.executable, "-I", str(script), str(path), str(tmp_path / "images.npy")],
                            capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    answer = json.loads(scored.stdout.strip().splitlines()[-1])
    assert answer["scalelab_imported"] is False
    network.eval()
    with torch.no_grad():
        expected = network(torch.from_numpy(images)).numpy()
    assert np.allclose(np.array(answer["scores"]), expected, atol=1e-5)


def test_a_ddp_wrapped_model_is_exported_as_its_own_network(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)
    try:
        network = torch_models.SmallCNN()
        wrapped = torch.nn.parallel.DistributedDataParallel(network)
        path = torch_models.export_model_atomically(wrapped, tmp_path / "model.pt2",
                                                    torch.from_numpy(pixels(2, (28, 28, 1))))
    finally:
        torch.distributed.destroy_process_group()
    program = torch.export.load(path)
    state = program.state_dict
    assert set(state) == set(network.state_dict()), "the program holds the network's weights, not the wrapper's"
    with pytest.raises(Exception):
        program.module()(torch.from_numpy(pixels(2, (32, 32, 3))))  # the shape it was exported for, only


def test_each_ddp_rank_gets_a_gpu_of_its_own_with_nccl_shares_fewer_with_gloo_or_trains_on_the_cpu():
    from scalelab.torch_models import ddp_device

    # One GPU per local rank: rank k on GPU k, NCCL.
    assert [ddp_device(rank, 4, cuda_devices=4) for rank in range(4)] == [
        (torch.device("cuda", rank), "nccl") for rank in range(4)]
    # Two ranks on one GPU (NCCL refuses that): both on it, over Gloo; three ranks on two GPUs in turn.
    assert [ddp_device(rank, 2, cuda_devices=1) for rank in range(2)] == [(torch.device("cuda", 0), "gloo")] * 2
    assert [ddp_device(rank, 3, cuda_devices=2)[0].index for rank in range(3)] == [0, 1, 0]
    # No GPU (this machine, or CUDA_VISIBLE_DEVICES empty in the grader's measuring process): the CPU, Gloo.
    assert ddp_device(1, 2, cuda_devices=0) == (torch.device("cpu"), "gloo")
    assert ddp_device(0, 2) == ((torch.device("cpu"), "gloo") if not torch.cuda.is_available()
                                else ddp_device(0, 2, torch.cuda.device_count()))
