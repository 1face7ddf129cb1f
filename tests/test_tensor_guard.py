"""accord/tensor_guard.py: torch's compiled guard as the first check that a repeated
broadcast_state's tensors are unchanged. It may only speed the check up: whenever it
says the tensors hold, flat_state's own comparison must say so too, and every change
that comparison catches must make the guard say no (or leave the answer to it)."""
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accord import flat_state, tensor_guard  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _tensors():
    return [torch.zeros(1000), torch.nn.Parameter(torch.ones(3, 4)),
            torch.arange(10, dtype=torch.int64), torch.zeros(2, 3, 4, dtype=torch.float16)]


def _entry_like(vals):
    """An object valid_for runs on, as remember() fills it for these tensors."""
    e = flat_state._Entry()
    e.keys = [f"k{i}" for i in range(len(vals))]
    e.refs = [weakref.ref(v) for v in vals]
    e.metas = flat_state._metas(vals)
    e.guard = tensor_guard.make(vals)
    return e


def test_a_guard_is_made_for_torch_tensors_only():
    assert tensor_guard.make(_tensors()) is not None
    assert tensor_guard.make([]) is None
    assert tensor_guard.make([np.zeros(3)]) is None
    assert tensor_guard.make([torch.zeros(3), np.zeros(3)]) is None


def test_the_same_tensors_and_views_of_the_same_memory_hold():
    vals = _tensors()
    e = _entry_like(vals)
    assert tensor_guard.holds(e.guard, vals)
    plain = [v for v in vals if not v.requires_grad]
    g = tensor_guard.make(plain)
    same = [v.view(v.shape) for v in plain]     # other objects, the same memory
    assert tensor_guard.holds(g, same)
    # a detached view of a parameter does not require grad: the guard leaves the answer
    # to the Python check, which accepts it (the same bytes)
    detached = [v.detach().view(v.shape) for v in vals]
    assert not tensor_guard.holds(e.guard, detached)
    assert e.valid_for(e.keys, detached)


def _changes():
    def resize(v):
        v[0].resize_(10)

    def data(v):
        v[1].data = torch.ones(3, 4)

    def transpose(v):
        v[1].data = v[1].data.t()

    def unsqueeze(v):
        v[2].unsqueeze_(0)

    def set_(v):
        v[0].set_(torch.zeros(1000))

    def dtype(v):
        v[0].data = v[0].data.view(torch.int32)

    def swap(v):
        v[3] = torch.zeros(2, 3, 4, dtype=torch.float16)

    def grad_off(v):
        v[1].requires_grad_(False)

    return [resize, data, transpose, unsqueeze, set_, dtype, swap, grad_off]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
def test_every_change_makes_the_guard_say_no_and_the_answer_is_the_python_checks(change):
    vals = _tensors()
    e = _entry_like(vals)
    assert e.valid_for(e.keys, vals)
    change(vals)
    assert not tensor_guard.holds(e.guard, vals)
    python_says = flat_state._metas(vals) == e.metas
    assert e.valid_for(e.keys, vals) == python_says
    # requires_grad is the guard's concern alone: the bytes are where they were
    assert python_says == (change.__name__ == "grad_off")


def test_a_call_under_inference_mode_falls_back_to_the_python_check():
    vals = _tensors()
    e = _entry_like(vals)
    with torch.inference_mode():
        assert not tensor_guard.holds(e.guard, vals)
        assert e.valid_for(e.keys, vals)


def test_wrong_lists_never_hold():
    vals = _tensors()
    g = tensor_guard.make(vals)
    assert not tensor_guard.holds(g, vals[:-1])
    assert not tensor_guard.holds(g, vals + [torch.zeros(1)])
    assert not tensor_guard.holds(g, vals[:-1] + [3])


def test_the_guard_keeps_no_tensor_alive():
    vals = _tensors()
    g = tensor_guard.make(vals)
    refs = [weakref.ref(v) for v in vals]
    del vals
    gc.collect()
    assert g is not None and all(r() is None for r in refs)


def test_without_torchs_guard_the_python_check_alone_answers(monkeypatch):
    monkeypatch.setattr(tensor_guard, "_guard_class", lambda: None)
    vals = _tensors()
    e = _entry_like(vals)
    assert e.guard is None and e.valid_for(e.keys, vals)
    vals[0].resize_(10)
    assert not e.valid_for(e.keys, vals)
