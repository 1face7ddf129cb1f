"""The README's quick start, walked as a new user would: a fresh virtual environment,
accord installed into it (from the source tree, and from the wheel `python -m build`
makes, which `twine check` accepts with its sdist), the README's hello.py run under
`accord run -n 4`. The source install runs where no C compiler works (CC=false), so
the optional C helper is not built and the pure path serves; the wheel is built
with the machine's compiler and carries the helper.

The program, the command and the expected output are read from README.md itself, so
the test fails when the README stops being true. The environments are plain venvs
(no --system-site-packages): numpy comes from the package index, as it would for a
user, and nothing of this test process's environment (PYTHONPATH, the test venv)
leaks in. The package is built from a copy of the tree so that the build's
by-products (build/, *.egg-info) never land in the checkout.
"""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# creating a venv and installing numpy into it takes 15-40 s on a busy 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
STEP_TIMEOUT = 180


def _readme_blocks():
    """The README's fenced code blocks, as (info string, lines)."""
    blocks, current = [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def _readme_program():
    found = [lines for info, lines in _readme_blocks()
             if info == "python" and lines[:1] == ["# hello.py"]]
    assert found, "README.md has no ```python block starting with '# hello.py'"
    return "\n".join(found[0]) + "\n"


def _readme_output():
    found = [lines for _, lines in _readme_blocks() if lines[:1] and
             lines[0].startswith("[rank 0] ")]
    assert found, "README.md shows no output of the quick start"
    return found[0]


def _copy_tree(dest):
    """The source tree as a fresh clone has it (no venv, no build outputs)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", ".pytest_cache",
        "*.so"))
    return dest


def _user_env(venv):
    """What a shell with the venv activated has: its bin first on PATH, nothing of ours."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("ACCORD_")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(cmd, cwd, env=None):
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=STEP_TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}"
    return proc.stdout


def _fresh_venv(tmp_path, install, build_env=None):
    """A plain venv with `pip install INSTALL` done, the way the README says
    (build_env: more environment for that install, CC=false say)."""
    venv = tmp_path / "venv"
    # sys.executable is the test venv's python; venv builds on its base interpreter
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    _run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", install], tmp_path,
         dict(_user_env(venv), **(build_env or {})))
    return venv


def _helper_built(tmp_path, venv):
    """Whether accord in venv has its optional C helper (accord/transport/ring_core.c)."""
    out = _run(["python", "-c", "from accord.transport import ring_helper; "
                "print('helper', ring_helper.built())"], tmp_path, _user_env(venv))
    return "helper True" in out


def _walk_quick_start(tmp_path, venv):
    env = _user_env(venv)
    where = _run(["python", "-c", "import accord; print(accord.__file__)"], tmp_path, env)
    assert where.strip().startswith(str(venv)), f"accord imported from outside the venv: {where}"

    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text(_readme_program())
    assert "accord run -n 4 hello.py" in README
    # `accord` found on PATH, as in the README's activated environment
    out = _run(["accord", "run", "-n", "4", "hello.py"], work, env)

    lines = out.splitlines()
    expected = _readme_output()
    assert len(expected) == 4
    for line in lines:
        # every line whole and prefixed with the rank that printed it
        m = re.fullmatch(r"\[rank (\d)\] (\d) \[1\. 1\. 1\. 1\.\]", line)
        assert m and m.group(1) == m.group(2), f"a line not whole or not prefixed: {line!r}\n{out}"
    # exactly the README's lines (the ranks' order varies from run to run)
    assert sorted(lines) == sorted(expected), out


def test_readme_quick_start_in_a_fresh_venv_without_a_c_compiler(tmp_path):
    """pip install /path/to/accord where no C compiler works (CC=false): the optional
    helper is not built, the install still succeeds, and accord runs its pure path."""
    src = _copy_tree(tmp_path / "accord-src")
    venv = _fresh_venv(tmp_path, str(src), {"CC": "false"})
    assert not _helper_built(tmp_path, venv)
    _walk_quick_start(tmp_path, venv)


def test_built_wheel_installs_and_runs_the_quick_start(tmp_path):
    src = _copy_tree(tmp_path / "accord-src")
    dist = tmp_path / "dist"
    # no --wheel: build makes the sdist, then the wheel from the unpacked sdist, so a
    # file missing from the sdist breaks the wheel too
    _run([sys.executable, "-m", "build", "--outdir", dist, src], tmp_path)
    # the wheel carries the compiled helper, so it is this interpreter's and platform's
    wheels = list(dist.glob("accord-*-cp3*-linux_*.whl"))
    sdists = list(dist.glob("accord-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist.iterdir())
    with zipfile.ZipFile(wheels[0]) as z:
        for helper in ("accord/transport/ring_core.", "accord/copy_core.", "accord/halves_core."):
            assert any(n.startswith(helper) and n.endswith(".so")
                       for n in z.namelist()), (helper, z.namelist())
    with tarfile.open(sdists[0]) as t:
        names = t.getnames()
    for source in ("/accord/transport/ring_core.c", "/accord/copy_core.c",
                   "/accord/halves_core.c", "/accord/stream_store.h"):
        assert any(n.endswith(source) for n in names), (source, names)
    assert any(n.endswith("/setup.py") for n in names), names
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", wheels[0], sdists[0]],
                   tmp_path)
    assert checked.count("PASSED") == 2, checked
    venv = _fresh_venv(tmp_path, str(wheels[0]))
    assert _helper_built(tmp_path, venv)
    _walk_quick_start(tmp_path, venv)
