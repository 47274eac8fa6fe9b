"""The sidecar under load, and what the agent costs a training process."""
