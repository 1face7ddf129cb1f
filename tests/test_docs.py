"""The documentation names only flags and variables that exist.

docs/ and the README tell users which `accord run` / `accord bench` options and
which ACCORD_* variables to use. A renamed flag or variable leaves them wrong
without any build failing (mkdocs checks links, not commands), so these tests
hold every name they mention against the commands' own --help and the code.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
TEXTS = {p.name: p.read_text() for p in PAGES} | {"README.md": (ROOT / "README.md").read_text()}
COMMANDS = ("run", "bench", "doctor")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z-]*[a-z]")


@pytest.fixture(scope="module")
def helps():
    out = {}
    for cmd in COMMANDS:
        p = subprocess.run([sys.executable, "-m", "accord", cmd, "--help"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=30)
        assert p.returncode == 0, p.stdout
        out[cmd] = set(_OPTION.findall(p.stdout))
    return out


def _command_lines():
    """(page, command, options) of every `accord run|bench|doctor ...` written in the docs."""
    for page, text in TEXTS.items():
        for m in re.finditer(r"\baccord (run|bench|doctor)\b([^\n`|]*)", text):
            rest = m.group(2)
            # options after the program (`accord run ... script.py --lr 1`) are the program's
            rest = re.split(r"\S+\.py\b|\s-m\s+\S+", rest)[0]
            yield page, m.group(1), _OPTION.findall(rest)


def test_command_lines_use_real_options(helps):
    seen = 0
    for page, cmd, options in _command_lines():
        for opt in options:
            seen += 1
            assert opt in helps[cmd], f"{page}: `accord {cmd} {opt}`: accord {cmd} has no {opt}"
    assert seen >= 10          # the docs do show commands with options: this looked at them


def test_options_named_in_the_docs_exist(helps):
    known = set().union(*helps.values())
    for page in PAGES:
        for opt in re.findall(r"`(--[a-z][a-z-]*[a-z])", page.read_text()):
            assert opt in known, f"docs/{page.name} names {opt}, which no accord command has"


def test_environment_variables_named_in_the_docs_are_read_by_the_code():
    source = "\n".join(p.read_text() for p in (ROOT / "accord").rglob("*.py"))
    named = {v for text in TEXTS.values() for v in re.findall(r"\bACCORD_[A-Z0-9_]*[A-Z0-9]", text)}
    assert "ACCORD_SHM_CMA" in named and "ACCORD_ALGORITHMS" in named
    for var in sorted(named):
        assert f'"{var}"' in source, f"the docs name {var}, which no accord module reads"


def test_every_page_is_in_the_site_nav():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == sorted(p.name for p in PAGES)
