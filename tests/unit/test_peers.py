"""Pre-authentication slots alone (``kvstore.server.peers``): per peer and in all."""

import pytest

from kvstore.server.peers import PreAuth


def test_a_peer_is_refused_beyond_its_slots_and_others_are_not():
    slots = PreAuth(per_peer=2, total=3)
    assert slots.enter("10.0.0.1") is None and slots.enter("10.0.0.1") is None
    assert slots.enter("10.0.0.1") == "per_peer"  # its own limit...
    assert slots.enter("10.0.0.2") is None  # ...not another's
    assert slots.enter("10.0.0.3") == "total"  # all slots held
    slots.leave("10.0.0.1")
    assert slots.enter("10.0.0.3") is None and slots.held() == 3 and slots.held("10.0.0.1") == 1
    assert dict(slots.refusals) == {"per_peer": 1, "total": 1}


def test_leaving_a_slot_not_held_is_a_bug_and_limits_must_be_positive():
    with pytest.raises(RuntimeError):
        PreAuth(1, 1).leave(("uid", 1))
    with pytest.raises(ValueError):
        PreAuth(0, 1)
