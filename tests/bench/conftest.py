"""The suite's scripts (bench/) import each other by name, as when run from there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
