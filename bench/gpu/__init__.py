"""Studies on the GPU, and the shells that run a whole GPU check in one command."""
