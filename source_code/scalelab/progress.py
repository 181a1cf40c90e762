"""What every course script prints, whichever framework it trains with (no TensorFlow or PyTorch import)."""

from __future__ import annotations


def format_epoch(epoch: int, epochs: int, logs: dict) -> str:
    """The one line per epoch every course script prints, with the same words in the same order."""
    parts = [f"epoch {epoch + 1}/{epochs}"]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        if key in logs:
            parts.append(f"{key} {logs[key]:.4f}")
    if "lr" in logs:
        parts.append(f"lr {logs['lr']:.4g}")
    if "images_per_s" in logs:
        parts.append(f"img/s {logs['images_per_s']:.0f}")
    if "elapsed_s" in logs:
        parts.append(f"elapsed {logs['elapsed_s']:.1f} s")
    return "  ".join(parts)
