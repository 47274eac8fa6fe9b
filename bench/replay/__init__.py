"""Replay studies on recorded traces, and the recording of traces on a GPU."""
