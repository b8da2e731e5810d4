"""Train a small network on scikit-learn's bundled digits through the memory box.

A thin wrapper of :mod:`smb_server.train.digits` (``smb train`` runs the same);
``--help`` lists the options. For example::

    .venv/bin/python examples/train_digits.py --workers 4 --scheme all
"""
from __future__ import annotations

import sys

from smb_server.train.digits import main

if __name__ == "__main__":
    sys.exit(main())
