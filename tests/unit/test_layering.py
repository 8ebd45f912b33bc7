"""The architecture's promises, checked: core never imports a backend, a rollout source or an
engine; no backend folder imports another (but the Hugging Face engines' shared ``hf/``) and no
backend imports the app layer; neither core nor the CLI and logging set-up branch on a backend's
or a source's name; and `import unirl` (and `unirl check`) work with neither engine installed, and
`import unirl` imports no torch (the CLI sets OpenMP's environment before torch loads)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.unit.test_import_cycles import import_graph

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


# The backend folders that may import another one: ``hf/`` is the Hugging Face engines' shared
# plumbing (loop, models, critic), used by deepspeed/ and fsdp2/. Megatron builds its own
# models and imports no other folder; what every backend shares sits beside the folders
# (``unirl/backends/*.py``), open to all.
MAY_IMPORT = {"deepspeed": {"hf"}, "fsdp2": {"hf"}}
# The application around the library: what a backend must not reach up into.
APP_LAYER = ("log_setup", "cli", "train", "convert", "plot", "serve")


def _folder(module: str, package: str, folders: set[str]) -> str | None:
    """The backend folder of ``package`` that ``module`` belongs to, or None."""
    head = module[len(package) + 1 :].split(".")[0] if module.startswith(package + ".") else None
    return head if head in folders else None


def folder_crossings(
    graph: dict[str, set[str]], package: str, may_import: dict[str, set[str]]
) -> list[str]:
    """Imports from one folder of ``package`` into another that ``may_import`` does not allow
    (every import counts: top-level, function-local, TYPE_CHECKING; `import_graph`)."""
    folders = {
        module[len(package) + 1 :].split(".")[0]
        for module in graph
        if module.startswith(package + ".") and module.count(".") > package.count(".") + 1
    }
    found = []
    for module, imported in sorted(graph.items()):
        source = _folder(module, package, folders)
        for target in sorted(filter(None, (_folder(m, package, folders) for m in imported))):
            if source is not None and target not in {source, *may_import.get(source, ())}:
                found.append(f"{module} imports {package}.{target}")
    return sorted(set(found))


def app_imports(graph: dict[str, set[str]], package: str, app: list[str]) -> list[str]:
    """Imports of an app-layer module (or one under it) from anywhere in ``package``."""
    return [
        f"{module} imports {target}"
        for module, imported in sorted(graph.items())
        if module == package or module.startswith(package + ".")
        for target in sorted(imported)
        if any(target == a or target.startswith(a + ".") for a in app)
    ]


def test_no_backend_folder_imports_another():
    assert folder_crossings(import_graph(), "unirl.backends", MAY_IMPORT) == []


def test_no_backend_imports_the_app_layer():
    app = [f"unirl.{name}" for name in APP_LAYER]
    assert app_imports(import_graph(), "unirl.backends", app) == []


def test_the_backend_guards_see_a_crossing(tmp_path):
    """Both guards against a small package: a folder importing another (lazily), an allowed
    import of the shared folder, a shared module beside the folders, and the app layer."""
    root = tmp_path / "pkg"
    for folder in ("backends/a", "backends/b", "backends/hf"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "backends" / "__init__.py").write_text("")
    (root / "backends" / "shared.py").write_text("")
    (root / "log_setup.py").write_text("")
    (root / "backends" / "a" / "x.py").write_text(
        "from pkg.backends import shared\nfrom pkg.backends.hf import y\n"
        "def f():\n    from pkg.backends.b import z\n"
    )
    (root / "backends" / "hf" / "y.py").write_text("")
    (root / "backends" / "b" / "z.py").write_text("from pkg.backends.hf import y\n")
    (root / "backends" / "shared.py").write_text("import pkg.log_setup\n")
    graph = import_graph(root)
    assert folder_crossings(graph, "pkg.backends", {"a": {"hf"}}) == [
        "pkg.backends.a.x imports pkg.backends.b",
        "pkg.backends.b.z imports pkg.backends.hf",
    ]
    assert app_imports(graph, "pkg.backends", ["pkg.log_setup"]) == [
        "pkg.backends.shared imports pkg.log_setup"
    ]


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
