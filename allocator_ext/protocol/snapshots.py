"""What allocwatch adds to the layout of PyTorch's memory snapshot
(`torch.cuda.memory._snapshot()`): written by the agent and by the allocator's own snapshot,
carried to the sidecar and `ctl` by the snapshot command, read by replay."""

# What a snapshot cannot say about its run and allocwatch's recorders keep in it under this key
# (bench/replay/record_traces.py writes it):
# {"memory_fraction": F or None, "device_total_bytes": N}.
RECORDING_KEY = "allocwatch_recording"
