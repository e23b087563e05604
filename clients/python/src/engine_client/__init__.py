"""engine-client: typed Python client for the engine.v1 gRPC API."""

__version__ = "0.1.0"
