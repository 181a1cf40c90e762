"""LARS, LAMB and NovoGrad against the papers' formulas written out in NumPy, plus Keras and Horovod use.

The reference updates below are written from the papers (float64 NumPy), not from the implementation:
one layer = one variable, norms are Frobenius norms of the whole variable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from conftest import subprocess_env  # noqa: E402
from scalelab.lr import WarmupStepSchedule  # noqa: E402
from scalelab.optimizers import LAMB, LARS, NovoGrad, trust_ratio  # noqa: E402

# A 2x2 kernel and a bias vector, with two steps of fixed gradients.
KERNEL_START = np.array([[0.5, -1.0], [1.5, 2.0]])
BIAS_START = np.array([0.1, -0.2])
GRADIENTS = [
    {"kernel": np.array([[0.1, -0.2], [0.3, 0.05]]), "bias": np.array([0.01, -0.02])},
    {"kernel": np.array([[-0.05, 0.1], [0.2, -0.3]]), "bias": np.array([0.03, 0.01])},
]

HYPERPARAMETERS = {
    LARS: {"momentum": 0.9, "eta": 0.02, "weight_decay": 0.01, "epsilon": 1e-9},
    LAMB: {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-6, "weight_decay": 0.01},
    NovoGrad: {"beta_1": 0.95, "beta_2": 0.98, "epsilon": 1e-8, "weight_decay": 0.01},
}
LEARNING_RATES = {LARS: 0.5, LAMB: 0.1, NovoGrad: 0.1}


def norm(array):
    return float(np.sqrt(np.sum(np.square(array))))


def lars_reference(start, gradients, learning_rates, momentum, eta, weight_decay, epsilon, excluded):
    """You et al. 2017, Algorithm 1: ratio = eta||w|| / (||g|| + wd||w|| + eps); v = mu v + lr ratio (g + wd w).

    An ``excluded`` (1-D) variable takes plain momentum SGD: no ratio, no decay.
    """
    weight, velocity = start.copy(), np.zeros_like(start)
    for gradient, learning_rate in zip(gradients, learning_rates):
        if not excluded:
            ratio = eta * norm(weight) / (norm(gradient) + weight_decay * norm(weight) + epsilon)
            step_direction = ratio * (gradient + weight_decay * weight)
        else:
            step_direction = gradient
        velocity = momentum * velocity + learning_rate * step_direction
        weight = weight - velocity
    return weight


def lamb_reference(start, gradients, learning_rates, beta_1, beta_2, epsilon, weight_decay, excluded):
    """You et al. 2019, Algorithm 2: Adam moments with bias correction, r + wd w scaled by ||w|| / ||r + wd w||.

    An ``excluded`` (1-D) variable takes plain Adam: no ratio, no decay.
    """
    weight, m, v = start.copy(), np.zeros_like(start), np.zeros_like(start)
    for t, (gradient, learning_rate) in enumerate(zip(gradients, learning_rates), start=1):
        m = beta_1 * m + (1 - beta_1) * gradient
        v = beta_2 * v + (1 - beta_2) * gradient ** 2
        m_hat = m / (1 - beta_1 ** t)
        v_hat = v / (1 - beta_2 ** t)
        r = m_hat / (np.sqrt(v_hat) + epsilon)
        if not excluded:
            r = r + weight_decay * weight
            ratio = norm(weight) / norm(r)
        else:
            ratio = 1.0
        weight = weight - learning_rate * ratio * r
    return weight


def novograd_reference(start, gradients, learning_rates, beta_1, beta_2, epsilon, weight_decay, excluded):
    """Ginsburg et al. 2019, Algorithm 1: scalar v per layer (||g||^2 first), m = b1 m + g/(sqrt v + eps) + wd w.

    An ``excluded`` (1-D) variable only loses the decay term.
    """
    weight, m, v = start.copy(), np.zeros_like(start), None
    for gradient, learning_rate in zip(gradients, learning_rates):
        squared_norm = np.sum(gradient ** 2)
        v = squared_norm if v is None else beta_2 * v + (1 - beta_2) * squared_norm
        m = beta_1 * m + gradient / (np.sqrt(v) + epsilon) + (0.0 if excluded else weight_decay * weight)
        weight = weight - learning_rate * m
    return weight


REFERENCES = {LARS: lars_reference, LAMB: lamb_reference, NovoGrad: novograd_reference}


def run_optimizer(optimizer, steps):
    """Apply ``steps`` of the fixed gradients to a float32 kernel and bias; return their values."""
    kernel = tf.Variable(KERNEL_START, dtype=tf.float32, name="kernel")
    bias = tf.Variable(BIAS_START, dtype=tf.float32, name="bias")
    for gradient in GRADIENTS[:steps]:
        optimizer.apply_gradients([(tf.constant(gradient["kernel"], tf.float32), kernel),
                                   (tf.constant(gradient["bias"], tf.float32), bias)])
    return kernel.numpy(), bias.numpy()


def expected(optimizer_class, name, steps, learning_rates, exclude_1d):
    """The reference result for variable ``name`` (the bias is the 1-D one)."""
    start = KERNEL_START if name == "kernel" else BIAS_START
    gradients = [gradient[name] for gradient in GRADIENTS[:steps]]
    return REFERENCES[optimizer_class](start, gradients, learning_rates[:steps],
                                       excluded=exclude_1d and name == "bias", **HYPERPARAMETERS[optimizer_class])


OPTIMIZERS = [LARS, LAMB, NovoGrad]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager-graph", "xla"])
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_steps_match_the_papers_update_computed_by_hand(optimizer_class, steps, jit_compile):
    learning_rate = LEARNING_RATES[optimizer_class]
    optimizer = optimizer_class(learning_rate=learning_rate, **HYPERPARAMETERS[optimizer_class])
    # Keras only compiles the update with XLA when a GPU is present; forcing it covers the GPU path here.
    optimizer.jit_compile = jit_compile
    kernel, bias = run_optimizer(optimizer, steps)
    learning_rates = [learning_rate] * steps
    np.testing.assert_allclose(kernel, expected(optimizer_class, "kernel", steps, learning_rates, True),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bias, expected(optimizer_class, "bias", steps, learning_rates, True),
                               rtol=1e-5, atol=1e-7)
    assert not np.allclose(kernel, KERNEL_START)


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_1d_variables_are_adapted_and_decayed_when_exclusion_is_off(optimizer_class):
    learning_rate = LEARNING_RATES[optimizer_class]
    included = optimizer_class(learning_rate=learning_rate, exclude_1d_variables=False,
                               **HYPERPARAMETERS[optimizer_class])
    kernel, bias = run_optimizer(included, 2)
    _, bias_excluded = run_optimizer(
        optimizer_class(learning_rate=learning_rate, **HYPERPARAMETERS[optimizer_class]), 2)
    np.testing.assert_allclose(kernel, expected(optimizer_class, "kernel", 2, [learning_rate] * 2, False),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(bias, expected(optimizer_class, "bias", 2, [learning_rate] * 2, False),
                               rtol=1e-5, atol=1e-7)
    assert not np.allclose(bias, bias_excluded, rtol=1e-4, atol=0)


def test_keras_exclude_from_weight_decay_by_name_is_honoured():
    settings = dict(HYPERPARAMETERS[LARS], weight_decay=0.0)
    optimizer = LARS(learning_rate=LEARNING_RATES[LARS], **HYPERPARAMETERS[LARS])
    optimizer.exclude_from_weight_decay(var_names=["kernel"])
    kernel, _ = run_optimizer(optimizer, 2)
    np.testing.assert_allclose(kernel, lars_reference(KERNEL_START, [g["kernel"] for g in GRADIENTS],
                                                      [LEARNING_RATES[LARS]] * 2, excluded=False, **settings),
                               rtol=1e-5, atol=1e-7)


def test_1d_exclusion_is_on_by_default():
    assert LARS().exclude_1d_variables and LAMB().exclude_1d_variables and NovoGrad().exclude_1d_variables


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_learning_rate_schedule_is_evaluated_at_each_step(optimizer_class):
    # Warmup over the first step: rate 0.1 * peak at step 0, the peak from step 1 on.
    peak = LEARNING_RATES[optimizer_class]
    schedule = WarmupStepSchedule(peak_lr=peak, steps_per_epoch=1, warmup_epochs=1.0)
    optimizer = optimizer_class(learning_rate=schedule, **HYPERPARAMETERS[optimizer_class])
    kernel, _ = run_optimizer(optimizer, 2)
    np.testing.assert_allclose(kernel, expected(optimizer_class, "kernel", 2, [peak / 10, peak], True),
                               rtol=1e-5, atol=1e-7)


def test_trust_ratio_follows_the_lars_formula():
    weight = np.ones((2, 2))  # ||w|| = 2
    gradient = np.full((2, 2), 0.5)  # ||g|| = 1
    assert float(trust_ratio(weight, gradient, eta=0.001, weight_decay=0.1, epsilon=0.0)) == pytest.approx(
        0.001 * 2 / (1 + 0.1 * 2))
    assert float(trust_ratio(weight, gradient, eta=0.02)) == pytest.approx(0.04, rel=1e-6)


def test_trust_ratio_is_one_when_weights_or_gradient_are_zero():
    assert float(trust_ratio(np.zeros((3, 3)), np.ones((3, 3)), eta=0.001)) == 1.0
    assert float(trust_ratio(np.ones((3, 3)), np.zeros((3, 3)), eta=0.001, weight_decay=0.1)) == 1.0


def test_lamb_moves_a_zero_initialised_layer_with_ratio_one():
    optimizer = LAMB(learning_rate=0.1, exclude_1d_variables=False)
    kernel = tf.Variable(tf.zeros((2, 2)))
    optimizer.apply_gradients([(tf.constant(GRADIENTS[0]["kernel"], tf.float32), kernel)])
    # First Adam step: m_hat / sqrt(v_hat) = sign(g) (up to epsilon), and ratio 1 since ||w|| = 0.
    np.testing.assert_allclose(kernel.numpy(), -0.1 * np.sign(GRADIENTS[0]["kernel"]), rtol=1e-4)


def test_novograd_starts_a_layer_first_seen_late_from_its_own_gradient_norm():
    optimizer = NovoGrad(learning_rate=0.1, beta_1=0.0, epsilon=0.0)
    early = tf.Variable(tf.ones((2, 2)))
    late = tf.Variable(tf.ones((2, 2)))
    optimizer.build([early, late])
    optimizer.apply_gradients([(tf.ones((2, 2)), early)])
    optimizer.apply_gradients([(tf.fill((2, 2), 3.0), late)])
    # v = ||g||^2 = 36, so the step is 0.1 * 3 / 6 per entry, not damped by (1 - beta_2).
    np.testing.assert_allclose(late.numpy(), np.full((2, 2), 1 - 0.1 * 3 / 6), rtol=1e-6)


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_keras_base_weight_decay_is_not_applied_on_top(optimizer_class):
    # A 1-D variable with a zero gradient gets no update from any of the three (1-D variables are not decayed);
    # Keras's own decoupled decay, were it applied as well, would shrink it by lr * wd.
    optimizer = optimizer_class(learning_rate=0.1, weight_decay=0.5)
    bias = tf.Variable([1.0, 2.0])
    optimizer.apply_gradients([(tf.zeros(2), bias)])
    np.testing.assert_array_equal(bias.numpy(), [1.0, 2.0])


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_get_config_round_trips_through_from_config(optimizer_class):
    optimizer = optimizer_class(learning_rate=0.25, exclude_1d_variables=False, clipnorm=1.5,
                                **HYPERPARAMETERS[optimizer_class])
    config = optimizer.get_config()
    rebuilt = optimizer_class.from_config(config)
    assert rebuilt.get_config() == config
    for name, value in HYPERPARAMETERS[optimizer_class].items():
        assert getattr(rebuilt, name) == pytest.approx(value)
        assert config[name] == pytest.approx(value)
    assert config["learning_rate"] == pytest.approx(0.25)
    assert config["exclude_1d_variables"] is False
    assert rebuilt.clipnorm == 1.5


def test_get_config_round_trips_a_learning_rate_schedule():
    schedule = WarmupStepSchedule(peak_lr=0.4, steps_per_epoch=10, warmup_epochs=2, boundaries=[5], factor=0.5)
    config = LAMB(learning_rate=schedule).get_config()
    rebuilt = LAMB.from_config(json.loads(json.dumps(config)))
    assert isinstance(rebuilt._learning_rate, WarmupStepSchedule)
    assert rebuilt._learning_rate.get_config() == schedule.get_config()


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_bad_hyperparameters_are_refused_with_a_clear_error(optimizer_class):
    with pytest.raises(ValueError, match="weight_decay"):
        optimizer_class(weight_decay=-0.1)
    field = "momentum" if optimizer_class is LARS else "beta_1"
    with pytest.raises(ValueError, match=field):
        optimizer_class(**{field: 1.5})


def small_classifier(seed: int = 0) -> tf.keras.Model:
    """Dense -> BatchNorm -> Dense: kernels, biases and batch-norm parameters, as in the course's CNNs."""
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([
        tf.keras.Input(shape=(8,)),
        tf.keras.layers.Dense(16),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.ReLU(),
        tf.keras.layers.Dense(3),
    ])


