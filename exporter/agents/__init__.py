"""The agents' endpoint: the gRPC server the in-process agents connect to (`grpc_server`), the
screening of what they send (`screening`), and its settings section (`config`)."""
