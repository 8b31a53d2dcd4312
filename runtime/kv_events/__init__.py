"""KV cache events between replicas and routers (issue 29), torch-free:

- ``config``: :class:`KVEventsConfig`, vLLM's ``--kv-events-config`` shape.
- ``wire``: the msgpack messages on the ZMQ socket (vLLM's ``KVEventBatch`` encoding) and
  the JSON snapshot a late reader starts from.
"""