def synthetic_problem(seed: int = 0):
    """Three classes decided by a fixed linear rule on Gaussian inputs."""
    generator = np.random.default_rng(seed)
    features = generator.normal(size=(256, 8)).astype("float32")
    labels = np.argmax(features @ generator.normal(size=(8, 3)), axis=1)
    return features, labels


FIT_SETTINGS = {
    LARS: {"learning_rate": 1.0, "eta": 0.01, "weight_decay": 1e-4},
    LAMB: {"learning_rate": 0.02, "weight_decay": 1e-4},
    NovoGrad: {"learning_rate": 0.02, "weight_decay": 1e-4},
}


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_fit_lowers_the_loss_of_a_small_model(optimizer_class):
    features, labels = synthetic_problem()
    model = small_classifier()
    model.compile(optimizer=optimizer_class(**FIT_SETTINGS[optimizer_class]),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    loss_before = model.evaluate(features, labels, verbose=0)
    model.fit(features, labels, batch_size=64, epochs=5, shuffle=False, verbose=0)
    loss_after = model.evaluate(features, labels, verbose=0)
    assert loss_after < 0.7 * loss_before, (loss_before, loss_after)


@pytest.mark.parametrize("optimizer_class", OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_model_with_the_optimizer_saves_and_loads_in_safe_mode(optimizer_class, tmp_path):
    features, labels = synthetic_problem()
    model = small_classifier()
    model.compile(optimizer=optimizer_class(**FIT_SETTINGS[optimizer_class]),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(features, labels, batch_size=64, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = tf.keras.models.load_model(path, compile=False, safe_mode=True)
    np.testing.assert_allclose(loaded.predict(features[:8], verbose=0), model.predict(features[:8], verbose=0),
                               rtol=1e-6)

    recompiled = tf.keras.models.load_model(path, safe_mode=True)
    assert type(recompiled.optimizer) is optimizer_class
    assert recompiled.optimizer.get_config() == model.optimizer.get_config()
    for restored, original in zip(recompiled.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(restored.numpy(), original.numpy())


HOROVOD_SCRIPT = textwrap.dedent("""
    import json, tempfile
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    from scalelab.optimizers import LAMB, LARS, NovoGrad

    hvd.init()
    generator = np.random.default_rng(0)
    features = generator.normal(size=(64, 8)).astype("float32")
    labels = generator.integers(0, 3, size=64)
    results = {"size": hvd.size()}
    for optimizer_class in (LARS, LAMB, NovoGrad):
        tf.keras.utils.set_random_seed(0)
        model = tf.keras.Sequential([tf.keras.Input(shape=(8,)), tf.keras.layers.Dense(16),
                                     tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(3)])
        optimizer = hvd.DistributedOptimizer(optimizer_class(learning_rate=0.01))
        model.compile(optimizer=optimizer,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = [weight.copy() for weight in model.get_weights()]
        history = model.fit(features, labels, batch_size=64, epochs=1, verbose=0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        moved = any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        with tempfile.TemporaryDirectory() as scratch:
            model.save(scratch + "/model.keras")
            loaded = tf.keras.models.load_model(scratch + "/model.keras", safe_mode=True)
        results[optimizer_class.__name__] = {
            "wrapped_is_subclass": isinstance(optimizer, optimizer_class),
            "wrapped_name": optimizer._name,
            "iterations": int(optimizer.iterations.numpy()),
            "loss_is_finite": bool(np.isfinite(history.history["loss"][0])),
            "weights_moved": moved,
            "loaded_optimizer_module": type(loaded.optimizer).__module__,
            "loaded_optimizer_class": type(loaded.optimizer).__name__,
        }
    print("RESULTS " + json.dumps(results))
""")


def test_optimizers_run_a_fit_step_wrapped_by_horovod_distributed_optimizer():
    completed = subprocess.run([sys.executable, "-c", HOROVOD_SCRIPT], env=subprocess_env(),
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results_line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULTS "))
    results = json.loads(results_line[len("RESULTS "):])
    assert results["size"] == 1
    for name in ("LARS", "LAMB", "NovoGrad"):
        outcome = results[name]
        assert outcome["wrapped_is_subclass"], outcome
        assert outcome["wrapped_name"] == f"Distributed{name}"
        assert outcome["iterations"] == 1
        assert outcome["loss_is_finite"] and outcome["weights_moved"], outcome
        # A file saved with the wrapped optimizer reloads, compiled, as the plain course optimizer.
        assert (outcome["loaded_optimizer_module"], outcome["loaded_optimizer_class"]) == (
            "scalelab.optimizers", name)
