"""Saves a model that was never trained (and so never allreduced anything)."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd

from scalelab.models import small_cnn

hvd.init()
if hvd.rank() == 0:
    output = Path(os.environ["SCALELAB_OUTPUT_DIR"])
    output.mkdir(parents=True, exist_ok=True)
    small_cnn(input_shape=(28, 28, 1)).save(output / "model.keras")
