"""The README and the docs against the repository: every file they name exists in a clone, every train.py flag they
use is a flag, every recipe is listed, and nothing points outside the repository."""

from __future__ import annotations

import re

import pytest
from helpers import REPO

from megarl.arguments import components
from megarl.config import flag_specs

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a path inside the repository, as the docs write one: recipes/r1_math.sh, tools/plan.py, docs/guide.md, ...
PATH = re.compile(r"(?<![\w/.$-])((?:recipes|tools|launch|megarl|docs|tests)/[\w./-]*\w)")


def _text(doc) -> str:
    return doc.read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_is_in_the_repository(doc):
    missing, paths = [], PATH.findall(_text(doc))
    assert paths, "the pattern must see the doc's paths"
    for path in paths:
        if "<" in path or "*" in path:
            continue
        target = (doc.parent if path.startswith(("../", "./")) else REPO) / path
        if not target.exists() and not (REPO / path).exists():
            missing.append(path)
    for link in re.findall(r"\]\(([^)#:]+)\)", _text(doc)):  # markdown links are relative to the document
        if not (doc.parent / link).exists():
            missing.append(link)
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_points_outside_the_repository_or_at_work_in_progress(doc):
    text = _text(doc)
    assert "../shared" not in text and "shared/notes" not in text
    assert not re.search(r"\bthe issue\b|\bissue \d+\b", text, re.I)


def test_every_train_py_flag_in_the_docs_is_a_flag():
    specs = flag_specs(components())  # megarl's own and every built-in component's
    flags = set(specs) | {f"--no-{f[2:]}" for f in specs} | {"--help", "--flag"}  # --flag: a placeholder
    unknown = set()
    for doc in DOCS:
        for line in _text(doc).splitlines():
            if "megarl/train.py" in line:
                tail = line.split("megarl/train.py", 1)[1].split("#")[0]
                unknown |= {f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", tail) if f not in flags}
    assert unknown == set()


def test_the_readme_lists_every_recipe_and_model_file():
    readme = _text(REPO / "README.md")
    named = [p for p in (REPO / "recipes").glob("*.sh")] + list((REPO / "recipes/models").glob("*.sh"))
    assert len(named) >= 10
    assert [p.name for p in named if p.name not in readme] == []
