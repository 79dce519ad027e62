"""Evaluation plumbing (installed as ``hf_fixedpoint.eval``): the lm-eval model ``hf-fixedpoint``, offline runner.

Nothing here is imported by ``import hf_fixedpoint``; lm-eval is imported only by ``hf_fixedpoint.eval.lm_harness``.
"""
