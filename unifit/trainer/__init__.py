"""The fit loop, module base classes, state, events, config schema and the command line."""
