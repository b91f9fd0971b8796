"""The SSH test cluster (network namespaces with sshd) for tests/launcher/test_ssh*.py."""

from tests.cluster import cluster

__all__ = ["cluster"]
