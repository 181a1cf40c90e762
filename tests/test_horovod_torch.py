"""Horovod for PyTorch, as `make setup` builds it: two ranks under `horovodrun`, with Gloo and with MPI.

Each rank trains the same small model on its own data with `hvd.DistributedOptimizer`, after broadcasting rank 0's
weights; averaged gradients leave both ranks with identical weights, which neither would reach alone. The negative
control (the plain optimizer) shows the comparison can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import subprocess_env

pytestmark = pytest.mark.slow

TWO_RANKS = """
import json, sys
import torch
import horovod.torch as hvd

hvd.init()
torch.manual_seed(hvd.rank())  # different starting weights and data on each rank
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
if sys.argv[1] == "distributed":
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
for _ in range(20):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
weights = [round(float(value), 6) for value in torch.cat([p.detach().flatten() for p in model.parameters()])]
# a file per rank: the ranks' long lines interleave on horovodrun's output
with open(f"rank{hvd.rank()}.json", "w") as record:
    json.dump({"rank": hvd.rank(), "size": hvd.size(), "sum": float(total), "weights": weights}, record)
"""


def run_two_ranks(horovodrun, controller: str, optimizer: str, tmp_path) -> list[dict]:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    result = subprocess.run([horovodrun, "-np", "2", controller, sys.executable, str(script), optimizer],
                            capture_output=True, text=True, timeout=180, env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_two_pytorch_ranks_allreduce_and_end_with_identical_weights(controller, horovodrun, tmp_path):
    ranks = run_two_ranks(horovodrun, controller, "distributed", tmp_path)
    assert [(rank["rank"], rank["size"], rank["sum"]) for rank in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_without_the_distributed_optimizer_the_pytorch_ranks_end_apart(horovodrun, tmp_path):
    ranks = run_two_ranks(horovodrun, "--gloo", "plain", tmp_path)
    assert [rank["sum"] for rank in ranks] == [3.0, 3.0]
    assert ranks[0]["weights"] != ranks[1]["weights"]
