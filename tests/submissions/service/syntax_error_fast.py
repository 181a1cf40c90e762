"""A fast submission for the Assess service tests: a syntax error fails in seconds, without a launch."""
import horovod.tensorflow.keras as hvd

hvd.init(
