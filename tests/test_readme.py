"""The README's and the family guides' (``docs/*.md``) Python examples run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (doc.relative_to(ROOT).as_posix(), i, code)
    for doc in DOCS
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL))
]


def test_readme_has_examples():
    assert sum(name == "README.md" for name, _, _ in BLOCKS) >= 2


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}[{i}]" for n, i, _ in BLOCKS])
def test_doc_example(name, index, code):
    exec(compile(code, f"{name}[python block {index}]", "exec"), {})
