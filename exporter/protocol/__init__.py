"""What the in-process agent and the sidecar share: the allocwatch.v1 protocol.

- `proto/`: the generated gRPC and protobuf stubs (protos/generate.sh);
- `version`: the package's version and the protocol's;
- `handshake`: the rule by which the hello's protocol versions accept each other;
- `service`: the gRPC service's names and the message-size limit;
- `nvml`: GPU memory figures through NVML (the agent reads its own GPU, the sidecar every GPU
  it can see);
- `figures`: figures derived from a report (the fragmentation ratios);
- `settings`: the check of an allocator settings string;
- `files`: the bounded read of a file named in settings or the environment (a token).

Kept free of imports, like the packages above it: importing the protocol pulls in neither the
sidecar nor the compiled core.
"""
