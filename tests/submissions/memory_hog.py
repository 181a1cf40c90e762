"""Each rank takes memory 256 MiB at a time, up to 4 GiB: more than a run may use. Prints how far it got."""
import numpy as np

blocks = []
for block in range(16):
    blocks.append(np.ones(256 * 1024**2 // 8))  # 256 MiB, every page written
    print(f"holding {len(blocks) * 256} MiB", flush=True)
print("took 4 GiB and was never stopped", flush=True)
raise SystemExit(1)
