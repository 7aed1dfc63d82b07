"""`splitserve bench ...`: the load generator (serve), its HTTP/gRPC clients, the trace replay on
mock clusters (replay), and their plots. They talk to a cluster as any client would; none imports
torch or the engine."""
