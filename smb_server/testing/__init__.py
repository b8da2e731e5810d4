"""What tests and benchmarks need to run this package for real, on one machine: an etcd
member (:mod:`.etcd`), a group of controller processes on one store with memory servers
beside them (:mod:`.controllers`), and the harness of threaded checks (:mod:`.harness`:
every rank's function in a thread or a process, a poll with a deadline). Nothing in the
package's own code imports it."""
from __future__ import annotations

from .controllers import ControllerGroup
from .etcd import EtcdNotInstalled, EtcdServer
from .harness import WAIT, RankFailed, rank_failures, run_ranks, spawn_ranks, wait_until

__all__ = ["WAIT", "ControllerGroup", "EtcdNotInstalled", "EtcdServer", "RankFailed", "rank_failures", "run_ranks",
           "spawn_ranks", "wait_until"]
