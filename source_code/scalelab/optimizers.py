"""Large-batch optimizers for tf.keras (TensorFlow 2.15, Keras 2.15): LARS, LAMB and NovoGrad.

All three adapt the step size layer by layer. A *layer* here is one variable (a kernel, a bias, a
batch-norm scale), and every norm ``||x||`` is the Frobenius (L2) norm of the whole variable.

Why the course has its own: tensorflow-addons 0.23 (its last release; the project ended in May 2024)
has LAMB and NovoGrad but no LARS, and builds them on Keras's legacy optimizer API. These subclass the
current ``tf.keras.optimizers.Optimizer``, so they work in ``model.fit``, wrapped by Horovod's
``DistributedOptimizer`` (which allreduces the gradients before ``update_step`` sees them), in
``.keras`` files (``load_model(..., safe_mode=True)``) and with a float learning rate or a
``LearningRateSchedule``.

Conventions shared by the three:

- ``weight_decay`` is the algorithm's own, *coupled* decay: ``weight_decay * w`` is added to the update
  before the layer-wise scaling, as the papers write it. Keras's base-class decay (decoupled, applied
  before the step) is switched off so it is never applied twice. ``exclude_from_weight_decay()`` of the
  base class still works for picking variables out by name.
- ``exclude_1d_variables`` (default ``True``): variables with at most one dimension (biases, batch-norm
  ``gamma``/``beta``) get no weight decay and, in LARS and LAMB, no trust ratio (it is taken as 1): the
  common practice in large-batch training code, since these small vectors are not what the layer-wise
  scaling is for, and decaying them tends to hurt accuracy.
- Sparse gradients (``tf.IndexedSlices``, from embeddings) are made dense: a layer norm needs the whole
  gradient.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["LARS", "LAMB", "NovoGrad", "trust_ratio"]


def _ratio_or_one(numerator, denominator, first_norm, second_norm):
    """``numerator / denominator`` where both norms are positive, else 1.

    A zero weight (a zero-initialised layer) or a zero gradient would give a ratio of 0 or a division
    by 0; taking 1 lets such a layer move with the plain learning rate instead.
    """
    usable = tf.logical_and(first_norm > 0, second_norm > 0)
    safe_denominator = tf.where(usable, denominator, tf.ones_like(denominator))
    return tf.where(usable, numerator / safe_denominator, tf.ones_like(numerator))


def trust_ratio(weight, gradient, eta: float = 0.001, weight_decay: float = 0.0, epsilon: float = 1e-9):
    """LARS's local learning-rate multiplier for one layer (You, Gitman and Ginsburg 2017, Algorithm 1)::

        eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)

    ``g`` is the loss gradient alone (without the decay term). The result is 1 when ``||w||`` or ``||g||``
    is 0. Takes NumPy arrays or tensors; returns a scalar tensor (``float(...)`` gives a number).
    """
    weight = tf.convert_to_tensor(weight)
    gradient = tf.cast(tf.convert_to_tensor(gradient), weight.dtype)
    weight_norm = tf.norm(weight)
    gradient_norm = tf.norm(gradient)
    denominator = (gradient_norm + tf.cast(weight_decay, weight.dtype) * weight_norm
                   + tf.cast(epsilon, weight.dtype))
    return _ratio_or_one(tf.cast(eta, weight.dtype) * weight_norm, denominator, weight_norm, gradient_norm)


def _dense(gradient, dtype):
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.convert_to_tensor(gradient)
    return tf.cast(gradient, dtype)


def _check_range(name: str, value: float, low: float, high: float) -> float:
    """``value`` as a float if ``low <= value < high``, else a ValueError naming the setting."""
    value = float(value)
    if not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), not {value}")
    return value


class _LayerwiseOptimizer(tf.keras.optimizers.Optimizer):
    """What LARS, LAMB and NovoGrad share: learning rate, coupled weight decay, the 1-D exclusion."""

    def __init__(self, learning_rate, weight_decay: float, exclude_1d_variables: bool, name: str, **kwargs):
        # The base class's weight decay is decoupled (w -= lr * wd * w before the step); ours is part of the update.
        super().__init__(name=name, weight_decay=None, **kwargs)
        self._learning_rate = self._build_learning_rate(learning_rate)
        self.weight_decay = _check_range("weight_decay", weight_decay, 0.0, float("inf"))
        self.exclude_1d_variables = bool(exclude_1d_variables)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        parent = cls.__bases__[0]
        registered_name = tf.keras.utils.get_registered_name(parent)
        if cls.__name__ == parent.__name__ and registered_name != parent.__name__:
            # Horovod's DistributedOptimizer wraps an optimizer in a same-named subclass made on the fly.
            # Saving that under the parent's registered name lets a .keras file from a Horovod run load
            # (compiled too) without Horovod; registering the parent again makes loading build the plain one.
            package, _, name = registered_name.partition(">")
            tf.keras.utils.register_keras_serializable(package, name)(cls)
            tf.keras.utils.register_keras_serializable(package, name)(parent)

    def _apply_weight_decay(self, variables):
        """Nothing here: ``update_step`` adds the decay inside the layer-wise update."""

    def _is_excluded(self, variable) -> bool:
        """True for biases and batch-norm parameters when ``exclude_1d_variables`` is set."""
        return self.exclude_1d_variables and variable.shape.rank is not None and variable.shape.rank <= 1

    def _weight_decay_for(self, variable) -> float:
        if self.weight_decay == 0 or self._is_excluded(variable) or not self._use_weight_decay(variable):
            return 0.0
        return self.weight_decay

    def _slot(self, slots, variable):
        return slots[self._index_dict[self._var_key(variable)]]

    def get_config(self):
        config = super().get_config()
        config.update({
            "learning_rate": self._serialize_hyperparameter(self._learning_rate),
            "weight_decay": self.weight_decay,
            "exclude_1d_variables": self.exclude_1d_variables,
        })
        return config


@tf.keras.utils.register_keras_serializable(package="scalelab")
class LARS(_LayerwiseOptimizer):
    """Layer-wise Adaptive Rate Scaling: momentum SGD with a per-layer trust ratio.

    You, Gitman and Ginsburg (2017), "Large Batch Training of Convolutional Networks",
    arXiv:1708.03888, Algorithm 1. For each layer with weights ``w`` and loss gradient ``g``, at each step::

        ratio = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)     (1 if ||w|| or ||g|| is 0)
        m     = momentum * m + learning_rate * ratio * (g + weight_decay * w)
        w     = w - m

    (the learning rate sits inside the momentum buffer, as in the paper). With ``exclude_1d_variables``
    a 1-D variable takes ``ratio = 1`` and no decay: plain momentum SGD at ``learning_rate``.
    :func:`trust_ratio` computes ``ratio`` on its own.

    ``learning_rate`` is the global rate (scaled with the batch as usual); ``eta`` is the trust
    coefficient, how far one step may move a layer relative to its weights' norm.
    """

    def __init__(self, learning_rate=0.1, momentum: float = 0.9, eta: float = 0.001, weight_decay: float = 0.0,
                 epsilon: float = 1e-9, exclude_1d_variables: bool = True, name: str = "LARS", **kwargs):
        super().__init__(learning_rate, weight_decay, exclude_1d_variables, name, **kwargs)
        self.momentum = _check_range("momentum", momentum, 0.0, 1.0)
        self.eta = _check_range("eta", eta, 0.0, float("inf"))
        self.epsilon = _check_range("epsilon", epsilon, 0.0, float("inf"))

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self.momentums = [self.add_variable_from_reference(variable, "m") for variable in var_list]
        self._built = True

    def update_step(self, gradient, variable):
        gradient = _dense(gradient, variable.dtype)
        learning_rate = tf.cast(self.learning_rate, variable.dtype)
        momentum_buffer = self._slot(self.momentums, variable)
        if self._is_excluded(variable):
            scaled_update = gradient
        else:
            weight_decay = self._weight_decay_for(variable)
            ratio = trust_ratio(variable, gradient, self.eta, weight_decay, self.epsilon)
            scaled_update = ratio * (gradient + weight_decay * variable)
        momentum_buffer.assign(self.momentum * momentum_buffer + learning_rate * scaled_update)
        variable.assign_sub(momentum_buffer)

    def get_config(self):
        config = super().get_config()
        config.update({"momentum": self.momentum, "eta": self.eta, "epsilon": self.epsilon})
        return config


@tf.keras.utils.register_keras_serializable(package="scalelab")
class LAMB(_LayerwiseOptimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam with a per-layer trust ratio.

    You et al. (2019), "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
    arXiv:1904.00962 (ICLR 2020), Algorithm 2 with the scaling function phi the identity. At step
    ``t = 1, 2, ...``, for each layer::

        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g**2
        m_hat = m / (1 - beta_1**t),   v_hat = v / (1 - beta_2**t)
        r = m_hat / (sqrt(v_hat) + epsilon) + weight_decay * w
        ratio = ||w|| / ||r||          (1 if ||w|| or ||r|| is 0)
        w = w - learning_rate * ratio * r

    With ``exclude_1d_variables`` a 1-D variable takes ``ratio = 1`` and no decay: plain Adam.
    """

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-6,
                 weight_decay: float = 0.0, exclude_1d_variables: bool = True, name: str = "LAMB", **kwargs):
        super().__init__(learning_rate, weight_decay, exclude_1d_variables, name, **kwargs)
        self.beta_1 = _check_range("beta_1", beta_1, 0.0, 1.0)
        self.beta_2 = _check_range("beta_2", beta_2, 0.0, 1.0)
        self.epsilon = _check_range("epsilon", epsilon, 0.0, float("inf"))

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self.first_moments = [self.add_variable_from_reference(variable, "m") for variable in var_list]
        self.second_moments = [self.add_variable_from_reference(variable, "v") for variable in var_list]
        self._built = True

    def update_step(self, gradient, variable):
        dtype = variable.dtype
        gradient = _dense(gradient, dtype)
        learning_rate = tf.cast(self.learning_rate, dtype)
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        first_moment = self._slot(self.first_moments, variable)
        second_moment = self._slot(self.second_moments, variable)

        first_moment.assign(beta_1 * first_moment + (1 - beta_1) * gradient)
        second_moment.assign(beta_2 * second_moment + (1 - beta_2) * tf.square(gradient))
        first_moment_hat = first_moment / (1 - tf.pow(beta_1, step))
        second_moment_hat = second_moment / (1 - tf.pow(beta_2, step))
        update = first_moment_hat / (tf.sqrt(second_moment_hat) + self.epsilon)
        weight_decay = self._weight_decay_for(variable)
        if weight_decay:
            update += weight_decay * variable
        if not self._is_excluded(variable):
            weight_norm = tf.norm(variable)
            update_norm = tf.norm(update)
            update *= _ratio_or_one(weight_norm, update_norm, weight_norm, update_norm)
        variable.assign_sub(learning_rate * update)

    def get_config(self):
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon})
        return config


