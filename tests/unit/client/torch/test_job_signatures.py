"""The job's and the DDP wrapper's options are real parameters (help() and the API
reference show them, a typo is a TypeError), and they stay those of the classes they
are passed to."""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from smb_client.torch import SEASGD, Job, ParameterStore, SyncDataParallel, job  # noqa: E402

SET_BY_THE_JOB = {"workers", "lease", "replace", "attempt"}


def keywords(fn) -> dict[str, object]:
    params = inspect.signature(fn).parameters.values()
    assert not [p for p in params if p.kind is p.VAR_KEYWORD], f"{fn.__qualname__} takes **options"
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def test_job_and_its_trainers_take_named_options():
    assert keywords(job) == keywords(Job.__init__)
    store = {k: v for k, v in keywords(ParameterStore.create).items() if k not in SET_BY_THE_JOB}
    assert {k: v for k, v in keywords(Job.__init__).items() if k in store} == store
    assert keywords(Job.sync) == keywords(SyncDataParallel.__init__)
    seasgd = keywords(SEASGD.__init__)
    assert keywords(Job.seasgd) == {**seasgd, "keep_deltas": None}   # None: when the store has a slot


def test_the_ddp_wrapper_takes_ddps_arguments_in_ddps_order():
    from smb_client.torch import DistributedDataParallel
    theirs = [p.name for p in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters.values()
              if p.kind is p.POSITIONAL_OR_KEYWORD]
    ours = [p.name for p in inspect.signature(DistributedDataParallel.__init__).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert ours == theirs
    options = keywords(DistributedDataParallel.__init__)
    sync = keywords(SyncDataParallel.__init__)
    assert set(sync) <= set(options)
    # None: from DDP's bucket_cap_mb and broadcast_buffers unless given
    assert {k: v for k, v in options.items() if k in sync} == {**sync, "bucket_bytes": None, "buffers": None}
