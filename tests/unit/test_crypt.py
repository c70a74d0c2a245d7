"""The primitives of ``PSKV_ENCRYPT`` and of sealed key material (``_ps/crypt.py``)."""
from __future__ import annotations

import pytest

from pskv._ps.crypt import TAG, Aead, derive, seal, unseal
from pskv.errors import ProtocolError


def test_aes_gcm_matches_the_nist_vectors() -> None:
    # GCM spec (McGrew & Viega) test cases 13 and 14: AES-256, key and IV all zero
    empty = bytearray()
    assert Aead(bytes(32)).seal(empty).hex() == "530f8afbc74536b9a963b4f1c4cb738b"
    block = bytearray(16)
    tag = Aead(bytes(32)).seal(block)
    assert block.hex() == "cea7403d4d606b6e074ec5d3baf39d18"
    assert tag.hex() == "d0d1c8a799996bf0265b98b5d48ab919"


def test_a_changed_replayed_or_reordered_message_does_not_open() -> None:
    key = derive(b"secret", "link", "salt")
    tx, rx = Aead(key), Aead(key)
    msgs = [bytearray(f"message {i}".encode() * 50) for i in range(3)]
    tags = [tx.seal(m) for m in msgs]                  # in place
    sealed = list(zip(msgs, tags))
    first = bytearray(sealed[0][0])
    rx.open(first, sealed[0][1])
    assert first == bytearray(b"message 0" * 50)
    for buf, tag in (sealed[0], sealed[2]):     # message 1 expected: replayed, reordered
        late = Aead(key)
        late.counter = 1
        with pytest.raises(ProtocolError, match="does not verify"):
            late.open(bytearray(buf), tag)
    changed = bytearray(sealed[1][0])
    changed[7] ^= 1
    with pytest.raises(ProtocolError, match="does not verify"):
        rx.open(changed, sealed[1][1])
    right = Aead(key)
    right.counter = 1
    right.open(bytearray(sealed[1][0]), sealed[1][1])         # the control: it opens
    assert len(sealed[1][1]) == TAG


def test_sealed_key_material_opens_once_under_its_key_only() -> None:
    key = derive(b"secret", "seal", "job", "nonce")
    box = seal(key, 1, {"keys": ["ab" * 32]})
    assert "ab" * 32 not in box["c"]
    assert unseal(key, box) == (1, {"keys": ["ab" * 32]})
    with pytest.raises(ProtocolError, match="replayed"):
        unseal(key, box, after=1)
    with pytest.raises(ProtocolError, match="does not verify"):
        unseal(derive(b"other", "seal", "job", "nonce"), box)
    flipped = {**box, "c": ("0" if box["c"][0] != "0" else "1") + box["c"][1:]}
    with pytest.raises(ProtocolError, match="does not verify"):
        unseal(key, flipped)
    for bad in (None, {"n": "1", "c": ""}, {"n": 1, "c": "zz"}, {"n": -1, "c": "00"}):
        with pytest.raises(ProtocolError):
            unseal(key, bad)