@tf.keras.utils.register_keras_serializable(package="scalelab")
class NovoGrad(_LayerwiseOptimizer):
    """NovoGrad: momentum on gradients normalised by a per-layer second moment.

    Ginsburg et al. (2019), "Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of
    Deep Networks", arXiv:1905.11286, Algorithm 1. The variant implemented, for each layer::

        v = ||g||**2                                    on the layer's first step (while v is still 0)
        v = beta_2 * v + (1 - beta_2) * ||g||**2        afterwards
        m = beta_1 * m + (g / (sqrt(v) + epsilon) + weight_decay * w)      (m starts at 0)
        w = w - learning_rate * m

    ``v`` is one scalar per layer (the paper's point: half of Adam's memory). There is no bias
    correction, and no ``(1 - beta_1)`` factor on the new term (the paper's form, not the "gradient
    averaging" option some implementations add). ``exclude_1d_variables`` only removes the weight decay
    of 1-D variables; their gradients are still normalised, that normalisation being the algorithm itself.
    """

    def __init__(self, learning_rate=0.01, beta_1: float = 0.95, beta_2: float = 0.98, epsilon: float = 1e-8,
                 weight_decay: float = 0.0, exclude_1d_variables: bool = True, name: str = "NovoGrad",
                 **kwargs):
        super().__init__(learning_rate, weight_decay, exclude_1d_variables, name, **kwargs)
        self.beta_1 = _check_range("beta_1", beta_1, 0.0, 1.0)
        self.beta_2 = _check_range("beta_2", beta_2, 0.0, 1.0)
        self.epsilon = _check_range("epsilon", epsilon, 0.0, float("inf"))

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self.first_moments = [self.add_variable_from_reference(variable, "m") for variable in var_list]
        self.layer_second_moments = [self.add_variable_from_reference(variable, "v", shape=[])
                                     for variable in var_list]
        self._built = True

    def update_step(self, gradient, variable):
        dtype = variable.dtype
        gradient = _dense(gradient, dtype)
        learning_rate = tf.cast(self.learning_rate, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        first_moment = self._slot(self.first_moments, variable)
        layer_second_moment = self._slot(self.layer_second_moments, variable)

        squared_gradient_norm = tf.reduce_sum(tf.square(gradient))
        # Per layer, not per optimizer step: a layer that first gets a gradient later starts from ||g||^2 too.
        layer_second_moment.assign(tf.where(
            layer_second_moment > 0,
            beta_2 * layer_second_moment + (1 - beta_2) * squared_gradient_norm,
            squared_gradient_norm))
        normalised = gradient / (tf.sqrt(layer_second_moment) + self.epsilon)
        weight_decay = self._weight_decay_for(variable)
        if weight_decay:
            normalised += weight_decay * variable
        first_moment.assign(beta_1 * first_moment + normalised)
        variable.assign_sub(learning_rate * first_moment)

    def get_config(self):
        config = super().get_config()
        config.update({"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon})
        return config
