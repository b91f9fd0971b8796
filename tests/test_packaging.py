"""hvdrun installed by pip into a user's environment: what its metadata promises, and what a
missing framework says (simulated with ``sys.modules[name] = None``: nothing is installed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdrun import check_build

REPO = Path(__file__).resolve().parents[1]


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    """The ``>=`` version of ``name`` in a list of requirement strings."""
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(name)}\s*>=\s*([0-9.]+)", requirement.strip())
        if match:
            return tuple(int(part) for part in match.group(1).split("."))
    raise AssertionError(f"no {name}>=... in {requirements}")


def test_declared_floors_admit_the_generated_code() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pb2 = (REPO / "rendezvous" / "rendezvous_pb2.py").read_text()
    grpc = (REPO / "rendezvous" / "rendezvous_pb2_grpc.py").read_text()
    gencode = re.search(r"Protobuf Python Version: ([0-9.]+)", pb2)
    grpc_gencode = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc)
    assert gencode and grpc_gencode
    protobuf = tuple(int(part) for part in gencode.group(1).split("."))
    # The generated code refuses a runtime older than the versions that generated it.
    assert _floor(project["dependencies"], "protobuf") >= protobuf
    assert _floor(project["dependencies"], "grpcio") >= tuple(
        int(part) for part in grpc_gencode.group(1).split(".")
    )
    # TensorFlow 2.16 to 2.19 require protobuf < 5 or < 6: the extra cannot name a release
    # that pip cannot install beside hvdrun's protobuf (2.20 on have no cap below 7).
    assert protobuf >= (7,)
    assert _floor(project["optional-dependencies"]["tensorflow"], "tensorflow") >= (2, 20)


def test_license_is_an_spdx_expression() -> None:
    # setuptools deprecates the table form (license = { text = ... }) and refuses it from
    # 2027-02-18: pip install . would fail with the newest setuptools.
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert isinstance(pyproject["project"]["license"], str)
    assert _floor(pyproject["build-system"]["requires"], "setuptools") >= (77,)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("frontend", ["collectives.torch", "collectives.tensorflow"])
def test_frontends_without_torch_say_what_to_install(frontend: str) -> None:
    done = _run(f"import sys; sys.modules['torch'] = None; import {frontend}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    expected = (
        f"ModuleNotFoundError: {frontend} needs PyTorch, which this Python ({sys.executable})"
    )
    assert last.startswith(expected), last
    assert "pip install torch" in last


FRAMEWORKS_MISSING = """
import importlib, json, os, sys
import collectives.torch  # torch itself, before any framework is hidden
found = {}
def attempt(case, module, hidden, legacy=False):
    saved = {name: sys.modules.pop(name, None) for name in hidden}
    for name in hidden:
        sys.modules[name] = None
    os.environ.pop("KERAS_BACKEND", None)
    if legacy:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    else:
        os.environ.pop("TF_USE_LEGACY_KERAS", None)
    try:
        importlib.import_module(module)
        found[case] = None
    except ModuleNotFoundError as error:
        found[case] = [error.name, str(error)]
    for name in hidden:
        del sys.modules[name]
attempt("tensorflow", "collectives.tensorflow", ["tensorflow"])
attempt("keras", "collectives.keras", ["keras", "tf_keras"])
attempt("tf_keras", "collectives.keras", ["tf_keras"], legacy=True)
print(json.dumps(found))
"""


def test_frontends_without_their_framework_name_the_extra() -> None:
    done = _run(FRAMEWORKS_MISSING)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    name, message = found["tensorflow"]
    assert name == "tensorflow"
    assert message.startswith("collectives.tensorflow needs TensorFlow"), message
    assert "pip install 'hvdrun[tensorflow]'" in message
    name, message = found["keras"]
    assert name == "keras"
    assert message.startswith("collectives.keras needs Keras"), message
    assert "pip install 'hvdrun[keras]'" in message
    name, message = found["tf_keras"]
    assert name == "tf_keras"
    assert "pip install tf_keras" in message


def test_check_build_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    lines = list(check_build.build_report())
    torch_line = next(line for line in lines if "PyTorch" in line)
    assert torch_line.strip().startswith("[ ] PyTorch (not installed for "), torch_line
    assert "pip install torch" in torch_line


def test_a_users_module_named_as_a_package_of_hvdrun_is_named_as_the_cause(
    tmp_path: Path,
) -> None:
    # A rendezvous.py beside the training script comes first on sys.path: every worker's
    # import collectives.torch failed with "cannot import name 'worker_env' from 'rendezvous'".
    (tmp_path / "rendezvous.py").write_text("meeting_point = 'the cafe'\n")
    script = tmp_path / "train.py"
    script.write_text("import collectives\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: collectives needs hvdrun's package 'rendezvous'"), last
    assert f"finds {tmp_path / 'rendezvous.py'} first" in last
    assert "rename it" in last
    # hvdrun's own tree (a script at its root) is not such a directory.
    done = subprocess.run(
        [sys.executable, "-c", "import collectives"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr


BUILD = """
import pathlib, sys
from setuptools import build_meta
out = pathlib.Path(sys.argv[1])
names = [build_meta.build_wheel(str(out)), build_meta.build_sdist(str(out))]
(out / "built.txt").write_text("\\n".join(names))
"""


def test_the_wheel_and_sdist_carry_the_licence_the_version_and_no_tests(tmp_path: Path) -> None:
    """What ``pip wheel .`` and an sdist built from a clone hold (built from a copy of the
    tracked files, as a fresh clone has them): the licence, hvdrun's one version, the
    generated gRPC code; no tests."""
    import tarfile
    import zipfile

    from hvdrun.version import __version__

    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    if not tracked:
        pytest.skip("not a git clone: the tracked files are unknown")
    source = tmp_path / "clone"
    for name in filter(None, tracked.split("\0")):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((REPO / name).read_bytes())
    out = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-c", BUILD, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel_name, sdist_name = (out / "built.txt").read_text().splitlines()
    assert wheel_name == f"hvdrun-{__version__}-py3-none-any.whl", wheel_name
    with zipfile.ZipFile(out / wheel_name) as wheel:
        names = wheel.namelist()
        info = f"hvdrun-{__version__}.dist-info"
        metadata = wheel.read(f"{info}/METADATA").decode()
    assert f"{info}/licenses/LICENSE" in names, names
    assert f"\nVersion: {__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "rendezvous/rendezvous_pb2.py" in names and "rendezvous/rendezvous_pb2_grpc.py" in names
    assert not [name for name in names if name.startswith("tests/")], names
    with tarfile.open(out / sdist_name) as sdist:
        members = [member.name.split("/", 1)[-1] for member in sdist.getmembers()]
    assert "LICENSE" in members and "pyproject.toml" in members, members
    assert not [name for name in members if name.startswith("tests/")], members
