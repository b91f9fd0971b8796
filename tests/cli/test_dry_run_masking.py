"""``--dry-run`` masks secrets that the variable's name alone does not give away: other
common names, key material in a value, and the secret parts of URLs."""

from __future__ import annotations

import pytest

from hvdrun.cli import run_cli
from hvdrun.dry_run import MASK, masked


@pytest.mark.parametrize(
    "name",
    [
        *("SMTP_PASS", "GPG_PASSPHRASE", "SENTRY_DSN", "AWS_CREDS", "SSH_PRIVKEY"),
        *("SESSION_COOKIE", "HF_AUTHORIZATION", "CI_JOB_JWT", "SSHPASS", "HONEYCOMB_WRITEKEY"),
        *("APP_KEYS", "ENCRYPTION_SALT", "OTEL_EXPORTER_OTLP_HEADERS", "PASS"),
    ],
)
def test_more_secret_names(name: str) -> None:
    assert masked(name, "hidden-value") == MASK


def test_credentials_in_a_value_whatever_the_name() -> None:
    assert masked("EXTRA", "authorization=Bearer otelsecret1") == MASK
    assert masked("CURL_ARGS", "-H 'Authorization: Basic dXNlcjpwdw=='") == MASK


def test_key_material_whatever_the_name() -> None:
    assert masked("BLOB", "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE") == MASK
    assert masked("SSH_STUFF", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl") == MASK


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("https://ghp_0123456789@github.com/o/r.git", f"https://{MASK}@github.com/o/r.git"),
        (
            "https://acct.blob.core.windows.net/c?sv=2022&sig=abc%2Bdef&se=1",
            f"https://acct.blob.core.windows.net/c?sv=2022&sig={MASK}&se=1",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA1&X-Amz-Signature=f00d&X-Amz-Date=1",
            f"https://b.s3.amazonaws.com/k?X-Amz-Credential={MASK}&X-Amz-Signature={MASK}"
            "&X-Amz-Date=1",
        ),
        ("https://h/cb?access_token=t0k&page=2", f"https://h/cb?access_token={MASK}&page=2"),
        (
            "https://hooks.slack.com/services/T0/B0/slacksecret1",
            f"https://hooks.slack.com/services/{MASK}",
        ),
        (
            "https://discord.com/api/webhooks/1/hooksecret1",
            f"https://discord.com/api/webhooks/{MASK}",
        ),
    ],
)
def test_secret_parts_of_urls(value: str, shown: str) -> None:
    assert masked("SOME_URL", value) == shown


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NUM_PASSES", "4"),
        ("PWD", "/home/me/project"),  # (the working directory, not a password)
        ("BYPASS", "1"),
        ("MONKEY", "banana"),
        ("GIT_REMOTE", "ssh://git@github.com/o/r"),
        ("INDEX", "https://pypi.org/simple?page=2"),
        ("DATA", "postgres://trainer@db/runs"),
    ],
)
def test_what_is_not_secret_is_shown(name: str, value: str) -> None:
    assert masked(name, value) == value


def test_the_plan_masks_them(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dry-run", "-np", "1", "-x", "SMTP_PASS=hidden-1"]
    argv += ["-x", "REPO=https://hidden-2@github.com/o/r", "true"]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "hidden-" not in out
    assert f"  SMTP_PASS={MASK}" in out.splitlines()
