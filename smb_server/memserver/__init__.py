"""The memory server: a capacity budget of RAM, the extents carved from it, and the
data planes (tcp, shm) and gRPC service that expose them.

Modules: :mod:`.arena` (pure state: budget and extents), :mod:`.kernels` (in-place
vector operations), :mod:`.tcp_plane` and :mod:`.shm_plane` (data-plane listeners),
:mod:`.service` (gRPC servicer), :mod:`.main` (lifecycle, controller registration).
"""
