"""The optional dataclass flavour: betterproto2 messages and stubs of engine.v1, re-exported.

They are pleasant to build and pattern-match, but (de)serialize 30-400x slower than the upb ``_pb2``
messages the clients use, so keep them off hot paths. They need the extra:
``pip install "engine-proto[betterproto]"``.
The bytes are the same on the wire: a message serialized by one flavour parses with the other.

Example::

    from engine_client.dataclasses import GenerateRequest, TokenIds
    from engine_proto.engine.v1 import generate_pb2

    req = GenerateRequest(request_id="r1", token_ids=TokenIds(ids=[1, 2, 3]))
    same = generate_pb2.GenerateRequest.FromString(bytes(req))
"""

from __future__ import annotations

from engine_proto.betterproto.engine.v1 import *  # noqa: F403
from engine_proto.betterproto.engine.v1 import __all__ as __all__
