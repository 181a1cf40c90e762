"""ScaleLab: the shared course library (data, models, callbacks, learning rates, optimizers)."""

__version__ = "0.1.0"
