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
* ``cryptography`` is imported only when a certificate is made: the CLI must start fast.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import grpc

from rendezvous.addresses import is_loopback

__all__ = [
    "TARGET_NAME",
    "JobCertificate",
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


def make_job_certificate(job_id: str, days: int = 365) -> JobCertificate:
    """A fresh EC P-256 key and a self-signed certificate for :data:`TARGET_NAME`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, TARGET_NAME),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"hvdrun job {job_id}"),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # A little slack for clocks of other hosts that run behind.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TARGET_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
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
