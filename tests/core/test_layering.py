import ast
from pathlib import Path

import autodeploy

CORE = Path(autodeploy.__file__).parent


def test_core_never_imports_serve_at_module_level():
    offenders = []
    for path in CORE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only: lazy imports inside functions are allowed
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}"]
            if any("serve" in n.split(".") for n in names):
                offenders.append(f"{path.relative_to(CORE)}: {names}")
    assert offenders == []
