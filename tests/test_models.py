"""The course's networks: right shapes, raw-pixel input, ghost batch norm, and safe-mode saving."""

from __future__ import annotations

import numpy as np
import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from scalelab import models  # noqa: E402


def _count(model, layer_type):
    return sum(isinstance(layer, layer_type) for layer in model.layers)


def test_small_cnn_maps_raw_fashion_pixels_to_class_probabilities():
    model = models.small_cnn()
    pixels = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1)).astype("uint8")
    probabilities = model(pixels, training=False).numpy()
    assert probabilities.shape == (4, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert isinstance(model.layers[1], tf.keras.layers.Rescaling)


def test_batch_norm_flag_adds_one_normalisation_per_convolution():
    plain = models.cifar_cnn(batch_norm=False)
    normalised = models.cifar_cnn(batch_norm=True)
    assert _count(plain, tf.keras.layers.BatchNormalization) == 0
    assert _count(normalised, tf.keras.layers.BatchNormalization) == _count(normalised, tf.keras.layers.Conv2D) == 6


def test_bn_momentum_sets_how_fast_the_running_statistics_follow_the_batches():
    norms = [layer for layer in models.cifar_cnn(bn_momentum=0.9).layers
             if isinstance(layer, tf.keras.layers.BatchNormalization)]
    assert len(norms) == 6 and {layer.momentum for layer in norms} == {0.9}
    pixels = np.random.default_rng(1).integers(100, 256, (8, 28, 28, 1)).astype("uint8")
    for momentum in (0.9, 0.99):
        # One training step moves each running mean from 0 a fraction (1 − momentum) of the way to the batch mean.
        model = models.small_cnn(batch_norm=True, bn_momentum=momentum)
        norm = model.get_layer("block0_bn0")
        norm_input = model.get_layer("block0_conv0")(model.get_layer("rescale")(pixels)).numpy()
        norm(norm_input, training=True)
        np.testing.assert_allclose(norm.moving_mean.numpy(), (1 - momentum) * norm_input.mean(axis=(0, 1, 2)),
                                   rtol=1e-4, atol=1e-7)


def test_ghost_batch_norm_normalises_each_group_separately():
    model = models.cifar_cnn(batch_norm=True, ghost_batch_size=4)
    norm = next(layer for layer in model.layers if isinstance(layer, tf.keras.layers.BatchNormalization))
    assert norm.virtual_batch_size == 4
    # Keras forms ghost batches by striding (batch 8, ghost size 4: examples 0,2,4,6 and 1,3,5,7).
    # Give the two ghost batches very different values: ghost BN centres each on its own mean.
    layer = tf.keras.layers.BatchNormalization(virtual_batch_size=4, center=False, scale=False)
    values = np.zeros((8, 1), "float32")
    values[0::2, 0] = [1, 2, 3, 4]
    values[1::2, 0] = [100, 101, 102, 103]
    out = layer(values, training=True).numpy()
    np.testing.assert_allclose(out[0::2].mean(), 0, atol=1e-4)
    np.testing.assert_allclose(out[1::2].mean(), 0, atol=1e-4)
    whole_batch = tf.keras.layers.BatchNormalization(center=False, scale=False)(values, training=True).numpy()
    assert whole_batch[0::2].mean() < -0.9, "plain batch norm mixes the groups: the check above can fail"
    with pytest.raises(Exception):
        layer(np.zeros((6, 1), "float32"), training=True)  # not a multiple of the ghost batch


def test_wide_resnet_has_the_requested_depth_and_width():
    model = models.wide_resnet(depth=10, width=2)
    convolutions = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D)
                    and "shortcut" not in layer.name]
    assert len(convolutions) == 1 + 3 * 2 * 1  # stem + three groups of one two-convolution block
    assert convolutions[-1].filters == 64 * 2
    assert model(np.zeros((2, 32, 32, 3), "uint8")).shape == (2, 10)
    with pytest.raises(ValueError, match="6n \\+ 4"):
        models.wide_resnet(depth=12)


def test_saved_model_loads_in_safe_mode_and_predicts_the_same(tmp_path):
    model = models.cifar_cnn(batch_norm=True)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    pixels = np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3)).astype("float32")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = tf.keras.models.load_model(path, compile=False, safe_mode=True)
    np.testing.assert_allclose(loaded.predict(pixels, verbose=0), model.predict(pixels, verbose=0), rtol=1e-5)
