"""The architecture's promises, checked: core never imports a backend, a rollout source or an
engine; neither core nor the CLI and logging set-up branch on a backend's or a source's name; and
`import unirl` (and `unirl check`) work with neither engine installed, and `import unirl` imports
no torch (the CLI sets OpenMP's environment before torch loads)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).parents[2] / "unirl" / "core"
UNIRL = CORE.parent
# The engines core must not import (by top-level module name).
ENGINES = {"deepspeed", "megatron", "transformers", "vllm"}


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
        if name.split(".")[0] in ENGINES or name.startswith(("unirl.backends", "unirl.rollouts"))
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


def _code_words(path: Path) -> list[tuple[int, str]]:
    """Names and string literals of a module's code (not its comments or docstrings), lowercased,
    with their line numbers."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            words.append((node.lineno, node.attr))
        elif isinstance(node, ast.alias):
            words.append((node.lineno, node.name))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            words.append((node.lineno, node.value))
    return [(n, w.lower()) for n, w in words]


def test_no_branch_on_a_rollout_source():
    """Per-source rules, options, descriptions and loggers live in each source's plug-in: core,
    the CLI and the logging set-up never compare ``rollout.source`` with a name, nor name vLLM
    in their code."""
    files = [*sorted(CORE.rglob("*.py")), UNIRL / "cli.py", UNIRL / "log_setup.py"]
    branches = [
        f"{path.relative_to(UNIRL.parent)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(rollout|\br)\.source\s*(==|!=|\bin\b)\s*[\"'(\[]", line)
    ]
    assert branches == []
    named = [
        f"{path.relative_to(UNIRL.parent)}:{n}: {word!r}"
        for path in files
        for n, word in _code_words(path)
        if "vllm" in word
    ]
    assert named == []


def test_import_unirl_imports_no_torch():
    code = "import sys, unirl, unirl.cli; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:] or "import unirl imported torch"


BLOCK_ENGINES = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'deepspeed', 'megatron', 'transformers', 'vllm'}:
            raise ImportError(f'{name} is blocked for this test')
sys.meta_path.insert(0, Block())
import unirl, unirl.core.step, unirl.core.maths.losses, unirl.core.maths.advantages, unirl.backends
import unirl.rollouts
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
