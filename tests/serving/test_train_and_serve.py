"""examples/train_and_serve.py, tiny: the serving process it starts serves the versions the
training process publishes as it finds them (which ones depends on the two processes' pace)
and ends on the trained model's prediction, exactly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_and_serve_example_serves_the_trained_model(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_and_serve.py"), "--samples", "8000", "--batch", "1000",
         "--every", "3", "--store", str(tmp_path / "store"), "--poll", "0.05"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    trained = re.search(r"\[trainer\] 8 steps, published versions \[1, 2, 3\]; final version 3: p\(click\) = (\S+)",
                        out.stdout)  # fmt: skip
    served = re.search(r"\[server\] final version 3: p\(click\) = (\S+)", out.stdout)
    assert trained and served, out.stdout
    assert trained.group(1) == served.group(1)
    assert re.search(r"\[server\] serving version [123]: p\(click\) = ", out.stdout), out.stdout
