"""The averaging round's state (node/averaging/round.py): one owner of its outputs, and no way back."""

from __future__ import annotations

import numpy as np
import pytest

from node.averaging.round import Round, RoundState
from node.bridge.exchange import ExchangeRequest
from protocols.avg import Tensors


def _round() -> Round:
    z = np.zeros(8, np.float32)
    request = ExchangeRequest(outer_step=3, phi=z, delta=z, phi_out=z.copy(), delta_out=z.copy(),
                              layout=[("w", (8,))], layout_hash="lh", inner_steps=50, samples=400)
    return Round(request, Tensors(z, z, z.copy(), z.copy()), began=10.0)


def test_a_claimed_round_belongs_to_its_partner_and_no_second_claim_or_close_takes_it() -> None:
    r = _round()
    assert r.open and r.state is RoundState.PAIRING and r.partner is None
    r.claim("QmPartner", now=12.5)
    assert not r.open and r.state is RoundState.EXCHANGING and r.partner == "QmPartner"
    assert r.waited_s == pytest.approx(2.5)  # from the publish to the pairing
    with pytest.raises(AssertionError):
        r.claim("QmCrossing", now=13.0)  # a crossing request cannot take the outputs over
    with pytest.raises(AssertionError):
        r.close()
    assert r.partner == "QmPartner" and not r.done.is_set()


def test_a_closed_round_is_a_solo_step_its_status_says_so_and_a_late_request_cannot_claim_it() -> None:
    r = _round()
    r.close()
    assert r.state is RoundState.SOLO and r.state.value == "solo" and r.result == 1 and r.done.is_set()
    with pytest.raises(AssertionError):
        r.claim("QmLate", now=20.0)
    assert r.partner is None

