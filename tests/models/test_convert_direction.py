"""models/convert.py (the library a running world imports) and models/convert_megatron.py (the conversions as
programs, which start a world) depend one way: the programs on the library, never back, lazily or not."""
import ast

from tests.dist_utils import REPO


def _names_of_our_modules(path) -> set[str]:
    """Every module of ours a file names: in import statements (anywhere: lazy ones too) or in strings."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {n for n in names if n.startswith("megatron_searchr1.")}


def test_the_library_never_imports_the_programs():
    models = REPO / "megatron_searchr1" / "models"
    assert not {n for n in _names_of_our_modules(models / "convert.py") if "convert_megatron" in n}
    assert "megatron_searchr1.models.convert" in _names_of_our_modules(models / "convert_megatron.py")


def test_the_programs_import_from_where_users_import_them():
    """The README's public names (`from megatron_searchr1.models import hf_to_megatron`) are the programs'."""
    import megatron_searchr1.models as models
    from megatron_searchr1.models import convert_megatron

    assert models.hf_to_megatron is convert_megatron.hf_to_megatron
    assert models.megatron_to_hf is convert_megatron.megatron_to_hf
