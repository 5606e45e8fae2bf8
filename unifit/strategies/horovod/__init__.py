"""Horovod (ring-allreduce) for PyTorch and Keras modules.

`strategy.py` holds everything framework-neutral (start-up settings, rank facts, collectives,
barriers, error handling); `torch_adapter.py` and `tf_adapter.py` are its training parts (the
registry's table pairs them with it by framework) and hold the few calls that differ
(optimizer wrapping and parameter broadcast for torch; a grouped allreduce of the gradients and a
broadcast of variable values for TensorFlow), the way Horovod's own `_keras` package splits it.
"""
