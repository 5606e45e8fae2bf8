"""The `unifit` command line (fit, validate, test, predict, launch, plot, view, config docs)."""
