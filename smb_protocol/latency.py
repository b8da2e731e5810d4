"""What a client's and a memory server's latency histograms share, so one dashboard
shows both sides: the buckets (seconds) and the operation names (the data-plane
operation's name in lower case, ``read``, ``write``, ``accumulate``, ...)."""
from __future__ import annotations

# seconds; from a small-message round trip to a multi-megabyte accumulate
OP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
              0.5, 1.0, 2.5, 10.0)

SERVER_HISTOGRAM = "smb_server_operation_seconds"
CLIENT_HISTOGRAM = "smb_client_operation_seconds"
