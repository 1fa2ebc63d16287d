"""scripts/setup_env.sh with a stand-in python: the first run makes the venv and installs, later runs skip
pip while nothing the installs depend on changed, and a system torch with CUDA is used as it is."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Stands in for python3 and the venv's python: logs each call, makes a venv whose python is itself, and
# imports torch where the system has one with CUDA (FAKE_TORCH_CUDA=1, seen by a venv that sees the
# system's packages) or once pip installed it into the venv.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_LOG"
venv=$(dirname "$(dirname "$0")")
if [[ $1 == -m && $2 == venv ]]; then
  dir=${@: -1}
  mkdir -p "$dir/bin"
  cp "$0" "$dir/bin/python"
  printf 'export PATH=%s/bin:$PATH\\n' "$dir" > "$dir/bin/activate"
  [[ $3 == --system-site-packages ]] && touch "$dir/system-site-packages"
  exit 0
fi
if [[ $1 == -m && $2 == pip && $* == *torch==* ]]; then
  touch "$venv/torch-installed"
  exit 0
fi
if [[ $1 == -c && $2 == *torch.version.cuda* ]]; then
  [[ ${FAKE_TORCH_CUDA:-0} == 1 ]]
  exit
fi
if [[ $1 == -c && $2 == "import torch" ]]; then
  [[ -e $venv/system-site-packages || -e $venv/torch-installed ]]
  exit
fi
exit 0
"""


def _checkout(tmp_path: Path) -> Path:
    """A checkout with the real setup_env.sh and setup.py, and a stand-in python3."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "csrc").mkdir()
    (root / "moe_ep").mkdir()
    shutil.copy(ROOT / "scripts" / "setup_env.sh", root / "scripts")
    shutil.copy(ROOT / "setup.py", root)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return root


def _source(root: Path, tmp_path: Path, **env) -> list:
    """Sources setup_env.sh in a fresh bash -> the stand-in's calls (its pip calls among them)."""
    log = tmp_path / "calls.log"
    log.write_text("")
    done = subprocess.run(["bash", "-c", f"source {root}/scripts/setup_env.sh && echo active: $(command -v python)"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(tmp_path / "python3"), "FAKE_LOG": str(log), **env})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"active: {root}/.venv/bin/python" in done.stdout, done.stdout
    return log.read_text().splitlines()


def _pip_installs(calls: list) -> list:
    return [c for c in calls if " -m pip install " in c]


def test_a_second_run_skips_the_installs(tmp_path):
    root = _checkout(tmp_path)
    first = _source(root, tmp_path)
    assert any("-m venv" in c for c in first)
    installs = _pip_installs(first)
    assert any(c.endswith(f"--no-build-isolation -e {root}") for c in installs), installs
    assert _source(root, tmp_path) == []  # not even a python started


def test_a_changed_setup_installs_again(tmp_path):
    root = _checkout(tmp_path)
    _source(root, tmp_path)
    with open(root / "setup.py", "a") as f:
        f.write("\n# changed\n")
    assert _pip_installs(_source(root, tmp_path))
    assert _source(root, tmp_path) == []


def test_built_kernels_install_again_when_their_sources_change(tmp_path):
    root = _checkout(tmp_path)
    (root / "csrc" / "kernel.cu").write_text("// one\n")
    _source(root, tmp_path)
    (root / "moe_ep" / "_C.cpython-311-x86_64-linux-gnu.so").write_text("")  # what the install built
    _source(root, tmp_path)
    assert _source(root, tmp_path) == []
    (root / "csrc" / "kernel.cu").write_text("// two\n")
    assert _pip_installs(_source(root, tmp_path))


def test_a_system_torch_with_cuda_is_used_as_it_is(tmp_path):
    root = _checkout(tmp_path)
    calls = _source(root, tmp_path, FAKE_TORCH_CUDA="1")
    assert (root / ".venv" / "system-site-packages").exists()
    assert not [c for c in calls if "torch==" in c], calls


def test_without_a_system_torch_with_cuda_the_venv_gets_its_own(tmp_path):
    root = _checkout(tmp_path)
    calls = _source(root, tmp_path)
    assert not (root / ".venv" / "system-site-packages").exists()
    assert any(c.endswith("-m pip install -q torch==2.13.0") for c in calls), calls
