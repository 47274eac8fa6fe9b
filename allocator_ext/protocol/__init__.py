"""What the in-process agent and the sidecar share: the allocwatch.v1 protocol, the lowest
package of both (it imports nothing of allocwatch's above it).

- `proto/`: the generated gRPC and protobuf stubs (protos/generate.sh);
- `version`: the package's version and the protocol's;
- `handshake`: the rule by which the hello's protocol versions accept each other;
- `service`: the gRPC service's names, the message-size limit and the bounds of command
  arguments;
- `snapshots`: what allocwatch adds to PyTorch's snapshot layout;
- `nvml`: GPU memory figures through NVML (the agent reads its own GPU, the sidecar every GPU
  it can see);
- `files`: the bounded read of a file named in settings or the environment (a token), and the
  whole-or-nothing write of a file others read.

Importing it loads neither the compiled core nor torch nor the sidecar: allocator_ext's own
``__init__`` imports nothing until a name is used.
"""
