"""scatter, scatter_kwargs and gather against plain torch.split / torch.cat references."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, cast

import optree
import pytest
import torch
import torch.utils._pytree

import fdp
from tests.helpers import CPU, Pair, count_copies, fake, label, leaves, plain, tree_allclose


def batch_corpus() -> dict[str, Any]:
    """Inputs trees with tensor leaves of batch 7 and shared non-tensor leaves."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=g)
    return {
        "tensor": x,
        "args": (x, torch.arange(7), "tag", None, 2.5),
        "nested": ({"a": [x, (x[:, 0], None)], "b": Pair(torch.ones(7, 1, 2), "s")},),
        "mixed_dtypes": (x.double(), torch.arange(7, dtype=torch.int64), x > 0),
        "ordered": (collections.OrderedDict([("z", x), ("a", x * 2)]),),
    }


def expected_sizes(batch: int, n: int) -> list[int]:
    n = max(1, min(batch, n))
    return [len(c) for c in torch.arange(batch).tensor_split(n)]


@pytest.mark.parametrize("n_devices", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(batch_corpus()))
def test_scatter_matches_split_and_gather_inverts_it(name: str, n_devices: int) -> None:
    inputs = batch_corpus()[name]
    chunks = fdp.scatter(inputs, ["cpu"] * n_devices)
    sizes = expected_sizes(7, n_devices)
    assert len(chunks) == len(sizes)
    args = inputs if type(inputs) is tuple else (inputs,)
    start = 0
    for chunk, size in zip(chunks, sizes, strict=True):
        expected = optree.tree_map(
            lambda x, s=start, n=size: x[s : s + n] if isinstance(x, torch.Tensor) else x,
            cast(Any, args),
            none_is_leaf=True,
        )
        tree_allclose(chunk, expected)
        # Non-tensor leaves are shared, not copied.
        for got, orig in zip(leaves(chunk), leaves(args), strict=True):
            if not isinstance(orig, torch.Tensor):
                assert got is orig
        start += size
    tree_allclose(fdp.gather(chunks, "cpu"), args)


def test_scatter_and_gather_are_differentiable() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(6, 4)
    chunks = fdp.scatter((x,), ["cpu", "cpu", "cpu"])
    out = fdp.gather([(c[0] * 2,) for c in chunks], "cpu")
    (grad,) = torch.autograd.grad((out[0] * weight).sum(), [x])
    torch.testing.assert_close(grad, 2 * weight)


def test_scatter_along_other_dims() -> None:
    x = torch.randn(2, 5, 3)
    for dim in (1, -2):
        chunks = fdp.scatter(x, ["cpu", "cpu"], dim=dim)
        torch.testing.assert_close(chunks[0][0], x[:, :3])
        torch.testing.assert_close(chunks[1][0], x[:, 3:])
        torch.testing.assert_close(fdp.gather([c[0] for c in chunks], -1, dim=dim), x)


def test_small_batch_uses_fewer_devices() -> None:
    chunks = fdp.scatter(torch.arange(2), ["cpu"] * 4)
    assert [c[0].tolist() for c in chunks] == [[0], [1]]
    # An empty batch still gives one (empty) chunk, so fn runs once.
    (only,) = fdp.scatter(torch.zeros(0, 3), ["cpu"] * 4)
    assert only[0].shape == (0, 3)


def test_inputs_without_tensors_make_one_call() -> None:
    # Nothing to split: one chunk, so fn runs once (as DataParallel with no inputs).
    assert fdp.scatter((1, "a"), ["cpu"] * 3) == [(1, "a")]
    calls: list[Any] = []

    def fn(p: torch.Tensor) -> torch.Tensor:
        calls.append(p)
        return p * 2

    w = torch.ones(3, requires_grad=True)
    out = fdp.data_parallel(fn, w, (), devices=["cpu"] * 3)
    torch.testing.assert_close(out, w * 2)  # not three copies concatenated
    torch.autograd.backward(out.sum())
    torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
    assert len(calls) == 1


