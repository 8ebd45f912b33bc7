"""No config key that changes nothing: every field of every config section (the core sections,
`unirl.core.config.sections`, assembled by `unirl.core.config.run_config`, each registered backend's own
section and each registered rollout source's) is read somewhere in ``unirl/`` outside the modules
that declare and check it (reads there only validate): for a core section, outside ``sections/``
and ``config.py``.

A read is an attribute access ``<section>.<field>`` where ``<section>`` is recognised by how the
code reaches it: ``cfg.algorithm.clip_low`` / ``self.cfg.algorithm.clip_low`` (an attribute named
after the section), ``a = cfg.algorithm; a.clip_low`` (a name or ``self`` attribute bound to one,
also in tuple assignments), or a parameter annotated with the section's class
(``def f(parallel: ParallelConfig): parallel.tp``). A string that is exactly a full key path
(``"algorithm.clip_low"``, a key read with getattr) counts too; a key path inside a message (an f-string or a longer text)
does not. A field name alone, read on anything, does not count: ``.mode`` or ``.dir`` are
everywhere. A key declared on a loss or advantage settings field (``clip_low: float =
LOSS.clip_low``, `unirl.core.config.sections.feeds`) reaches the code as that settings field: it
counts as read where the settings field is read (``settings.clip_low`` on a parameter annotated
``LossSettings``, or ``self.loss_settings.clip_low``) outside the settings and config modules.
"""

from __future__ import annotations

import ast
import functools
import inspect
import typing
from collections import defaultdict
from pathlib import Path

import attrs

from unirl.backends import BACKENDS
from unirl.core.config import run_config as config_module
from unirl.core.config.run_config import UnirlConfig
from unirl.core.config.sections.feeds import FEEDS
from unirl.core.protocols.source_plugin import SOURCES

UNIRL = Path(config_module.__file__).parents[2]


