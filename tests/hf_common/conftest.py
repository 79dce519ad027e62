"""Markers used by transformers' test_modeling_common.py (registered so pytest does not warn about them)."""

HF_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test")


def pytest_configure(config):
    for name in HF_MARKERS:
        config.addinivalue_line("markers", f"{name}: transformers test marker (tests/hf_common)")

# transformers' test files downloaded into _hf/ are imported by hf_suite.py, never collected themselves (a folder left
# by an earlier layout or release would otherwise be collected and fail to import).
collect_ignore_glob = ["_hf/*"]
