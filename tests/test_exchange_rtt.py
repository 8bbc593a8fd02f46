"""The round trips of one averaging exchange, counted over a link whose round trip is known (network lab).

Counted, not timed: at a round trip of 400 ms, an exchange of a few kilobytes that ends 1.2 s after it began
took 3 round trips, and the machine's own work (milliseconds) cannot move that count. Issue #50's figure:
the first exchange with a partner takes the stream's protocol (1 round trip, p2p/multiselect.py), the request
and its answer (1), the side channel's connect after the answer (1) and the path message with our HELLO,
whose answer is the partner's first byte (1): 4. Later ones write the request with the stream's proposal
(the partner confirmed the protocol before: `open_optimistic`, 0) and dialled the side channel with the
request, to the port of the last answer: 2. The code before took 6 (two for the stream's protocol, and the
path message after the ACK), then 4 and 3 (the stream's protocol one round trip of its own).
"""

from __future__ import annotations

import json
import sys

import pytest

from starling_testing import exchange_lab
from starling_testing.netlab import Lab

pytestmark = pytest.mark.lab

RTT_S = 0.4


def test_an_exchange_takes_two_round_trips_and_the_first_with_a_partner_four(lab: Lab) -> None:
    a, b = lab.public_host("a"), lab.public_host("b")
    for host in (a, b):
        lab.limit(host, None, delay_ms=RTT_S * 1000 / 4)  # 4 lines between a and b: one RTT_S round trip
    responder = b.spawn([sys.executable, "-m", "starling_testing.exchange_lab", "respond", "4100"])
    peer = responder.wait_for(exchange_lab.READY + r" (\S+)", timeout=60)[1]
    initiator = a.spawn([sys.executable, "-m", "starling_testing.exchange_lab", "initiate", str(b.ip), "4100", peer,
                         "1000", "3"])  # fmt: skip
    initiator.wait(120)
    results = [json.loads(line[len(exchange_lab.RESULT):]) for line in initiator.output().splitlines()
               if line.startswith(exchange_lab.RESULT)]  # fmt: skip
    assert [r.get("error") for r in results] == [None] * 3, initiator.tail()
    assert [r["path"] for r in results] == ["datapath"] * 3
    round_trips = [round(r["seconds"] / RTT_S) for r in results]
    assert round_trips == [4, 2, 2], results
    # The stream's protocol: one round trip the first time, none once the partner confirmed it.
    assert [round(r["stream_s"] / RTT_S) for r in results] == [1, 0, 0]
    assert [round((r["answer_s"] - r["stream_s"]) / RTT_S) for r in results] == [1, 1, 1]  # request and answer
