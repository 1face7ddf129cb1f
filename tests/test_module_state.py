"""module_state: a module synced again gives state_dict()'s keys and tensors without
state_dict(), or says it cannot (then broadcast_state calls state_dict() as before).

Whatever is done to the module between two calls, lookup() must return exactly what
`module.state_dict(keep_vars=True)` returns then (the same keys in the same order, the
same tensor objects), or None; and for a module left alone, or one whose submodule was
swapped for another of the same shape, it must not return None (else it saves nothing).
"""
import pytest

from tests.harness import run_ranks

torch = pytest.importorskip("torch")
nn = torch.nn

from accord import module_state  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _net():
    shared = nn.Linear(3, 3)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), shared),
        nn.BatchNorm1d(5),                      # buffers, num_batches_tracked among them
        nn.ModuleDict({"a": nn.Linear(5, 2), "b": shared}),   # `shared` saved twice
        nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))


def _same_as_state_dict(m):
    got = module_state.lookup(m)
    sd = m.state_dict(keep_vars=True)
    if got is None:
        return None
    keys, vals = got
    assert keys == list(sd), (keys, list(sd))
    assert len(vals) == len(sd) and all(a is b for a, b in zip(vals, sd.values()))
    return True


def _learnt(m):
    module_state.remember(m, m.state_dict(keep_vars=True))
    return m


def test_a_module_left_alone_gives_its_state_dict():
    m = _learnt(_net())
    assert _same_as_state_dict(m) is True
    assert _same_as_state_dict(m) is True           # and again


def test_a_submodule_swapped_for_one_of_the_same_shape_gives_the_new_tensors():
    m = _learnt(_net())
    m[0][0] = nn.Linear(4, 5)
    m[3][0].weight = nn.Parameter(torch.zeros(2, 2))
    assert _same_as_state_dict(m) is True


def _changes():
    """(name, change(m)): each something state_dict() would show, or a reason it must be
    called."""
    def hook(m):
        m[1].register_state_dict_pre_hook(lambda *a: None)

    def post_hook(m):
        m[2]["a"].register_state_dict_post_hook(lambda *a: None)

    def none_param(m):
        m[0][0].bias = None

    def none_buffer(m):
        m[1].running_mean = None

    def new_buffer(m):
        m[3][1].register_buffer("count", torch.zeros(1))

    def non_persistent(m):
        m[1]._non_persistent_buffers_set.add("running_var")

    def new_child(m):
        m[3].append(nn.Linear(2, 2))

    def removed_child(m):
        del m[2]["a"]

    def other_class(m):
        m[0][1] = nn.Linear(5, 5)

    def renamed(m):
        p = m[0][0]._parameters
        p["w"] = p.pop("weight")

    def reordered(m):
        p = m[0][0]._parameters
        p["weight"] = p.pop("weight")            # now after the bias

    def extra_state(m):
        class WithExtra(nn.Linear):
            def get_extra_state(self):
                return {"tag": 1}
        m[2]["a"] = WithExtra(5, 2)

    def own_save(m):
        class Saving(nn.Linear):
            def _save_to_state_dict(self, destination, prefix, keep_vars):
                destination[prefix + "only"] = self.weight
        m[2]["a"] = Saving(5, 2)

    def instance_override(m):
        m[3][0].state_dict = lambda *a, **k: {}

    return [(f.__name__, f) for f in (hook, post_hook, none_param, none_buffer, new_buffer,
                                      non_persistent, new_child, removed_child, other_class,
                                      renamed, reordered, extra_state, own_save,
                                      instance_override)]


@pytest.mark.parametrize("name,change", _changes(), ids=[n for n, _ in _changes()])
def test_a_changed_module_gives_its_state_dict_or_nothing(name, change):
    m = _learnt(_net())
    change(m)
    got = _same_as_state_dict(m)
    # every change here alters what state_dict() gives or how it is made: the walk
    # must notice (None), never answer with the old shape
    assert got is None, name


def test_a_module_that_is_not_plain_is_not_remembered():
    class Saving(nn.Linear):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            destination[prefix + "only"] = self.weight
    m = nn.Sequential(nn.Linear(2, 2), Saving(2, 2))
    _learnt(m)
    assert module_state.lookup(m) is None


def _with_nones():
    # parameters, buffers and a child registered as None: state_dict() leaves them out
    m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.BatchNorm1d(3, track_running_stats=False),
                      nn.Linear(3, 3))
    m[2].register_buffer("gone", None)
    m.register_module("empty", None)
    return m


