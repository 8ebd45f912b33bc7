"""The architecture's two promises, checked: core never imports a backend or an engine, and
`import unirl` (and `unirl check`) work with neither engine installed."""

import ast
import re
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).parents[2] / "unirl" / "core"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_core_imports_no_backend_or_engine():
    offenders = [
        f"{path.relative_to(CORE.parent.parent)} imports {name}"
        for path in sorted(CORE.rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] in {"deepspeed", "megatron", "transformers"}
        or name.startswith("unirl.backends")
    ]
    assert offenders == []


def test_core_has_no_per_backend_branch():
    """Per-backend rules live in each backend's plug-in (`check`, its options section): core
    never compares the configured backend with a name."""
    offenders = [
        f"{path.relative_to(CORE.parent.parent)}:{n}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"backend\s*(==|!=|in)\s*[\"'(\[]", line)
    ]
    assert offenders == []


BLOCK_ENGINES = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'deepspeed', 'megatron', 'transformers'}:
            raise ImportError(f'{name} is blocked for this test')
sys.meta_path.insert(0, Block())
import unirl, unirl.core.step, unirl.core.maths.losses, unirl.core.maths.advantages, unirl.backends
from unirl.cli import main
sys.exit(main(['check', sys.argv[1]]))
"""


def test_import_and_check_without_engines():
    example = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_ENGINES, str(example)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "old log-probs: reuse" in proc.stdout