def sections() -> dict[type, set[str]]:
    """Each attrs section class -> the names the code reaches it by (the field holding it)."""
    found: dict[type, set[str]] = defaultdict(set)

    def walk(cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            tp = hints[field.name]
            if attrs.has(tp):
                found[tp].add(field.name)
                walk(tp)

    walk(UnirlConfig)
    found[UnirlConfig].add("cfg")
    for name in BACKENDS.names():
        found[BACKENDS.get(name).options].add("backend_options")
    for plugin in SOURCES.values():
        if plugin.options is not None:
            found[plugin.options].add("source_options")
    return found


@functools.cache
def key_paths() -> dict[str, tuple[type, str]]:
    """Every full key path of the core config -> (its section class, its field); computed once
    (every scanned module's visitor asks)."""
    paths: dict[str, tuple[type, str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            tp = hints[field.name]
            if attrs.has(tp):
                walk(tp, f"{prefix}{field.name}.")
            else:
                paths[f"{prefix}{field.name}"] = (cls, field.name)

    walk(UnirlConfig, "")
    return paths


def section_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [
        f.name
        for f in attrs.fields(cls)
        if f.init
        and not attrs.has(hints[f.name])
        and f.name not in ("backend_options", "source_options")
    ]


class _Reads(ast.NodeVisitor):
    """Collects (section class, field) reads of one module, scope by scope."""

    def __init__(self, by_access: dict[str, set[type]], by_class_name: dict[str, type]) -> None:
        self.by_access = by_access  # "algorithm" -> {AlgorithmConfig}
        self.by_class_name = by_class_name  # "AlgorithmConfig" -> AlgorithmConfig
        self.key_paths = key_paths()  # "algorithm.kl_loss.coef" -> (KLConfig, "coef")
        self.scopes: list[dict[str, set[type]]] = [{}]
        self.self_attrs: dict[str, set[type]] = {}  # self.options = cfg.backend_options
        self.reads: set[tuple[type, str]] = set()

    def _bound(self, name: str) -> set[type]:
        return self.scopes[-1].get(name, set())

    def _section_of(self, node: ast.AST) -> set[type]:
        """The section classes an expression holds, when recognisable."""
        if isinstance(node, ast.Attribute):
            if (
                isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr in self.self_attrs
            ):
                return self.self_attrs[node.attr]
            return self.by_access.get(node.attr, set())
        if isinstance(node, ast.Name):
            return self._bound(node.id) | ({UnirlConfig} if node.id in ("cfg", "config") else set())
        return set()

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
            return
        held = self._section_of(value)
        if not held:
            return
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = held
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            self.self_attrs[target.attr] = held

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = dict(self.scopes[-1])  # closures see the enclosing bindings
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for arg in args:
            if arg.annotation is not None:
                text = ast.unparse(arg.annotation).replace('"', "").replace("'", "")
                for class_name, cls in self.by_class_name.items():
                    if class_name in text.replace("|", " ").split():
                        scope[arg.arg] = {cls}
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        for value in node.values:  # text of an f-string is a message, not a key read
            if isinstance(value, ast.FormattedValue):
                self.visit(value)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in self.key_paths:
            self.reads.add(self.key_paths[node.value])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            for cls in self._section_of(node.value):
                self.reads.add((cls, node.attr))
        self.generic_visit(node)


def declared_in(cls: type) -> Path:
    return Path(inspect.getsourcefile(cls)).resolve()


# The modules that make up the core config (the sections and the module assembling and checking
# them): a read in any of them only validates, so none counts for a core section.
CONFIG_FILES = {
    Path(config_module.__file__).resolve(),
    *(p.resolve() for p in (UNIRL / "core" / "run" / "sections").glob("*.py")),
}


# The attribute names that hold the settings objects built from the config (`RLStep`).
SETTINGS_ACCESS = {
    "LossSettings": "loss_settings",
    "AdvantageSettings": "advantage_settings",
    "RouterCoefficients": "router_coefficients",
}


def fed_settings(found: dict[type, set[str]]) -> dict[tuple[type, str], tuple[type, str]]:
    """(section class, field) -> (settings class, field) of each config key declared on a
    settings field."""
    return {
        (cls, field.name): field.metadata[FEEDS]
        for cls in found
        for field in attrs.fields(cls)
        if FEEDS in field.metadata
    }


def homes_of(cls: type) -> set[Path]:
    """The files whose reads of ``cls``'s fields do not count."""
    home = declared_in(cls)
    return CONFIG_FILES if home in CONFIG_FILES else {home}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(UNIRL.parent).with_suffix("").parts)


def helper_reads(path: Path, visitor_args: tuple) -> dict[str, set[tuple[type, str]]]:
    """Reads in the public top-level functions of a declaring module (``norm_length(cfg)`` of
    the config module): they count where another module imports and calls the function."""
    helpers = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            visitor = _Reads(*visitor_args)
            visitor.visit(node)
            helpers[node.name] = visitor.reads
    return helpers


class ImportsAndCalls:
    """What a module imports by name (``from m import f as g``) and the plain names it calls,
    from one walk of its tree (a walk per declaring module took most of the test's time)."""

    def __init__(self, tree: ast.AST) -> None:
        self.imports: dict[str, list[ast.alias]] = defaultdict(list)
        self.calls: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                self.imports[node.module].extend(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                self.calls.add(node.func.id)


def called_helpers(found: ImportsAndCalls, module: str, helpers: dict[str, set]) -> set[str]:
    """Names (as `module` defines them) of `module`'s helpers that the scanned module imports
    from it and calls, under their own name or an ``as`` name."""
    return {
        alias.name
        for alias in found.imports.get(module, ())
        if alias.name in helpers and (alias.asname or alias.name) in found.calls
    }


def unread_keys(root: Path = UNIRL) -> list[str]:
    """``section.field`` of every field read nowhere outside the module declaring its class."""
    found = sections()
    by_access: dict[str, set[type]] = defaultdict(set)
    for cls, names in found.items():
        for name in names:
            by_access[name].add(cls)
    # A key declared on a settings field (`unirl.core.config.sections.feeds`) is read by the
    # settings builder for every key alike; it counts as read where its settings field is.
    fed = fed_settings(found)
    for settings_cls in {settings_cls for settings_cls, _ in fed.values()}:
        by_access[SETTINGS_ACCESS[settings_cls.__name__]].add(settings_cls)
    by_class_name = {cls.__name__: cls for cls in found} | {
        settings_cls.__name__: settings_cls for settings_cls, _ in fed.values()
    }
    reads: dict[tuple[type, str], set[Path]] = defaultdict(set)
    files = sorted(root.rglob("*.py"))
    assert len(files) > 50, f"no source found under {root}"
    homes = {declared_in(cls) for cls in found}
    helpers = {module_name(h): helper_reads(h, (by_access, by_class_name)) for h in homes}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        visitor = _Reads(by_access, by_class_name)
        visitor.visit(tree)
        for read in visitor.reads:
            reads[read].add(path.resolve())
        imports_and_calls = ImportsAndCalls(tree)
        for module, module_helpers in helpers.items():
            for name in called_helpers(imports_and_calls, module, module_helpers):
                for read in module_helpers[name]:
                    reads[read].add(path.resolve())
    unread = []
    for cls, names in found.items():
        for field in section_fields(cls):
            if (cls, field) in fed:
                settings_cls, settings_field = fed[(cls, field)]
                if (
                    reads[(settings_cls, settings_field)]
                    - {declared_in(settings_cls)}
                    - CONFIG_FILES
                ):
                    continue
            if not reads[(cls, field)] - homes_of(cls):
                unread.append(f"{cls.__name__}.{field} ({sorted(names)[0]}.{field})")
    return sorted(unread)


def test_every_config_key_is_read_outside_the_config_module():
    unread = unread_keys()
    assert unread == [], (
        f"config keys read nowhere outside their config module: {unread}; a key must change "
        "what the run does (build the feature) or be removed"
    )


def test_the_scan_sees_each_way_a_section_is_reached():
    """The scan against small hand-written modules: each access style counts, a bare field name
    read on something else does not (so a dead key cannot hide behind a common name)."""
    found = sections()
    by_access: dict[str, set[type]] = defaultdict(set)
    for cls, names in found.items():
        for name in names:
            by_access[name].add(cls)
    by_class_name = {cls.__name__: cls for cls in found}
    source = """
def direct(cfg):
    return cfg.algorithm.clip_low, self.cfg.parallel.tp
def aliased(cfg):
    a, p = cfg.algorithm, cfg.parallel
    kl = a.kl_loss
    return a.clip_high, p.cp, kl.coef
def annotated(model: "ModelConfig", other):
    return model.dtype, other.init_seed
class Owner:
    def __init__(self, cfg):
        self.options = cfg.backend_options
    def use(self):
        return self.options.attention
def unrelated(thing):
    return thing.lr, thing.max_seq_len
"""
    visitor = _Reads(by_access, by_class_name)
    visitor.visit(ast.parse(source))
    names = {(cls.__name__, field) for cls, field in visitor.reads}
    from unirl.core.config.run_config import AlgorithmConfig, KLConfig, ModelConfig, ParallelConfig

    for cls, field in [
        (AlgorithmConfig, "clip_low"),
        (ParallelConfig, "tp"),
        (AlgorithmConfig, "clip_high"),
        (ParallelConfig, "cp"),
        (KLConfig, "coef"),
        (ModelConfig, "dtype"),
    ]:
        assert (cls.__name__, field) in names, (cls.__name__, field)
    assert ("MegatronOptions", "attention") in names
    for field in ("lr", "max_seq_len", "init_seed"):
        assert not any(f == field for _, f in names), field
