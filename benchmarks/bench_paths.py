"""Where benchmarks write, from this file's place: the same folders whatever directory a script runs from
(relative paths once left a benchmarks/benchmarks/_scratch/ behind)."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"  # committed: the figures docs pages quote, with the command that made them
SCRATCH = BENCHMARKS / "_scratch"  # run directories and smoke outputs, ignored by git
