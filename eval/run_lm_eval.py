"""``python -m hf_fixedpoint.eval.run_lm_eval ...``: the lm_eval command line with ``hf-fixedpoint`` registered.

The stock ``lm_eval`` command does not import plugins; this wrapper imports ``hf_fixedpoint.eval.lm_harness`` and
then runs lm_eval's own CLI with the same arguments. When no ``--include_path`` is given to ``run``, ``ls`` or
``validate``, the packaged tasks folder (``fp_text_ppl``, ``fp_copy_mc``, ``fp_copy_gen``; tag ``fp_offline``) is
added. Example::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m hf_fixedpoint.eval.run_lm_eval run --model hf-fixedpoint \\
        --model_args pretrained=runs/deq_lm_demo,trust_remote_code=True,fp_max_iter=8 \\
        --tasks fp_offline --device cpu --batch_size 8 --limit 16
"""

from __future__ import annotations

import sys

import hf_fixedpoint.eval.lm_harness  # noqa: F401  (registers "hf-fixedpoint")
from hf_fixedpoint.eval.runner import TASKS_DIR


def with_default_include_path(argv: list) -> list:
    """``argv`` (without the program name) plus ``--include_path TASKS_DIR`` where lm_eval would accept one.

    Left unchanged: help requests, an explicit ``--include_path``, and a lone argument other than ``ls`` /
    ``validate`` (``run`` alone prints help; lm_eval inserts ``run`` itself only when given 2+ arguments).
    """
    argv = list(argv)
    if not argv or any(a in ("-h", "--help") or a.split("=")[0] == "--include_path" for a in argv):
        return argv
    if len(argv) == 1 and argv[0] not in ("ls", "validate"):
        return argv
    return [*argv, "--include_path", TASKS_DIR]


def main(argv: list | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    args = sys.argv[1:] if argv is None else list(argv)
    sys.argv = [sys.argv[0], *with_default_include_path(args)]
    cli_evaluate()


if __name__ == "__main__":
    main()