def test_chunk_sizes() -> None:
    x = torch.arange(10)
    chunks = fdp.scatter(x, ["cpu"] * 3, chunk_sizes=[1, 6, 3])
    assert [c[0].tolist() for c in chunks] == [[0], [1, 2, 3, 4, 5, 6], [7, 8, 9]]


@pytest.mark.parametrize(
    ("chunk_sizes", "match"),
    [
        ([5, 5], r"one size per device \(3 devices\); got 2 sizes"),
        ([2, 2, 2], r"summing to the batch size 10; got \[2, 2, 2\] \(sum 6\)"),
        ([0, 5, 5], r"`chunk_sizes\[0\]` expected a positive int; got 0"),
        ("abc", r"`chunk_sizes` expected a sequence of ints"),
    ],
)
def test_bad_chunk_sizes(chunk_sizes: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        fdp.scatter(torch.arange(10), ["cpu"] * 3, chunk_sizes=chunk_sizes)


def test_dim_out_of_range_names_the_leaf() -> None:
    inputs = ({"x": torch.ones(4, 2), "y": [torch.ones(4)]},)
    with pytest.raises(ValueError, match=r"fdp.scatter: `dim` is out of range for leaf ") as err:
        fdp.scatter(inputs, ["cpu", "cpu"], dim=1)
    assert "inputs[0]['y'][0]" in str(err.value)
    assert "expected dim in [-1, 0], got dim=1" in str(err.value)
    with pytest.raises(ValueError, match=r"inputs\[0\].*expected at least one dimension"):
        fdp.scatter(torch.tensor(3.0), ["cpu"])


def test_batch_size_mismatch_names_both_leaves() -> None:
    with pytest.raises(
        ValueError,
        match=r"same size along dim 0; leaf inputs\[0\] has 4, leaf inputs\[1\]\['b'\] has 5",
    ):
        fdp.scatter((torch.ones(4), {"b": torch.ones(5)}), ["cpu", "cpu"])


def test_scatter_kwargs_splits_both_with_one_batch() -> None:
    x, mask = torch.randn(5, 2), torch.arange(5)
    args, kws = fdp.scatter_kwargs((x,), {"mask": mask, "flag": True}, ["cpu", "cpu"])
    assert [a[0].shape[0] for a in args] == [3, 2]
    torch.testing.assert_close(torch.cat([k["mask"] for k in kws]), mask)
    assert all(k["flag"] is True for k in kws)
    with pytest.raises(ValueError, match=r"leaf inputs\[0\] has 5, leaf kwargs\['mask'\] has 4"):
        fdp.scatter_kwargs((x,), {"mask": torch.arange(4)}, ["cpu", "cpu"])
    for not_a_mapping in ([1], [], ()):  # an empty one too: falsy is not "no kwargs"
        with pytest.raises(TypeError, match=r"`kwargs` expected a mapping"):
            fdp.scatter_kwargs((x,), not_a_mapping, ["cpu"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("devices", "error", "match"),
    [
        ([], ValueError, r"`devices` expected at least one device; got an empty sequence"),
        ("cpu", TypeError, r"`devices` expected a sequence of devices"),
        ([True], TypeError, r"`devices\[0\]` expected a torch.device.*got True"),
        (["cpu", "nonsense"], ValueError, r"`devices\[1\]` is not a device: got 'nonsense'"),
        ([-3], ValueError, r"`devices\[0\]` expected a CUDA index >= 0 or -1 for the CPU; got -3"),
    ],
)
def test_bad_devices(devices: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fdp.scatter(torch.ones(2), devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0])
def test_devices_this_build_lacks_are_refused(device: Any) -> None:
    with pytest.raises(
        ValueError,
        match=r"fdp.data_parallel: `devices\[1\]` is cuda(:\d)? but CUDA is not available",
    ):
        fdp.data_parallel(lambda p, x: x, None, torch.ones(2), devices=["cpu", device])
    with pytest.raises(ValueError, match=r"fdp.gather: `output_device` is cuda"):
        fdp.gather([torch.ones(1)], device)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")
def test_mps_is_refused_where_absent() -> None:
    with pytest.raises(ValueError, match=r"`devices\[0\]` is mps but MPS is not available"):
        fdp.scatter(torch.ones(2), ["mps"])


def test_gather_keeps_container_types_and_key_order() -> None:
    def out(i: int) -> Any:
        t = torch.full((2,), float(i))
        return {
            "z": Pair(t, [t, (t, None)]),
            "a": collections.OrderedDict([("k", t)]),
            "const": "same",
        }

    got = fdp.gather([out(0), out(1)], "cpu")
    assert list(got) == ["z", "a", "const"]
    assert isinstance(got["z"], Pair)
    assert isinstance(got["a"], collections.OrderedDict)
    assert optree.tree_structure(got, none_is_leaf=True) == optree.tree_structure(
        out(0), none_is_leaf=True
    )
    torch.testing.assert_close(got["z"].first, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert got["z"].second[1][1] is None


def test_gather_scalars_become_a_vector_with_a_warning() -> None:
    losses = [torch.tensor(1.0, requires_grad=True), torch.tensor(2.0, requires_grad=True)]
    with pytest.warns(UserWarning, match=r"returned as a vector with one entry per replica"):
        got = fdp.gather([{"loss": losses[0]}, {"loss": losses[1]}], -1)
    torch.testing.assert_close(got["loss"], torch.tensor([1.0, 2.0]))
    torch.autograd.backward(got["loss"].sum())
    assert [x.grad for x in losses] == [torch.tensor(1.0), torch.tensor(1.0)]


def test_gather_single_output_on_target_is_not_copied() -> None:
    y = torch.randn(3)
    assert fdp.gather([y], "cpu") is y


@pytest.mark.parametrize("on_target", [(True, False), (False, True), (False, False)])
def test_gather_moves_each_tensor_not_on_the_target(on_target: tuple[bool, bool]) -> None:
    # The meta device stands in for a second device: the join checks only the
    # first tensor's device and leaves the others to torch.cat, which refuses a
    # second device, so the general path must move them.
    outputs = [
        torch.empty(2 + i, 3, device="meta") if there else torch.randn(2 + i, 3)
        for i, there in enumerate(on_target)
    ]
    got = fdp.gather(outputs, "meta")
    expected = torch.cat([t.to("meta") for t in outputs])
    assert (got.device, got.shape, got.dtype) == (expected.device, expected.shape, expected.dtype)


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        (
            [{"a": torch.ones(1)}, {"b": torch.ones(1)}],
            r"replicas returned different structures; replica 1's against replica 0's: "
            r"missing output\['a'\]; unexpected output\['b'\]$",
        ),
        (
            [{"n": 1}, {"n": 2}],
            r"non-tensor leaf output\['n'\] differs between replicas; "
            r"expected \(replica 0\) 1, got \(replica 1\) 2",
        ),
        (
            [[torch.ones(1)], [3]],
            r"leaf output\[0\] is a tensor of shape \(1,\).* in replica 0 but int 3 in replica 1",
        ),
        (
            [(torch.ones(2, 3),), (torch.ones(2, 4),)],
            r"output leaf output\[0\] cannot be joined along dim 0: expected \(replica 0\) shape "
            r"\(2, 3\) in every other dimension, got \(replica 1\) \(2, 4\)",
        ),
        (
            [(torch.ones(2),), (torch.ones(2, dtype=torch.float64),)],
            r"output\[0\] has dtype torch.float32 in replica 0 but torch.float64 in replica 1",
        ),
        ([], r"`outputs` expected a non-empty sequence"),
    ],
)
def test_gather_errors(outputs: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fdp.gather(outputs, "cpu")


@pytest.mark.parametrize(
    ("outputs", "dim", "match"),
    [
        (
            [torch.ones(2, 3), torch.ones(2, 4)],
            0,
            r"output leaf output cannot be joined along dim 0: expected \(replica 0\) shape "
            r"\(2, 3\) in every other dimension, got \(replica 1\) \(2, 4\)",
        ),
        (
            # torch.cat alone would skip the empty 1-D tensor and succeed.
            [torch.ones(2, 3), torch.ones(0)],
            0,
            r"output leaf output cannot be joined along dim 0.*got \(replica 1\) \(0,\)",
        ),
        (
            [torch.ones(2), torch.ones(2, dtype=torch.float64)],
            0,
            r"output has dtype torch.float32 in replica 0 but torch.float64 in replica 1",
        ),
        ([torch.ones(2, 2)] * 2, 2, r"out of range for output leaf output, .*got dim=2"),
    ],
)
def test_gather_errors_for_one_tensor_per_replica(
    outputs: list[torch.Tensor], dim: int, match: str
) -> None:
    # One tensor per replica takes the fast join; errors must read the same.
    with pytest.raises(ValueError, match=match):
        fdp.gather(outputs, "cpu", dim=dim)


def test_gather_dim_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"out of range for output leaf output\['y'\].*got dim=2"):
        fdp.gather([{"y": torch.ones(2, 2)}] * 2, "cpu", dim=2)


def test_placement_on_fake_devices() -> None:
    """Chunks land on their own device; gather brings everything to the output device."""
    x = torch.randn(6, 2)
    inputs = label((x, {"m": torch.arange(6)}), 0)
    chunks = fdp.scatter(inputs, [fake(0), fake(1), fake(2)])
    for i, (cx, cd) in enumerate(chunks):
        assert cx.device == fake(i)
        assert cd["m"].device == fake(i)
    torch.testing.assert_close(plain(chunks[2][0]), x[4:])
    with count_copies() as copies:
        out = fdp.gather([c[0] * 1 for c in chunks], fake(1))
    assert out.device == fake(1)
    assert copies() == 2  # the chunks from devices 0 and 2
    torch.testing.assert_close(plain(out), x)
    assert fdp.gather([torch.ones(1)], -1).device == CPU


# --- the containers users really pass ----------------------------------------


class DictSub(dict):  # type: ignore[type-arg]
    pass


class ListSub(list):  # type: ignore[type-arg]
    pass


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """Like Hugging Face's BatchEncoding: a UserDict with extra state."""

    def __init__(self, data: dict[str, Any], extra: str = "tok") -> None:
        super().__init__(data)
        self.extra = extra


@dataclasses.dataclass(frozen=True)
class Example:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "ex"


class Registered:
    def __init__(self, x: torch.Tensor, tag: str) -> None:
        self.x, self.tag = x, tag


class TorchRegistered:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def _flatten_registered(r: Any) -> Any:
    return (r.x,), r.tag


def _unflatten_registered(tag: Any, children: Any) -> Any:
    return Registered(children[0], tag)


def _flatten_torch(r: Any) -> Any:
    return [r.x], None


def _unflatten_torch(children: Any, context: Any) -> Any:
    return TorchRegistered(children[0])


optree.register_pytree_node(
    Registered,  # type: ignore[arg-type]
    _flatten_registered,
    _unflatten_registered,
    namespace="user",
)
torch.utils._pytree.register_pytree_node(TorchRegistered, _flatten_torch, _unflatten_torch)


def containers(x: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    """name -> (batch, how to read its tensors back as a tuple)."""
    return {
        "dict_subclass": (DictSub(a=x, b=x * 2), lambda b: (b["a"], b["b"])),
        "list_subclass": (ListSub([x, x + 1]), lambda b: (b[0], b[1])),
        "user_dict": (Encoding({"ids": x}), lambda b: (b["ids"],)),
        "dataclass": (Example(x, x * 3), lambda b: (b.x, b.y)),
        "optree_namespace": (Registered(x, "t"), lambda b: (b.x,)),
        "torch_pytree": (TorchRegistered(x), lambda b: (b.x,)),
        "nested": ({"e": [Example(x, x)]}, lambda b: (b["e"][0].x, b["e"][0].y)),
    }


@pytest.mark.parametrize("name", list(containers(torch.zeros(1))))
def test_user_containers_are_split_and_rebuilt(name: str) -> None:
    x = torch.randn(7, 3, requires_grad=True)
    batch, read = containers(x)[name]
    chunks = fdp.scatter(batch, ["cpu"] * 3)
    assert len(chunks) == 3
    start = 0
    for (chunk,), size in zip(chunks, expected_sizes(7, 3), strict=True):
        assert type(chunk) is type(batch)
        for got, want in zip(read(chunk), read(batch), strict=True):
            torch.testing.assert_close(got, want[start : start + size])
        start += size
    assert getattr(chunks[0][0], "extra", None) == getattr(batch, "extra", None)

    # data_parallel: outputs and grads equal one call on the whole batch.
    w = torch.randn(3, 2, requires_grad=True)

    def fn(w: torch.Tensor, b: Any) -> torch.Tensor:
        out: torch.Tensor = sum(t @ w for t in read(b))
        return out

    out = fdp.data_parallel(fn, w, batch, devices=["cpu"] * 3)
    ref_w = w.detach().clone().requires_grad_()
    ref = fn(ref_w, batch)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), [w, x], retain_graph=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), [ref_w, x])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_user_containers_are_gathered_in_their_type() -> None:
    outs = [DictSub(y=torch.zeros(2)), DictSub(y=torch.ones(1))]
    got = fdp.gather(outs, "cpu")
    assert type(got) is DictSub
    torch.testing.assert_close(got["y"], torch.tensor([0.0, 0.0, 1.0]))
    example = fdp.gather(
        [Example(torch.zeros(1), torch.ones(1)), Example(torch.ones(1), torch.zeros(1))], "cpu"
    )
    assert type(example) is Example
    torch.testing.assert_close(example.x, torch.tensor([0.0, 1.0]))


