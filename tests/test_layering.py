"""The import graph is the design: every import points down the layers, none takes a private name.

Layers, bottom up: values (errors, seams, rank arithmetic, torch compatibility,
settings, groups), then agreement and memory, then the CPU-group framing, then
the object wire format, then the features, then the public surface, then the
command line. Within the features only the edges listed in ``FEATURE_EDGES``
are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "pdist"

LAYERS = {
    "_errors": 0,
    "_seams": 0,
    "_layout": 0,
    "_plain": 0,
    "_compat": 1,
    "_env": 1,
    "_inflight": 2,
    "_rooted": 2,
    "_group": 3,
    "_buffers": 4,
    "_departures": 4,
    "_agree": 5,
    "_check": 6,
    "_wire": 6,
    "_transfer": 7,  # the one transfer path: plans, the prepare status, moves
    "_serialize": 7,
    "_payload": 8,
    **dict.fromkeys(
        [
            "_objects",
            "_gathers",
            "_p2p",
            "_collectives",
            "_launches",
            "_collate",
            "_training",
            "_mq",
            "_topology",
            "_subgroups",
            "_guard",
            "_stall",
            "_stall_report",
            "_context",
            "_ranks",
            "_sequence",
            "_graph",
            "_uneven",
            "_moe",
            "_links",
            "_weights",
            "_weight_tensors",
            "_replicas",
        ],
        9,
    ),
    "__init__": 10,
    "testing": 10,
    "__main__": 11,
    "cli": 11,
}

# Features built on other features (each edge is a reason, not an accident).
FEATURE_EDGES = {
    ("_gathers", "_objects"),  # the defaults of the object transports
    ("_p2p", "_objects"),  # the defaults, and the tensor-dict check
    ("_training", "_weights"),  # sync_model_states moves tensors as broadcast_weights does
    ("_weights", "_weight_tensors"),  # its tensors: DTensors gathered, bytes, fillable into
    ("_mq", "_topology"),  # a queue needs every rank on one host
    ("_sequence", "_collectives"),  # Ulysses attention is two all_to_all_4d
    ("_collectives", "_launches"),  # the runner and how each collective runs
    ("_collectives", "_uneven"),  # all_gather / reduce_scatter with sizes= are all-to-alls
    ("_uneven", "_launches"),  # an AsyncCollectiveTensor input is waited for as everywhere
    ("_moe", "_uneven"),  # routing is two row all-to-alls and one counts exchange
    ("_sequence", "_uneven"),  # uneven Ulysses: the sizes exchange and row all-to-alls
    ("_links", "_context"),  # a link resolves its device as distributed() does
    ("_context", "_subgroups"),
    ("_context", "_topology"),
    ("_context", "_guard"),
    ("_context", "_stall"),
    ("_stall", "_guard"),  # a stall exit ends the process as the start-up guard does
    ("_stall", "_stall_report"),  # the watch and its pure formatter
    ("_replicas", "_objects"),  # the replica's ranks agree on its token in one broadcast
    ("_replicas", "_p2p"),  # healing: each rank's state from its counterpart
    ("__main__", "cli"),  # python -m pdist runs the command line
}


# Staging memory belongs to the wire format and the code that moves bytes: a feature that
# needs memory for a result allocates it as torch would.
BUFFER_USERS = {"_serialize", "_payload", "_agree", "_wire", "_transfer", "_objects", "_gathers"}
BUFFER_USERS |= {"_p2p"}
BUFFER_USERS |= {"_collate", "_mq"}
BUFFER_USERS |= {"_weights", "_weight_tensors"}  # a transport: its buckets are staging


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return "cli" if rel.parts[0] == "cli" else rel.stem


def _target(name: str) -> str:
    """The layer name of pdist module ``name`` (a name of ``pdist/__init__`` is the package)."""
    return name if name in LAYERS or name == "cli" else "__init__"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(imported pdist module, names taken from it)`` for every import in ``path``."""
    in_cli = _module(path) == "cli"
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        names = [a.name for a in node.names]
        if node.level == 0:
            if not (node.module or "").startswith("pdist"):
                continue
            parts = (node.module or "").split(".")
            package_level = len(parts) == 1
        else:
            up = node.level - (1 if in_cli else 0)  # what the dots reach, from pdist/
            parts = ["pdist"] if up <= 1 else []
            if in_cli and up == 0:
                parts = ["pdist", "cli"]
            parts += (node.module or "").split(".") if node.module else []
            package_level = len(parts) == 1
        if package_level:  # from pdist import _x / from . import _x, name
            found += [(_target(n), []) for n in names]
        else:
            found.append((_target(parts[1]), names))
    return found


FILES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_imports_point_down_the_layers(path):
    """Each pdist import goes to a lower layer, or along an edge listed for the features."""
    me = _module(path)
    assert me in LAYERS, f"{me} has no layer: add it to LAYERS (and to DESIGN's layout)"
    for target, _ in _imports(path):
        target = "cli" if target == "cli" else target
        if target == me:
            continue
        assert target in LAYERS, (me, target)
        down = LAYERS[target] < LAYERS[me]
        assert down or (me, target) in FEATURE_EDGES, f"{me} imports {target}"


def test_buffers_serve_the_format_and_the_transports_only():
    """Only the wire format and the transports import ``_buffers``."""
    users = {_module(p) for p in FILES if any(t == "_buffers" for t, _ in _imports(p))}
    assert users <= BUFFER_USERS, sorted(users - BUFFER_USERS)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_no_module_takes_another_modules_private_name(path):
    """``from ._x import _name`` would tie one module to another's internals."""
    for target, names in _imports(path):
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert not private, f"{path.name} takes {private} from {target}"


def test_only_agree_raises_a_peers_failure():
    """Failing together is ``_agree``'s: no other module turns a peer's marker into an error."""
    takers = {
        _module(p)
        for p in FILES
        for target, names in _imports(p)
        if target == "_errors" and {"failure", "decode_marker"} & set(names)
    }
    assert takers <= {"_agree"}, sorted(takers)


def test_no_private_name_in_two_modules():
    """A private function or class has one home: two ``_plan`` in two modules are two copies."""
    homes: dict[str, list[str]] = {}
    for path in FILES:
        for node in ast.parse(path.read_text()).body:
            name = getattr(node, "name", "")
            private = name.startswith("_") and not name.startswith("__")
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and private:
                homes.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert not {n: h for n, h in homes.items() if len(h) > 1}


def test_no_module_over_600_lines():
    """Small modules: one concern each."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in FILES
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long
