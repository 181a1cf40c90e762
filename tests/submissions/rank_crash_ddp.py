"""The DDP edition's crash: rank 1 crashes right after start; rank 0 waits for it in an allreduce. The job must
end fast."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank one failed on purpose")
dist.all_reduce(torch.ones(1))
