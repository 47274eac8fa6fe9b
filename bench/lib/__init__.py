"""Parts shared by several benchmarks."""
