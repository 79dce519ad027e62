"""The declared floors, the lowest-versions pins (constraints-lowest.txt) and make test's pins (constraints.txt)
agree."""

import sys
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import floors  # noqa: E402


def test_every_lowest_pin_is_a_declared_floor():
    assert floors.mismatches(floors.declared_floors(), floors.pinned(floors.LOWEST)) == []


def test_a_floor_that_moved_without_its_pin_is_reported():
    declared = floors.declared_floors()
    problems = floors.mismatches({**declared, "transformers": "5.23"}, floors.pinned(floors.LOWEST))
    assert problems == ["transformers: constraints-lowest.txt pins 5.16.1, pyproject.toml declares >=5.23"]
    assert floors.mismatches({k: v for k, v in declared.items() if k != "peft"}, {"peft": "0.18.0"}) == [
        "peft: constraints-lowest.txt pins 0.18.0, pyproject.toml declares no floor"]


def test_the_pins_of_make_test_satisfy_the_floors():
    pins = floors.pinned(floors.PINS)
    below = {name: (pins[name], floor) for name, floor in floors.declared_floors().items()
             if name in pins and Version(pins[name]) < Version(floor)}
    assert below == {}


def test_the_leg_constraints_keep_the_other_pins(tmp_path):
    out = tmp_path / "constraints.txt"
    assert floors.main(["constraints", str(out)]) == 0
    merged = floors.pinned(out)
    assert merged["transformers"] == "5.16.1" and merged["torch"] == floors.pinned(floors.LOWEST)["torch"]
    assert merged["scikit-learn"] == floors.pinned(floors.PINS)["scikit-learn"]
    assert set(merged) == set(floors.pinned(floors.PINS)) | set(floors.pinned(floors.LOWEST))
