"""Grading lab 3's conversion: quick hints from the script's names, and a probed two-rank run whose records answer
each step's question (probe: one rank's instruments; run: the two ranks and how they ended; questions: the
answers the graded cells give). ``conversion_*``: the Horovod edition (horovodrun, Keras); ``ddp_*``: the PyTorch
edition (torchrun, DDP)."""
