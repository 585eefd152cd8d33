"""Commands that produce numbers: benchmarks and acceptance experiments. No library logic lives here."""
