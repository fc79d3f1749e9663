"""The package structure: every module imports on its own, and the packages import in one
direction only, formats <- kernels <- runtime <- converter <- cli (the converter may run the
runtime to verify its output; the runtime never imports the converter)."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("formats", "kernels", "runtime", "converter", "cli")     # each may import those before it


def _modules():
    """{module name: file} of every pinfer module under the packages' folders."""
    out = {}
    for pkg in ORDER:
        folder = ROOT / "pinfer" / pkg if pkg == "kernels" else ROOT / pkg
        for f in sorted(folder.rglob("*.py")):
            parts = [pkg, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["pinfer." + ".".join(parts)] = f
    return out


def _imported_packages(name, path):
    """The pinfer packages module `name` imports, anywhere in it (lazy imports count too)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
                targets = [".".join(base + ([node.module] if node.module else []))]
            else:
                targets = [node.module or ""]
        else:
            continue
        for t in targets:
            parts = t.split(".")
            if parts[0] == "pinfer" and len(parts) > 1 and parts[1] in ORDER:
                found.add(parts[1])
    return found


def test_packages_import_in_one_direction():
    wrong = []
    for name, path in _modules().items():
        own = name.split(".")[1]
        for pkg in _imported_packages(name, path):
            if ORDER.index(pkg) > ORDER.index(own):
                wrong.append(f"{path.relative_to(ROOT)} imports pinfer.{pkg}")
    assert not wrong, "imports against formats <- kernels <- runtime <- converter <- cli: " + "; ".join(wrong)


def test_the_direction_check_sees_a_cycle(tmp_path):
    """The check above can fail: a runtime module importing the converter, relatively or not."""
    f = tmp_path / "x.py"
    for code in ("from pinfer.converter.backend.report import write_report\n", "def f():\n    from ..converter import passes\n"):
        f.write_text(code)
        assert _imported_packages("pinfer.runtime.x", f) == {"converter"}


def test_every_module_imports_on_its_own():
    """Each module in a process where no other pinfer module was imported first, so that a
    module leaning on another's import side effects fails here."""
    names = sorted(_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    for m in [m for m in sys.modules if m.startswith('pinfer')]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            f"print(len({names!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) == len(names) > 40


def test_functions_classes_and_the_model_stay_small():
    """A newcomer reads a function on one screen and a class as one job: no function over 60
    lines unless its docstring says why ("long because"), no class over 15 methods, and
    runtime/model.py at most 250 lines."""
    too_long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60 and "long because" not in (ast.get_docstring(node) or ""):
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
                if methods > 15:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name} ({methods} methods)")
    assert not too_long, "; ".join(too_long)
    assert len((ROOT / "runtime" / "model.py").read_text().splitlines()) <= 250


# a Model's layers (plan.Layer), and the per-layer lists they replaced: assigned by the planner alone
LAYER_LISTS = {"layers", "downs", "attn", "native", "ffns", "rules"}
PLANNER = ROOT / "runtime" / "plan.py"


def _layer_list_assignments(path):
    """(line, target) of each change in `path` to x.<list> or x.<list>[...] for a Model's per-layer
    lists (self.<list> too in runtime/model.py, the Model's own module): an assignment (also inside
    a tuple), an augmented one, a del, a mutating call (append, extend, insert, pop, clear, remove)
    or setattr(x, "<list>", ...)."""
    model = path.name == "model.py" and path.parent.name == "runtime"

    def hit(t):
        t = t.value if isinstance(t, ast.Subscript) else t
        return isinstance(t, ast.Attribute) and t.attr in LAYER_LISTS and (model or not (
            isinstance(t.value, ast.Name) and t.value.id == "self")) and t

    def flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            else:
                yield t.value if isinstance(t, ast.Starred) else t
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "append", "extend", "insert", "pop", "clear", "remove"):
            targets = [node.func.value]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in LAYER_LISTS:
            out.append((node.lineno, f"setattr(..., {node.args[1].value!r})"))
        for t in flat(targets):
            if (a := hit(t)):
                out.append((node.lineno, ast.unparse(a)))
    return out


def test_only_the_planner_changes_a_layers_path():
    """One function decides a layer's path (plan.decide) and one module makes and changes the
    layers (runtime/plan.py): no other module of the product assigns a model's layers, Model's own
    module included. A Layer is frozen, so a change is a new Layer put in place by the planner."""
    files = [f for pkg in ("runtime", "converter", "cli", "formats") for f in (ROOT / pkg).rglob("*.py")]
    files += list((ROOT / "pinfer" / "kernels").rglob("*.py"))
    found = {str(f.relative_to(ROOT)): hits for f in files if f != PLANNER and (hits := _layer_list_assignments(f))}
    assert not found, found
    from pinfer.runtime.plan import Layer
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layer().ffn = None


def test_the_planner_check_sees_an_assignment(tmp_path):
    """The check above finds what it looks for (a model's list assigned whole, by index, augmented)."""
    f = tmp_path / "m.py"
    f.write_text("def f(model, i):\n    model.ffns[i] = None\n    model.layers = []\n    model.rules += []\n"
                 "    self.ffns = []\n    a.b = 1\n    x, (model.downs, *model.attn) = 1, (2, 3)\n"
                 "    model.layers.append(1)\n    del model.native[0]\n    setattr(model, 'layers', [])\n"
                 "    model.other.append(1)\n")
    assert sorted(t for _, t in _layer_list_assignments(f)) == sorted([
        "model.ffns", "model.layers", "model.rules", "model.downs", "model.attn", "model.layers", "model.native",
        "setattr(..., 'layers')"])
    (tmp_path / "runtime").mkdir()
    g = tmp_path / "runtime" / "model.py"
    g.write_text("class Model:\n    def f(self):\n        self.layers = []\n")
    assert [t for _, t in _layer_list_assignments(g)] == ["self.layers"]
