"""Key derivation, sealed key material, per-message AEAD, and CURVE keys from the secret.

Three tools, each small and each built on a vetted primitive (docs/security.md argues the
design):

* :func:`derive`: HMAC-SHA256 of a label list under a key (the PRF step of HKDF-Expand):
  every key pskv uses beyond the scheduler's random ones is derived, never sent.
* :func:`seal` / :func:`unseal`: the scheduler's key material in ADMIT and NODE_REJOINED,
  encrypted and authenticated under a key derived from the cluster secret, the job and the
  nonce of the node's own admission (HMAC-SHA256 in counter mode as the key stream, then
  HMAC-SHA256 over counter and ciphertext: encrypt-then-MAC, one key per admission). The
  ADMIT is small; this needs nothing beyond ``hmac``.
* :class:`Aead`: AES-256-GCM from the OpenSSL library Python's ``ssl`` module already
  loaded (through ``ctypes``), for ``PSKV_ENCRYPT=1`` on stream links (:mod:`.sealed`).
* :func:`curve_keys`: a ZeroMQ CURVE key pair derived from the secret (libzmq's
  CurveZMQ: per-message authenticated encryption) for ZeroMQ links under ``PSKV_ENCRYPT``.

Invariants: no nonce is used twice under one key (counters per direction, fresh keys per
connection); a tag that does not verify raises ProtocolError and yields no plaintext.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import hmac
import json
import struct
import threading
from typing import Any

from ..errors import ConfigError, ProtocolError

__all__ = ["Aead", "TAG", "curve_keys", "derive", "seal", "unseal"]

#: bytes of an AES-GCM tag (and of a seal's tag)
TAG = 16


def derive(key: bytes, *labels: object) -> bytes:
    """32 bytes: HMAC-SHA256 under ``key`` of ``pskv|label|label...`` (one purpose each)."""
    msg = "|".join(["pskv", *(str(x) for x in labels)])
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _stream(key: bytes, counter: int, n: int) -> bytes:
    blocks = [hmac.new(key, struct.pack("<QQ", counter, i), hashlib.sha256).digest()
              for i in range((n + 31) // 32)]
    return b"".join(blocks)[:n]


def seal(key: bytes, counter: int, value: Any) -> dict[str, Any]:
    """``value`` (JSON) encrypted and authenticated under ``key``, message number
    ``counter`` (each used once per key): ``{"n": counter, "c": hex}``."""
    plain = json.dumps(value, separators=(",", ":")).encode()
    enc, mac = derive(key, "seal-enc"), derive(key, "seal-mac")
    ct = bytes(a ^ b for a, b in zip(plain, _stream(enc, counter, len(plain))))
    tag = hmac.new(mac, struct.pack("<Q", counter) + ct, hashlib.sha256).digest()[:TAG]
    return {"n": counter, "c": (ct + tag).hex()}


def unseal(key: bytes, sealed: Any, after: int = -1) -> tuple[int, Any]:
    """(counter, value) of a :func:`seal`; its counter must exceed ``after`` (no replay).

    Raises ProtocolError for anything that does not verify.
    """
    if not isinstance(sealed, dict) or type(sealed.get("n")) is not int or \
            not isinstance(sealed.get("c"), str) or not 0 <= sealed["n"] < 1 << 63:
        raise ProtocolError("sealed key material that is not {n: int, c: hex}")
    counter = sealed["n"]
    try:
        raw = bytes.fromhex(sealed["c"])
    except ValueError:
        raise ProtocolError("sealed key material that is not hex") from None
    if len(raw) < TAG or counter <= after:
        raise ProtocolError("sealed key material that is too short or replayed")
    ct, tag = raw[:-TAG], raw[-TAG:]
    enc, mac = derive(key, "seal-enc"), derive(key, "seal-mac")
    want = hmac.new(mac, struct.pack("<Q", counter) + ct, hashlib.sha256).digest()[:TAG]
    if not hmac.compare_digest(want, tag):
        raise ProtocolError("sealed key material that does not verify (another secret, or "
                            "changed on the way)")
    plain = bytes(a ^ b for a, b in zip(ct, _stream(enc, counter, len(ct))))
    try:
        return counter, json.loads(plain)
    except ValueError:  # pragma: no cover - it verified, so it is ours
        raise ProtocolError("sealed key material that is not JSON") from None


def curve_keys(secret: bytes, *labels: object) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys derived from ``secret`` for ``labels``.

    Raises ConfigError when this libzmq has no CURVE (built without libsodium).
    """
    import zmq
    from zmq.utils import z85
    if not zmq.has("curve"):
        raise ConfigError("PSKV_ENCRYPT=1 needs ZeroMQ with CURVE, and this libzmq has none. "
                          "Install pyzmq from its wheels (they bundle libsodium), or unset "
                          "PSKV_ENCRYPT.")
    private = z85.encode(derive(secret, "curve", *labels))
    return zmq.curve_public(private), private


# ---- AES-256-GCM through the OpenSSL that ``ssl`` loaded --------------------------------
_CTRL_GCM_GET_TAG = 0x10
_CTRL_GCM_SET_TAG = 0x11
_CHUNK = 1 << 30                 # EVP_*Update take an int length
_lib: Any = None
_lib_lock = threading.Lock()