def test_a_module_with_unset_entries_gives_its_state_dict():
    m = _learnt(_with_nones())
    assert _same_as_state_dict(m) is True
    m[2].weight = nn.Parameter(torch.zeros(3, 3))   # another tensor in the same place
    assert _same_as_state_dict(m) is True


@pytest.mark.parametrize("change", [
    lambda m: setattr(m[0], "bias", nn.Parameter(torch.zeros(3))),     # a key more
    lambda m: m[2].register_buffer("gone", torch.zeros(1)),             # a key more
    lambda m: setattr(m[2], "bias", None),                              # a key fewer
    lambda m: m.register_module("empty", nn.Linear(1, 1)),              # keys more
    # one set and another unset: as many as before, other keys
    lambda m: (setattr(m[0], "bias", nn.Parameter(torch.zeros(3))),
               setattr(m[0], "weight", None)),
], ids=["bias-set", "buffer-set", "bias-unset", "child-set", "swapped-unset"])
def test_a_module_whose_unset_entries_change_gives_nothing(change):
    m = _learnt(_with_nones())
    change(m)
    assert _same_as_state_dict(m) is None


def test_nothing_is_kept_alive():
    import gc
    import weakref
    m = _learnt(_net())
    assert module_state.lookup(m) is not None
    r = weakref.ref(m)
    w = weakref.ref(m[0][0].weight)
    del m
    gc.collect()
    assert r() is None and w() is None


def _changing_module(rank, world):
    """broadcast_state(model) synced again while the model changes between calls on one
    rank or all: the bytes every rank ends with, and what each call raised."""
    import accord
    from accord.state import StateMismatch
    torch.manual_seed(rank)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
                          for _ in range(5)])
    seen = []

    def sync(tag):
        try:
            with torch.no_grad():
                accord.broadcast_state(net)
            seen.append((tag, None))
        except StateMismatch as e:
            seen.append((tag, str(e).splitlines()[1].strip()))
        flat = torch.cat([v.detach().flatten() for v in net.state_dict().values()])
        if seen[-1][1] is None:                 # synced: does every rank hold the same?
            every = [torch.zeros_like(flat) for _ in range(world)]
            accord.all_gather(every, flat)
            seen[-1] = seen[-1] + (all(torch.equal(every[0], x) for x in every),)

    for _ in range(4):
        sync("again")
    net[2][0] = nn.Linear(8, 8)                 # every rank: a new submodule, new tensors
    if rank == 0:
        with torch.no_grad():
            net[2][0].weight.fill_(7.0)
    sync("swapped")
    ok7 = bool((net[2][0].weight == 7).all())
    if rank == world - 1:
        net[1][2].bias = None                   # one rank: a key fewer
    sync("none")
    if rank == world - 1:
        net[1][2].bias = nn.Parameter(torch.zeros(8))
    sync("restored")
    if rank == 0:
        net[4][1].register_buffer("extra", torch.ones(2))
    sync("buffer on the root only")
    if rank != 0:
        net[4][1].register_buffer("extra", torch.zeros(2))
    for _ in range(3):
        sync("buffer everywhere")
    return seen, ok7, bool((net[4][1].extra == 1).all())


def test_broadcast_state_of_a_module_that_changes_between_calls():
    last = 1
    for rank, (seen, ok7, extra) in enumerate(run_ranks(2, _changing_module)):
        tags = [t[0] for t in seen]
        assert tags == ["again"] * 4 + ["swapped", "none", "restored",
                                        "buffer on the root only"] + \
            ["buffer everywhere"] * 3, tags
        for t in seen:
            if t[0] in ("none", "buffer on the root only"):
                assert t[1] is not None, t      # a StateMismatch on every rank
            else:
                assert t[1] is None and t[2] is True, (rank, t)
        assert ok7 and extra, rank
        assert "['1.2.bias']: missing on rank %d" % last in dict(
            (t[0], t[1]) for t in seen)["none"]


def test_the_benchmark_times_the_module_and_the_dict():
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "accord", "run", "-n", "2",
                          os.path.join(root, "benchmarks", "bench_module_state.py")],
                         capture_output=True, text=True, timeout=50, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    got = re.search(r"\{'module': \[([\d.]+), ([\d.]+)\], 'dict': \[([\d.]+), ([\d.]+)\]\}",
                    out.stdout)
    assert got and all(float(x) > 0 for x in got.groups()), out.stdout
