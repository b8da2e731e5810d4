"""A publisher in a process of its own, for the tests that race it or kill it:
``python -m tests.integration.weights._publisher ADDRESS TOKEN NAME MODE``.

``race``: publish versions 0, 1, 2 ... as fast as it can until killed (prints each
hundredth). ``stall``: publish versions 0 and 1, begin version 2, write part of it
(garbage), print ``mid`` and wait for stdin to close (the test kills it first).
"""
from __future__ import annotations

import sys

import numpy as np

from smb_client import Client
from smb_client.weights import Publisher
from tests.integration.weights.checks import weights


def main() -> None:
    address, token, name, mode = sys.argv[1:5]
    with Client(address, token, transport="tcp") as client:
        pub = Publisher.open(client, name)
        if mode == "race":
            version = 0 if pub.latest is None else pub.latest + 1
            while True:
                pub.publish(weights(version), version)
                if version % 100 == 0:
                    print(version, flush=True)
                version += 1
        pub.publish(weights(0), 0)
        pub.publish(weights(1), 1)
        pub.begin(2)
        pub.write({"a": np.full((96, 1030), -1.0, np.float32)})
        print("mid", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
