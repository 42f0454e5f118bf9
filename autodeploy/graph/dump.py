"""Graph dumps (``AUTODEPLOY_DUMP_DIR`` / ``--dump-graphs``): one readable file per pass."""

from __future__ import annotations

from pathlib import Path

from torch import fx


def dump_graph(gm: fx.GraphModule, directory: Path, index: int, name: str) -> Path:
    """Write the graph's Python code and a node table with provenance; returns the file path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{index:02d}_{name}.txt"
    lines = [gm.code, "", "# node | op | target | shape | provenance"]
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if hasattr(val, "shape") else ""
        provenance = node.meta.get("autodeploy_provenance", "")
        lines.append(f"# {node.name} | {node.op} | {node.target} | {shape} | {provenance}")
    path.write_text("\n".join(lines))
    return path
