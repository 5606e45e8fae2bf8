"""The experiment's schema, its YAML loading and overrides, and building objects from class paths: the records every layer reads."""
