"""The SQLite store: the controller's state in one file (WAL), for one controller.

- :mod:`.state`: :class:`~.state.ControllerState`, regions and replica sets, built on
- :mod:`.servers` (memory servers: registration, heartbeats, drains) and
  :mod:`.leases` (owner leases);
- :mod:`.db`: the tables and their upgrades, the connection and its lock, and the
  reads of rows into records.
"""
