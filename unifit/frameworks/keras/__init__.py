"""TensorFlow/Keras support: KerasModule and the engine that runs it."""
