"""Every public name is documented and typed: what `help()` and the API reference show."""
import inspect

import pytest

import accord

pytestmark = pytest.mark.timeout(30)

NAMES = sorted(accord.__all__)


# Classes whose methods a user calls; a ProcessGroup is only passed around (its
# methods serve accord's own modules), and the errors are only caught.
CALLED = ("Work", "coalescing")


def _functions(obj):
    """obj itself if a function; a class's own public methods (and __init__) otherwise."""
    if inspect.isfunction(obj):
        return [obj]
    if obj.__name__ not in CALLED:
        return []
    return [f for name, f in vars(obj).items()
            if inspect.isfunction(f) and (not name.startswith("_") or name == "__init__")
            and f.__qualname__.startswith(obj.__qualname__ + ".")]


@pytest.mark.parametrize("name", NAMES)
def test_public_name_has_a_docstring(name):
    obj = getattr(accord, name)
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 8, f"accord.{name} has no real docstring: {doc!r}"


@pytest.mark.parametrize("name", NAMES)
def test_public_name_is_annotated(name):
    obj = getattr(accord, name)
    functions = _functions(obj)
    assert functions or inspect.isclass(obj) and obj.__name__ not in CALLED, name
    for f in functions:
        sig = inspect.signature(f)
        missing = [p.name for p in sig.parameters.values()
                   if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
        assert not missing, f"accord.{name}: {f.__qualname__} lacks annotations for {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, \
            f"accord.{name}: {f.__qualname__} has no return annotation"


def test_functions_document_their_errors():
    for name in NAMES:
        obj = getattr(accord, name)
        if inspect.isfunction(obj) and name not in ("is_initialized", "get_process_group_ranks",
                                                     "isend", "irecv"):
            assert "Raises:" in inspect.getdoc(obj), f"accord.{name} does not say what it raises"


def test_the_package_is_marked_typed():
    from importlib import resources
    assert resources.files("accord").joinpath("py.typed").is_file()


def test_version_is_the_package_metadata():
    from importlib.metadata import version
    assert accord.__version__ == version("accord")
