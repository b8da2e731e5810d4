"""PyTorch training on the memory box: a parameter store and three update schemes.

    from smb_client.torch import ParameterStore, SyncDataParallel, SEASGD, HybridSEASGD

* :class:`ParameterStore` lays a model's parameters (float32, bfloat16, float16 or
  mixed; gradient and delta slots; buffers) out flat in regions, ``striped`` or
  ``layered``; the model's tensors become views of flat local buffers that region
  operations fill and send in place. ``save``/``load`` write and read checkpoints.
* :class:`SyncDataParallel`: gradients accumulated server-side, a barrier, averaged
  gradients pulled; pushes overlap the backward pass through per-layer hooks; buffers
  broadcast from rank 0 (or averaged) every step.
* :class:`SEASGD`: asynchronous elastic averaging with a private delta slot per worker.
* :class:`HybridSEASGD`: all-reduce inside a node, SEASGD across nodes.
* :class:`SharedCounters`: iteration counters with ``fetch_add`` and aligned stopping.
* :class:`WorkerEnv` / :func:`open_store`: ``torchrun`` variables and the
  master-creates, others-attach handshake.
* the ``torch.distributed`` backend ``"smb"`` (:mod:`.backend`), registered by this
  import: ``init_process_group("smb")`` and plain ``DistributedDataParallel``.
* :func:`job` / :class:`Job`: a job that creates or attaches its store, resumes from a
  checkpoint or an earlier attempt's store, and deletes its regions at the end (a
  crashed one's go with their lease).
* :class:`DistributedDataParallel`: :class:`SyncDataParallel` over a job in one call,
  in DDP's shape.

This package needs torch; ``import smb_client`` alone does not import it.
"""
from __future__ import annotations

from .backend import SMBProcessGroup, register
from .counters import SharedCounters, StopRule
from .ddp import DistributedDataParallel
from .flat import FlatModel, GradientHooks
from .hybrid import HybridSEASGD, new_node_groups, node_groups
from .job import Job, job
from .launch import WorkerEnv, open_store
from .layout import ALIGN, Bucket, FlatLayout, TensorSlot
from .seasgd import SEASGD
from .steps import StepTimes
from .store import ParameterStore, Traffic
from .sync import SYNC_SLOTS, SyncDataParallel

register()

__all__ = ["ALIGN", "Bucket", "DistributedDataParallel", "FlatLayout", "FlatModel", "GradientHooks",
           "HybridSEASGD", "Job", "ParameterStore", "SEASGD", "SMBProcessGroup", "SYNC_SLOTS", "SharedCounters",
           "StepTimes", "StopRule", "SyncDataParallel", "TensorSlot", "Traffic", "WorkerEnv", "job", "new_node_groups",
           "node_groups", "open_store", "register"]
