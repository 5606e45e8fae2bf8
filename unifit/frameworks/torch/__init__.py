"""PyTorch support: TrainModule and the engine that runs it."""
