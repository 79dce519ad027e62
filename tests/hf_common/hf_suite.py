"""transformers' own model test suite (``ModelTesterMixin``), run against our classes.

The wheel ships no tests; the PyPI sdist of the pinned transformers does (``tests/test_modeling_common.py`` and
``tests/test_configuration_common.py``). ``ensure()`` downloads that sdist once from PyPI (``pip download``, ~11 MB),
extracts the two files into ``tests/hf_common/_hf/<version>/hf_common_tests/`` (git-ignored; HF's code is not
committed; one folder per installed transformers release, so the suite of another release is never reused) and
adds three stub modules for the parts the sdist lacks (the generation and export mixins, whose suites are not in the
sdist, and the common config kwargs). Needs network access to PyPI on the first run. pip prepares the sdist's metadata
in an isolated build environment, because the test environment's own setuptools may be too old for it (a fresh venv's
setuptools 65.5 cannot do it without the ``wheel`` package: the lowest-versions venv).
"""

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parent / "_hf" / transformers.__version__
PACKAGE = ROOT / "hf_common_tests"
FILES = ("test_modeling_common.py", "test_configuration_common.py")
STUBS = {
    "generation/test_utils.py": "class GenerationTesterMixin:  # generation suite not in the sdist\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:  # export suite not in the sdist\n    pass\n",
    # The keys test_configuration_common.py checks; values differ from every PretrainedConfig default.
    "utils/test_configuration_utils.py": (
        "config_common_kwargs = {'return_dict': False, 'output_hidden_states': True, 'output_attentions': True, "
        "'dtype': 'float16', 'tie_word_embeddings': False, 'is_decoder': True, 'cross_attention_hidden_size': 128, "
        "'add_cross_attention': True, 'chunk_size_feed_forward': 5, 'architectures': ['BertModel'], "
        "'finetuning_task': 'translation', 'id2label': {0: 'label'}, 'label2id': {'label': '0'}, "
        "'tokenizer_class': 'BertTokenizerFast', 'prefix': 'prefix', 'bos_token_id': 6, 'pad_token_id': 7, "
        "'eos_token_id': 8, 'sep_token_id': 9, 'decoder_start_token_id': 10, "
        "'task_specific_params': {'translation': 'some_params'}, 'problem_type': 'regression'}\n"
    ),
}


def ensure() -> Path:
    """Make ``hf_common_tests`` importable (downloading it on first use) and return its folder."""
    if not all((PACKAGE / name).is_file() for name in FILES):
        version = transformers.__version__
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary",
                            ":all:", "--no-deps", "-q", "-d", tmp], check=True)
            sdist = next(Path(tmp).glob("transformers-*.tar.gz"))
            PACKAGE.mkdir(parents=True, exist_ok=True)
            with tarfile.open(sdist) as tar:
                for name in FILES:
                    member = tar.getmember(f"transformers-{version}/tests/{name}")
                    (PACKAGE / name).write_bytes(tar.extractfile(member).read())
    for rel, text in {"__init__.py": "", "generation/__init__.py": "", "exporters/__init__.py": "",
                      "utils/__init__.py": "", **STUBS}.items():
        path = PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file():
            path.write_text(text)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return PACKAGE
