"""Imported before grpc: gRPC's fork handlers default to off where the agent is imported.

The agent's stream keeps a gRPC call open for the life of the process, so at every fork (each
DataLoader worker started with the fork method) gRPC's handlers find "other threads calling
into gRPC", skip themselves, and log a line saying so. They could not serve the child anyway:
its copy of the agent is abandoned (allocator_ext.agent) and never calls gRPC. gRPC documents
fork support as something a program turns on (GRPC_ENABLE_FORK_SUPPORT=true, with
GRPC_POLL_STRATEGY=poll); a program that sets the variable itself keeps its choice. Where grpc
was imported before the agent, the variable comes too late and gRPC keeps its handlers.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
