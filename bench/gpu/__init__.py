"""Studies on the GPU, and the shells that run a GPU session."""