def test_user_containers_without_tensors_are_shared_whole() -> None:
    config = Encoding({"mode": "fast"})
    (_a, c1), (_b, c2) = fdp.scatter((torch.arange(4), config), ["cpu", "cpu"])
    assert c1 is config
    assert c2 is config


class Opaque:
    def __init__(self, x: torch.Tensor) -> None:
        self.inner = {"x": x}


def test_unsplittable_objects_holding_tensors_are_refused() -> None:
    with pytest.raises(
        TypeError,
        match=r"fdp.scatter: leaf inputs\[0\] is a Opaque, which fdp cannot split, and it "
        r"holds a tensor at inputs\[0\].inner\[0\]; expected tensors in a dict",
    ):
        fdp.scatter(Opaque(torch.zeros(4)), ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"fdp.data_parallel: leaf kwargs\['o'\] is a Opaque"):
        fdp.data_parallel(
            lambda p, x, o: x, None, torch.zeros(4), kwargs={"o": Opaque(torch.zeros(4))}
        )


def test_modules_passed_as_arguments_are_shared_not_refused() -> None:
    net = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    out = fdp.data_parallel(lambda p, x, m: m(x), None, x, kwargs={"m": net}, devices=["cpu"] * 2)
    torch.testing.assert_close(out, net(x))


def test_numpy_arrays_and_sparse_or_nested_tensors_are_refused() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(
        TypeError, match=r"fdp.scatter: leaf inputs\[1\] is a numpy array of shape \(4, 2\)"
    ):
        fdp.scatter((torch.zeros(4), np.zeros((4, 2))), ["cpu", "cpu"])
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(
        TypeError,
        match=r"fdp.scatter: leaf inputs\[0\] expected a dense \(strided\) tensor .* "
        r"got layout torch.sparse_coo",
    ):
        fdp.scatter(sparse, ["cpu", "cpu"])
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"got a nested \(jagged\) tensor"):
        fdp.scatter({"n": nested}, ["cpu", "cpu"])
