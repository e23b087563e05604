"""engine-server: the engine.v1 gRPC inference server."""

__version__ = "0.1.0"
