"""The user documentation's links and file references resolve: every relative Markdown link in README.md, docs/,
benchmarks/ and lab/ names an existing file or folder, and every inline-code path in README.md and docs/ that names a
repository file (or a result under benchmarks/results/) exists. A moved result folder or a renamed script then
fails here instead of leaving a number without its raw file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"```.*?```", re.S)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _markdown_files() -> List[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("benchmarks", "lab"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return [f for f in files if f.exists()]


def broken_links(path: Path) -> List[str]:
    """Relative links of one Markdown file that name nothing on disk (anchors and web addresses are not checked)."""
    text = FENCE.sub("", path.read_text())
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        rel = target.split("#", 1)[0]
        if rel and not (path.parent / rel).exists():
            out.append(f"{_name(path)}: ({target})")
    return out


def missing_code_paths(path: Path) -> List[str]:
    """Inline-code paths that name a repository file or a result: `pretrain/x.py`, `benchmarks/results/...`, or a
    result folder's file as `muon_h200/x.json`. Globs, placeholders and generated paths (runs/, data/) are skipped."""
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {"runs", "data"}
    result_dirs = {p.name for p in RESULTS.iterdir() if p.is_dir()} if RESULTS.exists() else set()
    text = FENCE.sub("", path.read_text())
    out = []
    for token in CODE.findall(text):
        if "/" not in token or any(c in token for c in "{}*<>$=|,") or "..." in token:
            continue
        first = token.split("/", 1)[0]
        if first in top:
            ok = (ROOT / token).exists()
        elif first in result_dirs:
            ok = (RESULTS / token).exists()
        else:
            continue
        if not ok:
            out.append(f"{_name(path)}: `{token}`")
    return out


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_named_files_exist(path):
    missing = missing_code_paths(path)
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a link to a missing file and a missing repository file are reported, the rest is not."""
    (tmp_path / "other.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [gone](missing.md) [web](https://example.org) [anchor](#x) [a](other.md#keys)\n"
                    "`benchmarks/results/no_such_folder/x.json` `pretrain/no_such.py` `pretrain/train.py` "
                    "`runs/x/ckpt` `configs/*.yaml`\n")
    assert broken_links(page) == ["page.md: (missing.md)"]
    assert missing_code_paths(page) == ["page.md: `benchmarks/results/no_such_folder/x.json`",
                                        "page.md: `pretrain/no_such.py`"]