def _libcrypto() -> Any:
    """OpenSSL's libcrypto, the one Python's ``ssl`` runs on (loaded once)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        import ssl  # noqa: F401 - loads libcrypto into this process
        path = None
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
                path = next((line.split()[-1] for line in maps
                             if "libcrypto" in line and line.split()[-1].startswith("/")), None)
        except OSError:
            pass
        path = path or ctypes.util.find_library("crypto")
        try:
            if not path:
                raise OSError("no libcrypto")
            lib: Any = ctypes.CDLL(path)
            lib.EVP_aes_256_gcm  # noqa: B018 - present in OpenSSL 1.1 and 3
        except (OSError, AttributeError, TypeError):
            raise ConfigError("PSKV_ENCRYPT=1 needs OpenSSL's libcrypto (the one Python's "
                              "ssl module uses), and it cannot be loaded here. Unset "
                              "PSKV_ENCRYPT, or use TLS (PSKV_TLS_*).") from None
        vp, cp, ip = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
        lib.EVP_CIPHER_CTX_new.restype = vp
        lib.EVP_CIPHER_CTX_new.argtypes = []
        lib.EVP_CIPHER_CTX_free.argtypes = [vp]
        lib.EVP_aes_256_gcm.restype = vp
        for name in ("EVP_EncryptInit_ex", "EVP_DecryptInit_ex"):
            getattr(lib, name).argtypes = [vp, vp, vp, cp, cp]
        for name in ("EVP_EncryptUpdate", "EVP_DecryptUpdate"):
            getattr(lib, name).argtypes = [vp, vp, ip, vp, ctypes.c_int]
        for name in ("EVP_EncryptFinal_ex", "EVP_DecryptFinal_ex"):
            getattr(lib, name).argtypes = [vp, vp, ip]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
        _lib = lib
        return lib


def _address(buf: Any) -> int:
    """The address of a writable buffer (a bytearray or a numpy array's bytes)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if len(buf) else 0


class Aead:
    """AES-256-GCM under one key, one direction of one link; message ``i`` uses nonce ``i``.

    ``seal`` encrypts a buffer in place and returns the tag; ``open`` decrypts in place and
    raises ProtocolError if the tag does not verify (then the buffer holds garbage, and the
    link must be dropped). The receiver keeps its own counter, so a message replayed,
    dropped or reordered on the way fails like a changed one. Not thread-safe: one sender,
    one receiver per direction.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("an AES-256 key is 32 bytes")
        self._lib = _libcrypto()
        self._key = key
        self.counter = 0
        self._ctx = self._lib.EVP_CIPHER_CTX_new()
        if not self._ctx:  # pragma: no cover - out of memory
            raise MemoryError("EVP_CIPHER_CTX_new")
        self._mode = ""          # "e" or "d" once the key schedule is set up for it
        self._tag = ctypes.create_string_buffer(TAG)
        self._rest = ctypes.create_string_buffer(32)

    def _init(self, mode: str) -> None:
        """Set the next nonce (and, the first time in this direction, the key)."""
        lib = self._lib
        init = lib.EVP_EncryptInit_ex if mode == "e" else lib.EVP_DecryptInit_ex
        if self._mode != mode:
            if init(self._ctx, lib.EVP_aes_256_gcm(), None, self._key, None) != 1:
                raise ProtocolError("AES-GCM setup failed")  # pragma: no cover
            self._mode = mode
        if init(self._ctx, None, None, None, self._nonce()) != 1:
            raise ProtocolError("AES-GCM setup failed")  # pragma: no cover

    def __del__(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.EVP_CIPHER_CTX_free(ctx)

    def _nonce(self) -> bytes:
        nonce = struct.pack("<IQ", 0, self.counter)
        self.counter += 1
        return nonce

    def _run(self, update: Any, buf: Any) -> None:
        n = ctypes.c_int(0)
        addr, left, done = _address(buf), len(buf), 0
        while done < left:
            step = min(_CHUNK, left - done)
            if update(self._ctx, addr + done, ctypes.byref(n), addr + done, step) != 1:
                raise ProtocolError("AES-GCM failed")  # pragma: no cover
            done += step

    def seal(self, buf: bytearray | memoryview, aad: bytes = b"") -> bytes:
        """Encrypt ``buf`` in place; return the 16-byte tag."""
        lib, n = self._lib, ctypes.c_int(0)
        self._init("e")
        if aad:
            lib.EVP_EncryptUpdate(self._ctx, None, ctypes.byref(n), aad, len(aad))
        self._run(lib.EVP_EncryptUpdate, buf)
        lib.EVP_EncryptFinal_ex(self._ctx, self._rest, ctypes.byref(n))
        lib.EVP_CIPHER_CTX_ctrl(self._ctx, _CTRL_GCM_GET_TAG, TAG, self._tag)
        return self._tag.raw

    def open(self, buf: bytearray | memoryview, tag: bytes, aad: bytes = b"") -> None:
        """Decrypt ``buf`` in place; raise ProtocolError unless ``tag`` verifies."""
        lib, n = self._lib, ctypes.c_int(0)
        self._init("d")
        if aad:
            lib.EVP_DecryptUpdate(self._ctx, None, ctypes.byref(n), aad, len(aad))
        self._run(lib.EVP_DecryptUpdate, buf)
        if len(tag) != TAG:
            raise ProtocolError("a message whose tag is not 16 bytes")
        ctypes.memmove(self._tag, bytes(tag), TAG)
        lib.EVP_CIPHER_CTX_ctrl(self._ctx, _CTRL_GCM_SET_TAG, TAG, self._tag)
        if lib.EVP_DecryptFinal_ex(self._ctx, self._rest, ctypes.byref(n)) != 1:
            raise ProtocolError("a message that does not verify (changed, replayed or "
                                "reordered on the way, or another key)")
