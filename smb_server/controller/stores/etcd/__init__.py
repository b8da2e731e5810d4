"""The etcd store: the controller's state in etcd v3, shared by several controllers.

- :mod:`.state`: :class:`~.state.EtcdState`, regions and replica sets, built on
- :mod:`.create` (batched region creates), :mod:`.servers` (memory servers),
  :mod:`.leases` (owner leases) and :mod:`.leadership` (standing by, taking over,
  barriers' generations);
- :mod:`.txn`: the keys, snapshots read at one revision, fenced commits and retries
  they all write with;
- :mod:`.kv`: the etcd client (store URLs, KV, leases, watches) on etcd's own gRPC API.
"""
