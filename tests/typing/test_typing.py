"""The negative typing cases fail mypy, line by line."""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MARK = "# type: ignore[arg-type]  # negative"


def test_every_negative_case_fails_the_type_check(tmp_path: Path) -> None:
    source = (HERE / "clients_refused.py").read_text()
    marked = [n for n, line in enumerate(source.splitlines(), 1) if line.endswith(MARK)]
    assert len(marked) >= 10
    stripped = tmp_path / "clients_refused.py"
    stripped.write_text(source.replace("  " + MARK, ""))
    stdout, stderr, status = api.run(
        [
            "--config-file",
            str(ROOT / "mypy.ini"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            str(stripped),
        ]
    )
    assert status == 1, stdout + stderr
    failing = {
        int(match.group(1))
        for match in re.finditer(r"clients_refused\.py:(\d+): error: .*\[arg-type\]", stdout)
    }
    assert failing == set(marked), stdout
