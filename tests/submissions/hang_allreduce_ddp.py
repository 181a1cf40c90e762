"""The DDP edition's hang: rank 0 waits in an allreduce that rank 1 never joins, which only the budget ends."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))
else:
    while True:
        time.sleep(1)
