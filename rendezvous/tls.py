"""TLS for the rendezvous: one self-signed certificate per job, pinned by its clients.

Why it looks the way it does:

* Every rendezvous call carries the job secret as metadata. Between hosts that must not
  cross the network in clear text, so a multi-host job's server speaks TLS.
* There is no CA to ask: hvdrun makes a fresh key pair and a self-signed certificate for
  each job (:func:`make_job_certificate`). The private key never leaves hvdrun's memory.
  The certificate (public) travels to the workers the way the secret does, inside the
  agent's start message and then the workers' environment (``HVDRUN_RENDEZVOUS_CERT``),
  never in argv or a file.
* Clients trust that one certificate and nothing else (it is their only root), so a
  machine in the middle cannot present another one. Workers dial the server by whatever
  address faces them (an IP most of the time), so the certificate names a fixed
  :data:`TARGET_NAME` and clients check the server against that name instead of the
  address they dialled.
* Jobs started without hvdrun (srun, mpirun, torchrun, Kubernetes) have no launcher to hand
  a certificate round, but every rank holds the job secret: each derives the same
  certificate authority from it (:func:`authority_from_secret`), rank 0 serves with a
  certificate that authority signs for its own fresh key, and the others trust that
  authority alone. A rank with another secret derives another authority, and its handshake
  fails before any call, and so before its secret is sent.
* ``cryptography`` is imported only when a certificate is made: the CLI must start fast.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

import grpc

from rendezvous.addresses import is_loopback

__all__ = [
    "TARGET_NAME",
    "JobCertificate",
    "SecretAuthority",
    "authority_from_secret",
    "certificate_for",
    "channel_credentials",
    "make_job_certificate",
]

#: The name in every job certificate; clients check the server against it.
TARGET_NAME = "hvdrun-rendezvous"


@dataclass(frozen=True)
class JobCertificate:
    """One job's certificate (PEM, public) and its private key (PEM, stays in hvdrun)."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def make_job_certificate(job_id: str) -> JobCertificate:
    """A fresh EC P-256 key and a self-signed certificate for :data:`TARGET_NAME`, valid
    :data:`ALWAYS` (clients trust it by its key alone, whatever their clock says)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(TARGET_NAME, f"hvdrun job {job_id}")
    return _issue(key, name, key, name, ALWAYS, ca=True)


#: The validity of every certificate here: from 1970 to 9999. A job's certificates are
#: trusted by their key (or the secret's authority) alone, for that job; a validity from
#: "now" made a host whose clock runs an hour or more behind hvdrun's (a hardware clock
#: kept in local time, a board without one that boots at 1970) fail its TLS handshake,
#: "certificate is not yet valid".
ALWAYS = (
    datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc),
    datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc),
)


#: The name of the authority derived from a job's secret (the issuer of rank 0's certificate).
AUTHORITY_NAME = "hvdrun rendezvous authority"
#: HKDF's salt for that derivation: the secret serves no other key than this one.
_AUTHORITY_SALT = b"hvdrun: the rendezvous authority of a job secret, v1"
#: The order of P-256's group (a private key is an integer in [1, order - 1]).
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@dataclass(frozen=True)
class SecretAuthority:
    """The certificate authority every rank of a job derives alike from its secret.

    ``root_pem`` (public) is what clients trust, and nothing else; rank 0 serves with
    :meth:`server_certificate`. Only holders of the secret can derive the authority's key, so
    only they can serve a certificate that the others accept."""

    root_pem: bytes
    key: Any = field(repr=False)  # its EllipticCurvePrivateKey

    def server_certificate(self) -> JobCertificate:
        """A certificate for :data:`TARGET_NAME` on a fresh key, signed by this authority
        (valid :data:`ALWAYS`, as the authority is)."""
        from cryptography.hazmat.primitives.asymmetric import ec

        leaf = ec.generate_private_key(ec.SECP256R1())
        return _issue(leaf, _name(TARGET_NAME), self.key, _name(AUTHORITY_NAME), ALWAYS, ca=False)


@functools.lru_cache(maxsize=4)
def authority_from_secret(secret: str) -> SecretAuthority:
    """The authority of ``secret``: its key derived by HKDF-SHA256, its certificate valid
    :data:`ALWAYS` (whatever a rank's clock says). Each rank makes its own copy of that
    certificate; the copies differ only in their signature, which nobody checks (a root
    is trusted as it is), so rank 0 need not send it. Made once per secret in a process
    (rank 0 serves with it and dials its own server trusting it)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    # 48 bytes reduced modulo the order: as good as uniform (bias below 2**-128).
    raw = HKDF(hashes.SHA256(), 48, _AUTHORITY_SALT, b"P-256 key").derive(secret.encode())
    key = ec.derive_private_key(int.from_bytes(raw, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = _name(AUTHORITY_NAME)
    root = _issue(key, name, key, name, ALWAYS, ca=True, target=False)
    return SecretAuthority(root.cert_pem, key)


def _name(common_name: str, unit: str = "") -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if unit:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    return x509.Name(attributes)


def _issue(
    key: Any,
    subject: Any,
    signer: Any,
    issuer: Any,
    valid: tuple[datetime.datetime, datetime.datetime],
    *,
    ca: bool,
    target: bool = True,
) -> JobCertificate:
    """A certificate of ``key`` for ``subject`` signed by ``signer`` as ``issuer``
    (``target``: it names :data:`TARGET_NAME`, as a server's must)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    public = key.public_key()
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        # Derived from the key: every rank's copy of the authority's certificate agrees.
        .serial_number(int.from_bytes(hashlib.sha256(der).digest()[:16], "big") >> 1)
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if target:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(TARGET_NAME)]), critical=False
        )
    cert = builder.sign(signer, hashes.SHA256())
    return JobCertificate(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def channel_credentials(cert_pem: bytes | str) -> grpc.ChannelCredentials:
    """Client credentials that trust exactly the job's certificate."""
    if isinstance(cert_pem, str):
        cert_pem = cert_pem.encode("ascii")
    return grpc.ssl_channel_credentials(root_certificates=cert_pem)


def certificate_for(bind_host: str, job_id: str) -> JobCertificate | None:
    """The job's certificate when a server bound to ``bind_host`` can be reached from other
    machines; None for a loopback-only server (its traffic never leaves this machine)."""
    if is_loopback(bind_host):
        return None
    return make_job_certificate(job_id)
