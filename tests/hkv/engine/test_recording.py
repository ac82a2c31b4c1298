"""hkv.engine.recording.AdmissionMemory: which prefix clock admission control takes as a request's own
previous use."""

from __future__ import annotations

from hkv.engine.recording import AdmissionMemory
from hkv.engine.requests import LiveRequest

KEY = b"\x01" * 16


def request(prev_use: int | None) -> LiveRequest:
    return LiveRequest(index=0, prompt=[1, 2, 3], max_new=1, keys=[KEY], prev_use=prev_use)


def test_a_refusal_stands_in_only_for_a_request_that_restored_nothing():
    """A conversation refused a record slot at clock 9 comes back. Restoring nothing, its refusal is its
    previous use (else it could never displace anything and would stay uncached). Restoring a record
    last used at clock 5, its previous use stays 5: taking the later refusal instead let every user
    refused under pressure evict the others' idle tails (prefix_reuse.py: 130 -> 913 records evicted,
    93.6% -> 88.0% restored)."""
    memory = AdmissionMemory(prefix_records=8)
    assert memory.previous_use(request(None)) is None
    memory.refuse(request(None), 9)
    assert memory.previous_use(request(None)) == 9
    assert memory.previous_use(request(5)) == 5
    assert memory.previous_use(request(12)) == 12
    memory.forget()
    assert memory.previous_use(request(None)) is None
