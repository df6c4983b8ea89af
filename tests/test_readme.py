"""README's quickstart runs as written."""

from pathlib import Path


def test_quickstart_runs():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = readme.split("```python")[1].split("```")[0]
    exec(compile(code, "README.md", "exec"), {})
