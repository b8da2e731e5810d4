"""A request on its way to an extent's old place while another operation on the same
handle learns of the move: the old server no longer holds the extent (ExtentNotFound),
and the controller already lists the new place the handle now has too. The handle runs
the operation again at the new place; it does not take "the controller says what I
already knew" for "nothing moved, the server failed". Real controller, memory servers
and client; the other operation's refresh is made to happen while the request is on
its way (between the choice of the place and the send), the move is a real evacuation."""
from __future__ import annotations

import time

import numpy as np
import pytest

from smb_protocol import errors
from smb_server.commands.local_cluster import LocalCluster
from tests.integration.elastic.test_evacuate import SETTLE, wait_empty

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path):
    with LocalCluster(servers=2, capacity="64M", workdir=str(tmp_path / "cluster")) as c:
        yield c


def test_a_request_to_the_old_place_runs_again_at_the_new_one(pool):
    with pool.client(transport="tcp") as c, pool.admin_client() as admin:
        region = c.create_region("job/buffers", MiB, placement="single")
        region.write(0, np.arange(MiB // 8, dtype=np.int64))
        route = region.route
        old = route.extents[0]
        old_session, old_ticket = route.dataplane.session(old), route.ticket
        admin.drain_server(old.server_id, evacuate=True)
        wait_empty(admin, old.server_id)
        deadline = time.monotonic() + SETTLE          # until the old server released it
        while True:
            try:
                old_session.read_into(old_ticket, old.extent_id, 0, [memoryview(bytearray(8))])
            except errors.ExtentNotFound:
                break
            assert time.monotonic() < deadline, "the old server still holds the extent"
            time.sleep(0.05)
        assert route.extents[0] == old                # this handle has not looked yet
        seq = route.next_seq()
        data = memoryview(np.full(16, 7, np.int64)).cast("B")
        sends: list[int] = []

        def send(session, place):
            ticket = route.ticket                     # as planned: the old place, its ticket
            if not sends:
                region.refresh()                      # another operation learns the move now
            sends.append(place.extent_id)
            return session.write(ticket, place.extent_id, 0, [data], seq=seq)
        route.run(lambda: route.request(0, True, send))
        new = route.extents[0]
        assert sends == [old.extent_id, new.extent_id] and new.server_id != old.server_id
        got = region.read(0, 256, dtype=np.int64)
        np.testing.assert_array_equal(got[:16], np.full(16, 7, np.int64))
        np.testing.assert_array_equal(got[16:], np.arange(16, 32, dtype=np.int64))
