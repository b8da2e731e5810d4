"""Train a small network on scikit-learn's bundled digits through the memory box.

A thin wrapper of :mod:`smb_train.digits` (``smb train`` runs the same);
``--help`` lists the options. For example::

    .venv/bin/python examples/train_digits.py --workers 4 --scheme all

The names below are re-exported for ``bench/training.py``.
"""
from __future__ import annotations

import sys

from smb_train.digits import TARGET_ACCURACY, build_parser, main, run_scheme, save_data, worker_argv

__all__ = ["TARGET_ACCURACY", "build_parser", "main", "run_scheme", "save_data", "worker_argv"]

if __name__ == "__main__":
    sys.exit(main())
