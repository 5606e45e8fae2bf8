"""The framework axis: how a module's steps run, how data becomes batches, how state is saved."""
