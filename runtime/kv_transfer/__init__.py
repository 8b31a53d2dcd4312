"""Moving KV cache blocks between replicas (issue 29, docs/routing.md "Peer KV pull"): ``config``
(KVTransferConfig, vLLM's ``--kv-transfer-config``), ``wire`` (the framed block format and its
checks), ``peer_pull`` (the pulling side's HTTP client). Torch-free: the tensors are read and
written by :mod:`kvfleet.runtime.worker.kv_blocks`."""
