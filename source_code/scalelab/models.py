"""The course's networks.

Every model starts with a ``Rescaling`` layer, so it takes raw pixels (0–255) and a saved model can be
evaluated by the grader without knowing how the student normalised the data. Only built-in Keras layers
are used, so a saved model loads in Keras safe mode with no custom code.

``batch_norm=True`` adds batch normalisation after each convolution; ``ghost_batch_size=k`` makes it
ghost batch norm (statistics over groups of ``k`` images, Hoffer et al. 2017): the training batch size
must then be a multiple of ``k``, so use ``drop_remainder=True`` for training data.
"""

from __future__ import annotations

import tensorflow as tf

layers = tf.keras.layers


def _normalisation(batch_norm: bool, ghost_batch_size: int | None, name: str, momentum: float = 0.99):
    if not batch_norm:
        return None
    return layers.BatchNormalization(momentum=momentum, virtual_batch_size=ghost_batch_size, name=name)


def small_cnn(input_shape=(28, 28, 1), num_classes: int = 10, filters=(32, 64), dense_units: int = 128,
              batch_norm: bool = False, ghost_batch_size: int | None = None, dropout: float = 0.25,
              weight_decay: float = 0.0, name: str = "small_cnn", bn_momentum: float = 0.99) -> tf.keras.Model:
    """A small, fast CNN for CPUs: per entry of ``filters`` two 3×3 convolutions and a 2×2 max-pool.

    ``bn_momentum`` is how much of its running mean and variance a batch-norm layer keeps at each step; the model
    is evaluated with those running figures, so a short run (a few hundred steps) wants less than Keras's 0.99.
    """
    regulariser = tf.keras.regularizers.l2(weight_decay) if weight_decay else None
    inputs = tf.keras.Input(shape=input_shape, name="pixels")
    x = layers.Rescaling(1.0 / 255, name="rescale")(inputs)
    for block, width in enumerate(filters):
        for conv in range(2):
            x = layers.Conv2D(width, 3, padding="same", use_bias=not batch_norm, kernel_regularizer=regulariser,
                              name=f"block{block}_conv{conv}")(x)
            norm = _normalisation(batch_norm, ghost_batch_size, f"block{block}_bn{conv}", bn_momentum)
            if norm is not None:
                x = norm(x)
            x = layers.ReLU(name=f"block{block}_relu{conv}")(x)
        x = layers.MaxPooling2D(name=f"block{block}_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    if dropout:
        x = layers.Dropout(dropout, name="dropout")(x)
    x = layers.Dense(dense_units, activation="relu", kernel_regularizer=regulariser, name="dense")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="probabilities")(x)
    return tf.keras.Model(inputs, outputs, name=name)


def cifar_cnn(num_classes: int = 10, batch_norm: bool = True, ghost_batch_size: int | None = None,
              weight_decay: float = 0.0, dropout: float = 0.25, bn_momentum: float = 0.99) -> tf.keras.Model:
    """The CPU-sized CIFAR-10 network of the assessment and the large-batch lab (32-64-128 filters)."""
    return small_cnn((32, 32, 3), num_classes, filters=(32, 64, 128), dense_units=128, batch_norm=batch_norm,
                     ghost_batch_size=ghost_batch_size, dropout=dropout, weight_decay=weight_decay,
                     name="cifar_cnn", bn_momentum=bn_momentum)


def wide_resnet(input_shape=(32, 32, 3), num_classes: int = 10, depth: int = 16, width: int = 4,
                batch_norm: bool = True, ghost_batch_size: int | None = None, weight_decay: float = 5e-4,
                name: str | None = None) -> tf.keras.Model:
    """The course's WideResNet-style network (Zagoruyko & Komodakis 2016): WRN-depth-width, pre-activation.

    ``depth`` must be 6n + 4; each of the three groups has n residual blocks of two 3×3 convolutions.
    """
    if (depth - 4) % 6:
        raise ValueError(f"WideResNet depth must be 6n + 4 (10, 16, 22, 28, …), not {depth}")
    blocks_per_group = (depth - 4) // 6
    regulariser = tf.keras.regularizers.l2(weight_decay) if weight_decay else None

    def conv(filters, stride, label, kernel=3):
        return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                             kernel_regularizer=regulariser, name=label)

    def pre_activation(x, label):
        norm = _normalisation(batch_norm, ghost_batch_size, label + "_bn")
        if norm is not None:
            x = norm(x)
        return layers.ReLU(name=label + "_relu")(x)

    inputs = tf.keras.Input(shape=input_shape, name="pixels")
    x = layers.Rescaling(1.0 / 255, name="rescale")(inputs)
    x = conv(16, 1, "stem_conv")(x)
    for group, filters in enumerate((16 * width, 32 * width, 64 * width)):
        for block in range(blocks_per_group):
            label = f"group{group}_block{block}"
            stride = 2 if group > 0 and block == 0 else 1
            activated = pre_activation(x, label + "_a")
            shortcut = x
            if stride != 1 or x.shape[-1] != filters:
                shortcut = conv(filters, stride, label + "_shortcut", kernel=1)(activated)
            y = conv(filters, stride, label + "_conv_a")(activated)
            y = pre_activation(y, label + "_b")
            y = conv(filters, 1, label + "_conv_b")(y)
            x = layers.Add(name=label + "_add")([shortcut, y])
    x = pre_activation(x, "head")
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(num_classes, activation="softmax", kernel_regularizer=regulariser,
                           name="probabilities")(x)
    return tf.keras.Model(inputs, outputs, name=name or f"wrn_{depth}_{width}")
