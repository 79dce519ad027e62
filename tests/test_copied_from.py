"""Blocks copied from transformers stay in step with the pinned release (``constraints.txt``).

A copied function or class is marked on the lines just above it::

    # Copied from transformers.models.llama.modeling_llama.LlamaModel.__init__ with
    #     super().__init__(config) -> LlamaPreTrainedModel.__init__(self, config)
    #     LlamaDecoderLayer -> SelfLlamaDecoderLayer

Each indented ``old -> new`` line is a plain text replacement applied, in order, to the original's source (found with
``inspect``); the result must parse to the same syntax tree as the block here, up to comments, docstrings, formatting
and type annotations. A replacement that no longer matches anything is drift too.

The copies follow the transformers release the project pins (as transformers' own ``check_copies`` follows its own
tree): on another release (CI's newest-release leg) the comparison is skipped with the reason, since upstream code
moves between releases while the copies keep working (the compatibility check loads every family there); drift shows
up here when the pin is raised.
"""

import ast
import copy
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINNED = re.search(r"^transformers==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
HEADER = re.compile(r"^\s*# Copied from transformers\.(\S+?)(?: with)?\s*$")
PAIR = re.compile(r"^\s*# {5}(.+?) -> (.+?)\s*$")


def find_copies(path: Path) -> list:
    """``[(line of the def/class, dotted source, [(old, new), ...]), ...]`` for every marker in ``path``."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = HEADER.match(line)
        if not m:
            continue
        pairs, j = [], i + 1
        while j < len(lines) and PAIR.match(lines[j]):
            pairs.append(PAIR.match(lines[j]).groups())
            j += 1
        found.append((j + 1, m.group(1), pairs))
    return found


def resolve(dotted: str):
    """The object ``transformers.<dotted>``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("transformers." + ".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"transformers.{dotted} cannot be imported")


def normalise(node: ast.AST) -> str:
    """The syntax tree without docstrings, decorators' positions, type annotations and source positions."""
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = n.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                n.body = body[1:] or [ast.Pass()]
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n.returns = None
        if isinstance(n, ast.arg):
            n.annotation = None
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def drift(tree: ast.Module, lineno: int, dotted: str, pairs) -> str:
    """'' when the block defined at ``lineno`` equals the replaced original, else what differs."""
    ours = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.lineno == lineno), None)
    if ours is None:
        return f"no function or class right after the marker (line {lineno})"
    source = textwrap.dedent(inspect.getsource(resolve(dotted)))
    for old, new in pairs:
        if old not in source:
            return f"replacement {old!r} -> {new!r} matches nothing in transformers.{dotted}"
        source = source.replace(old, new)
    theirs = ast.parse(source).body[0]
    if normalise(theirs) != normalise(ours):
        return f"{ours.name} differs from transformers.{dotted} after the replacements:\n{ast.unparse(theirs)}"
    return ""


FILES = sorted(ROOT.glob("modeling/*/modeling_*.py"))
COPIES = [(path, *copy_) for path in FILES for copy_ in find_copies(path)]


@pytest.mark.parametrize("path,lineno,dotted,pairs", COPIES,
                         ids=[f"{p.parent.name}:{d.split('.', 3)[3]}" for p, _, d, _ in COPIES])
def test_copy_matches_the_installed_transformers(path, lineno, dotted, pairs):
    import transformers

    if transformers.__version__ != PINNED:
        pytest.skip(f"the copies follow the pinned transformers {PINNED}; installed: {transformers.__version__}")
    assert not drift(ast.parse(path.read_text()), lineno, dotted, pairs), drift(
        ast.parse(path.read_text()), lineno, dotted, pairs)


@pytest.mark.parametrize("family", ["self_llama", "self_mistral"])
def test_self_decoders_mark_their_copies(family):
    (path,) = ROOT.glob(f"modeling/{family}/modeling_*.py")
    marked = {d.split(".", 3)[3] for _, d, _ in find_copies(path)}
    arch = "Llama" if family == "self_llama" else "Mistral"
    assert marked == {f"{arch}DecoderLayer.__init__", f"{arch}DecoderLayer.forward", f"{arch}Model.__init__",
                      f"{arch}ForCausalLM.__init__"}


def test_a_drifted_copy_is_reported():
    path = ROOT / "modeling/self_llama/modeling_self_llama.py"
    text = path.read_text()
    (lineno, dotted, pairs), = [c for c in find_copies(path) if c[1].endswith("LlamaModel.__init__")]
    assert drift(ast.parse(text), lineno, dotted, pairs) == ""
    changed = text.replace("self.gradient_checkpointing = False", "self.gradient_checkpointing = True", 1)
    assert "differs" in drift(ast.parse(changed), lineno, dotted, pairs)
    assert "matches nothing" in drift(ast.parse(text), lineno, dotted, [("no_such_text", "x")])
