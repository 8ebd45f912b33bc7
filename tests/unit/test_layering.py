"""The architecture's two promises, checked: core never imports a backend or an engine, and
`import unirl` (and `unirl check`) work with neither engine installed."""

import ast
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
