"""What the ``smb`` process group does: the reductions, dtypes and devices it takes
(checked at the call, before anything is queued), and the errors for what it does not."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import ReduceOp

from smb_protocol.errors import DtypeError

log = logging.getLogger(__name__)

__all__ = ["AVERAGEABLE", "REDUCIBLE", "UnsupportedOperation", "check_device", "check_reduce", "refused"]

REDUCIBLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)
AVERAGEABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class UnsupportedOperation(DtypeError):
    """A reduction, dtype or device the ``smb`` backend does not do."""


def reduce_name(op: Any) -> str:
    """The name of torch's ``ReduceOp`` ``op`` (``"SUM"``, ``"AVG"``, ...)."""
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(ReduceOp, name):
            return name
    return str(op)


def check_reduce(op: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``op`` averages; raises UnsupportedOperation for what cannot be done."""
    name = reduce_name(op)
    if name not in ("SUM", "AVG"):
        raise UnsupportedOperation(f"the smb backend reduces with SUM and AVG only, not {name}")
    for t in tensors:
        check_device(t)
        allowed = AVERAGEABLE if name == "AVG" else REDUCIBLE
        if t.dtype not in allowed:
            raise UnsupportedOperation(
                f"the smb backend cannot {name} {t.dtype}: it reduces "
                f"{', '.join(str(d).removeprefix('torch.') for d in allowed)}")
    return name == "AVG"


def check_device(t: torch.Tensor) -> None:
    """Raises UnsupportedOperation for a tensor on neither the CPU nor a CUDA device."""
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedOperation(f"the smb backend takes CPU and CUDA tensors, not {t.device}")


def refused(cause: BaseException) -> BaseException:
    """The error for an operation after ``cause`` broke the group (same type when it can)."""
    msg = f"the smb process group failed earlier ({cause!r}); make a new one"
    try:
        return type(cause)(msg)
    except Exception:
        return RuntimeError(msg)
